"""The one policy parser every front end takes: a preset name, JSON text, a path to a JSON
file, a dict of fields or a :class:`~hf_precision.PrecisionPolicy`, with field
overrides; and the one refusal of float16 trainable weights under a GradScaler.

>>> parse_policy("bf16", mode="raise").mode
'raise'
>>> parse_policy('{"compute_dtype": "bfloat16"}').compute_dtype
torch.bfloat16
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ...errors import PrecisionError
from .precision_policy import PrecisionPolicy

#: What :func:`parse_policy` reads.
PolicySpec = PrecisionPolicy | str | Path | Mapping[str, Any] | None


def _as_call(err: PrecisionError, call: str) -> PrecisionError:
    """``err`` said as the user's own ``call`` (a front end's), not the inner one."""
    return PrecisionError(f"{call}: {str(err).split(': ', 1)[-1]}")


def _parse(spec: PolicySpec) -> PrecisionPolicy:
    if spec is None:  # a stand-in, to validate overrides before the model is known
        return PrecisionPolicy.from_preset("fp32")
    return PrecisionPolicy.resolve(spec)


def parse_policy(spec: PolicySpec, *, call: str | None = None, **overrides: Any) -> PrecisionPolicy:
    """The policy ``spec`` names (a :class:`PrecisionPolicy` as is, a preset name, JSON
    text, a path to a JSON file ``PrecisionPolicy.to_json()`` wrote, a dict of fields, or
    ``None`` for the ``fp32`` stand-in), with the non-``None`` ``overrides`` applied through
    :meth:`PrecisionPolicy.replace` (a new policy: the caller's is unchanged). A bad value
    raises a :class:`PrecisionError` that repeats ``call``, the user's own call, when given."""
    try:
        policy = _parse(spec)
        changes = {k: v for k, v in overrides.items() if v is not None}
        return policy.replace(**changes) if changes else policy
    except PrecisionError as err:
        if call is None:
            raise
        raise _as_call(err, call) from None


def refuse_fp16_trainables(
    policy: PrecisionPolicy, flag: str | None, trainable: bool, *, call: str, said: str, **how: str
) -> None:
    """Refuse float16 trainable weights under an fp16 flag: the GradScaler cannot unscale
    float16 gradients. ``how`` says whose scaler (``scaler``) and the fix (``fix``)."""
    if flag != "fp16" or policy.trainable_dtype != torch.float16 or not trainable:
        return
    raise PrecisionError(
        f"{call} with {said}: trainable weights in float16 ({policy.describe()}); "
        f"{how.get('scaler', 'the GradScaler')} raises 'Attempting to unscale FP16 gradients'. "
        f"Nothing was cast.\nFix: {how['fix']}."
    )
