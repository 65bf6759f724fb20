"""Preset names: the table of named presets (``bf16``, ``bf16-true``, ...) and the one check
of a preset name, one vocabulary for Python and the ``hf-precision`` CLI.
:func:`hf_precision.rules.policy.precision_policy.register_preset` adds to these tables."""

from __future__ import annotations

from typing import Any

import torch

from ...base.names import preset_hint
from ...errors import PrecisionError

#: preset -> (compute, frozen, trainable)
PRESETS: dict[str, tuple[torch.dtype, torch.dtype, torch.dtype]] = {
    "bf16": (torch.bfloat16, torch.bfloat16, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16, torch.float32),
    "fp16-true": (torch.float16, torch.float16, torch.float16),
    "fp32": (torch.float32, torch.float32, torch.float32),
}
PRESET_HELP = {
    "bf16": "frozen weights bf16, trainable weights fp32, compute bf16 (Trainer bf16=True)",
    "bf16-true": "everything bf16, trainable weights too (pure bf16 training/inference)",
    "fp16": "frozen weights fp16, trainable weights fp32 for the GradScaler (Trainer fp16=True)",
    "fp16-true": "everything fp16 (inference only: the GradScaler cannot unscale fp16 grads)",
    "fp32": "everything fp32",
}
#: preset -> PrecisionPolicy fields it sets beyond the three dtypes (see :func:`register_preset`)
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {}


def preset_name(name: object, *, call: str = "PrecisionPolicy.from_preset") -> str:
    """``name`` when it is a preset name, else a :class:`PrecisionError` that says which
    preset was probably meant: one vocabulary for Python and the ``hf-precision`` CLI (names
    are exact and lower case; :data:`PRESET_MISNAMES` lists what other tools call them).

    >>> preset_name("bf16-true")
    'bf16-true'
    >>> try:
    ...     preset_name("bfloat16")
    ... except PrecisionError as err:
    ...     print(str(err).splitlines()[0].split(". ", 1)[1])
    Did you mean 'bf16' (frozen bf16, trainable fp32) or 'bf16-true' (all bf16)?
    """
    if isinstance(name, str) and name in PRESETS:
        return name
    hint = preset_hint(name, PRESETS)
    listing = "\n".join(f"  {k:<10} {v}" for k, v in PRESET_HELP.items())
    raise PrecisionError(
        f"{call}({name!r}): unknown preset {name!r}.{hint}\n"
        f"Allowed:\n{listing}\nFix: pass one of these names, or build "
        "PrecisionPolicy(compute_dtype=..., frozen_dtype=..., trainable_dtype=...)."
    )
