"""Batch fixing: floating tensors built by collators, processors and eval scripts follow the
policy; integer/bool tensors, labels and metadata (``second_per_grid_ts``, timesteps, fps:
:mod:`hf_precision.rules.batch_keys`) are left alone.

>>> import torch
>>> from hf_precision import PrecisionCollator
>>> collate = PrecisionCollator(policy="bf16")
>>> batch = collate([{"pixel_values": torch.rand(3, 4, 4), "input_ids": torch.tensor([1, 2])}])
>>> batch["pixel_values"].dtype, batch["input_ids"].dtype
(torch.bfloat16, torch.int64)
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import PrecisionError, check_model
from ..rules.batch_keys import batch_key_kind, notice_unknown
from ..rules.dtypes import dtype_name, is_castable, is_castable_input, narrows_range
from ..rules.policy.fields import Mode
from ..rules.policy.precision_policy import PrecisionPolicy
from .range_check import Site, clamp_on_device, say_clamped

_MASK_HINTS = ("mask", "bias")


def is_mask_key(key: str) -> bool:
    """Float masks/additive biases hold ``finfo.min`` sentinels instead of data."""
    key = key.lower()
    return any(h in key for h in _MASK_HINTS)


def _all_finite(t: torch.Tensor) -> bool:
    """No inf/nan in ``t``: one reduction and no temporary (``isinf().any()`` on a CPU bf16
    tensor costs several times the cast itself)."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def cast_tensor(
    t: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device | None = None,
    *,
    key: str = "",
    mode: Mode = "fix",
    where: str = "batch",
    ranges: dict[str, Site] | None = None,
) -> torch.Tensor:
    """Cast one floating tensor without creating ``inf``.

    Mask sentinels (``finfo(src).min``, ``-inf``) become ``finfo(dst).min``; other values
    beyond the target range raise in ``raise`` mode, or are clamped with a warning. With
    ``ranges`` (a guard's cast sites: the hooks pass theirs) the check runs on the device and
    its warning can come at the guard's next read, with no host sync per cast
    (:mod:`hf_precision.engine.range_check`); without, it is read at once.
    """
    if not is_castable_input(t):
        # ids and bool masks keep their dtype but follow the device, like the floats beside them
        return t if device is None or t.device == device else t.to(device)
    same_dev = device is None or t.device == device
    if t.dtype == dtype and same_dev:
        return t
    if mode == "raise":
        raise PrecisionError(
            f"{where}: {key or 'tensor'} is {dtype_name(t.dtype)} on {t.device}, the policy "
            f"expects {dtype_name(dtype)}{'' if same_dev else f' on {device}'}.\n"
            "Fix: cast it where it is built (collator/processor), wrap the collator in "
            "PrecisionCollator, or use the guard in mode='fix'."
        )
    out = t.to(device=device, dtype=dtype)
    if narrows_range(t.dtype, dtype) and out.numel():
        info = torch.finfo(dtype)
        if is_mask_key(key) or (
            out.device.type != "cpu" and info.max >= torch.finfo(t.dtype).max / 2
        ):
            # Masks: sentinels (and -inf) -> finfo(dst).min. And a downcast that keeps the
            # exponent range (fp32 -> bf16) overflows only on values within 0.4% of fp32's max,
            # i.e. sentinels: on an accelerator they are clamped the same way, without the host
            # sync a check would cost (a sync per guarded cast stalls the launch queue).
            out.clamp_(min=info.min, max=info.max)
        elif torch.compiler.is_compiling():
            # Under torch.compile a Python-level read of a value breaks the graph: clamp what
            # the cast made inf (not what was inf already), branch-free and without a warning.
            made_inf = out.isinf() & ~t.isinf()
            out = torch.where(made_inf, out.clamp(min=info.min, max=info.max), out)
        elif ranges is not None:  # a guard's hook: checked on the device, read later
            clamp_on_device(t, out, ranges, key=key, where=where)
        elif not _all_finite(out) and bool(out.isinf().any()) and not bool(t.isinf().any()):
            amax = float(t.detach().abs().amax())
            say_clamped(where, key, amax, dtype, late=False, stacklevel=4)
            out.clamp_(min=info.min, max=info.max)
    return out


def _is_activation(t: torch.Tensor, key: str, dtype: torch.dtype, where: str) -> bool:
    """A floating tensor at ``key`` is an activation the policy casts; metadata (registered
    names) and unknown 0-D/1-D tensors keep their dtype (see :mod:`hf_precision.rules.batch_keys`).
    Asked only when there is a cast to decide (nothing said for a tensor already in ``dtype``)."""
    if not key or t.dtype == dtype or not t.is_floating_point():
        return True
    kind = batch_key_kind(key, t)
    if kind == "unknown_small":
        notice_unknown(key, t, where)
    return kind == "activation"


def cast_batch(
    batch: Any,
    dtype: torch.dtype,
    *,
    key_dtypes: Mapping[str, torch.dtype] | None = None,
    skip_keys: tuple[str, ...] = (),
    device: torch.device | None = None,
    mode: Mode = "fix",
    where: str = "batch",
    ranges: dict[str, Site] | None = None,
    _key: str = "",
) -> Any:
    """Cast every floating tensor in a (nested) batch; containers keep their types. Per-key
    dtypes: ``key_dtypes`` (``pixel_values`` -> the vision encoder's); ``skip_keys`` (labels)
    unchanged; metadata (``second_per_grid_ts``, fps …: :mod:`hf_precision.rules.batch_keys`)
    keeps its dtype, follows ``device``; ``ranges``: as in :func:`cast_tensor`."""
    if isinstance(batch, torch.Tensor):
        target = (key_dtypes or {}).get(_key)
        if target is None:
            target = dtype if _is_activation(batch, _key, dtype, where) else batch.dtype
        return cast_tensor(batch, target, device, key=_key, mode=mode, where=where, ranges=ranges)
    if not isinstance(batch, (Mapping, list, tuple)):
        return batch
    again = functools.partial(
        cast_batch,
        dtype=dtype,
        key_dtypes=key_dtypes,
        skip_keys=skip_keys,
        device=device,
        mode=mode,
        where=where,
        ranges=ranges,
    )
    if isinstance(batch, Mapping):
        changed = {}
        for k, v in batch.items():
            if k in skip_keys:
                continue
            new = again(v, _key=str(k))
            if new is not v:
                changed[k] = new
        if not changed:
            return batch
        if isinstance(batch, dict):
            out: Any
            out = dict(batch) if type(batch) is dict else copy.copy(batch)
            for k, v in changed.items():  # ModelOutput forbids update() but allows out[k] = v
                out[k] = v
            return out
        # BatchFeature / BatchEncoding are UserDicts: copy keeps their extras (encodings).
        out = copy.copy(batch)
        out.data = dict(batch.data)  # type: ignore[attr-defined]
        out.data.update(changed)  # type: ignore[attr-defined]
        return out
    items = [again(v, _key=_key) for v in batch]
    if all(a is b for a, b in zip(items, batch, strict=True)):
        return batch
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*items)
    return type(batch)(items)


def eager_when_compiled_alone(*fns: Callable[..., Any]) -> None:
    """Let ``torch.compile`` run these functions eagerly when one is a frame of its own, and
    trace them as before when a compiled caller calls them.

    ``torch.compile(model)`` calls the model's own hooks outside its graph and compiles each
    hook's frame as a separate graph: the batch hook's cast became one more graph (one more
    graph break in ``torch._dynamo.explain``) than a batch cast by hand. A skipped frame runs
    eagerly (the cast is one kernel either way); inside a compiled region (a compiled
    ``PeftModel`` calling the guarded base model) the functions are still inlined, with no
    break. The cast functions of this module are always included. ``skip_code`` is
    torch-internal: without it nothing changes but the graph count.
    """
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # pragma: no cover - another torch: one more graph, still correct
        return
    for fn in (
        cast_batch,
        cast_tensor,
        _all_finite,
        _is_activation,
        batch_key_kind,
        is_mask_key,
        is_castable,
        narrows_range,
        clamp_on_device,
        *fns,
    ):
        skip_code(fn.__code__)


def key_dtypes_for(
    policy: PrecisionPolicy, group_dtypes: Mapping[str, torch.dtype] | None = None
) -> dict[str, torch.dtype]:
    """Per-key targets: keys mapped to a group follow that group's (receiving) dtype."""
    out = {}
    for key, group in policy.batch_key_groups.items():
        if group_dtypes and group in group_dtypes:
            out[key] = group_dtypes[group]
        else:
            out[key] = policy.group_dtype(group)
    return out


class PrecisionCollator:
    """Wrap any data collator so the batches it builds follow the policy.

    >>> from transformers import default_data_collator
    >>> collate = PrecisionCollator(default_data_collator, policy="fp16")
    """

    def __init__(
        self,
        collator: Callable[[Any], Any] | None = None,
        policy: PrecisionPolicy | str | None = None,
        *,
        model: nn.Module | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        call = "PrecisionCollator(collator, policy)"
        if collator is None:
            from transformers import default_data_collator

            collator = default_data_collator
        elif not callable(collator):
            raise PrecisionError(
                f"{call}: the collator must be callable (features -> batch), got a value of type "
                f"{type(collator).__name__}. Fix: pass your data collator first, "
                "PrecisionCollator(DataCollatorWithPadding(tokenizer), 'bf16', model=model), or "
                "None for transformers' default_data_collator; the policy comes second."
            )
        if model is not None:
            check_model(model, f"{call[:-1]}, model=model)")
        self.collator = collator
        self.policy = PrecisionPolicy.resolve(policy, model)
        group_dtypes = None
        if model is not None:
            from ..model.dtype_maps import receiving_dtypes

            group_dtypes = receiving_dtypes(model)
        self.key_dtypes = key_dtypes_for(self.policy, group_dtypes)
        self.device = torch.device(device) if device is not None else None

    def __call__(self, features: Any) -> Any:
        batch = self.collator(features)
        if not self.policy.cast_batch or self.policy.mode == "audit":
            return batch
        return cast_batch(
            batch,
            self.policy.compute_dtype,
            key_dtypes=self.key_dtypes,
            skip_keys=self.policy.batch_skip_keys,
            device=self.device,
            mode=self.policy.mode,
            where="PrecisionCollator",
        )

    def __repr__(self) -> str:
        return f"PrecisionCollator({self.collator!r}, policy={self.policy.describe()!r})"
