"""Dtype names, parsing and the few facts about dtypes the guard relies on."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import torch

from .errors import PrecisionError

#: Canonical names (what ``str(torch.bfloat16)`` says without ``torch.``) and their aliases.
_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "f16": torch.float16,
}
#: Dtypes a policy may ask for. float64 is accepted for completeness (tests, numerics).
POLICY_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
)
_ALIASES["float64"] = torch.float64
_ALIASES["fp64"] = torch.float64

SHORT_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
}

#: Storage dtypes that mean "quantized": never cast, counted apart in the dtype map.
_QUANT_DTYPES: set[torch.dtype] = {torch.int8, torch.uint8}
for _name in (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
):
    if hasattr(torch, _name):
        _QUANT_DTYPES.add(getattr(torch, _name))
for _name in ("int4", "uint4", "quint4x2", "qint8", "quint8"):
    if hasattr(torch, _name):
        _QUANT_DTYPES.add(getattr(torch, _name))
#: Parameter classes of bitsandbytes & co. whose storage is packed.
_QUANT_PARAM_CLASSES = {"Params4bit", "Int8Params", "QBytesTensor", "AffineQuantizedTensor"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of ``config.json``'s ``torch_dtype``)."""
    return str(dtype).removeprefix("torch.")


def allowed_dtype_names() -> str:
    return ", ".join(f"{dtype_name(d)} ({SHORT_NAMES[d]})" for d in POLICY_DTYPES)


def parse_dtype(value: object, *, call: str) -> torch.dtype:
    """Turn ``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"`` or ``torch.bfloat16`` into a dtype.

    ``call`` is how the user called us (repeated in the error message).

    >>> parse_dtype("bf16", call="x")
    torch.bfloat16
    """
    if isinstance(value, torch.dtype):
        if value in POLICY_DTYPES:
            return value
        raise PrecisionError(
            f"{call}: {value} is not a floating dtype a policy can use.\n"
            f"Allowed: {allowed_dtype_names()}.\n"
            "Fix: pass one of these (quantized storage is never cast by the guard)."
        )
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _ALIASES:
            return _ALIASES[key]
        close = difflib.get_close_matches(key, list(_ALIASES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise PrecisionError(
            f"{call}: unknown dtype {value!r}.{hint}\n"
            f"Allowed: {allowed_dtype_names()}.\n"
            "Fix: pass one of these names or a torch.dtype."
        )
    raise PrecisionError(
        f"{call}: expected a dtype name or torch.dtype, got {type(value).__name__} {value!r}.\n"
        f"Allowed: {allowed_dtype_names()}."
    )


def is_quantized(tensor: torch.Tensor) -> bool:
    """True for packed/quantized storage (int8, uint8, fp8, 4-bit param classes)."""
    return tensor.dtype in _QUANT_DTYPES or type(tensor).__name__ in _QUANT_PARAM_CLASSES


def is_castable(tensor: torch.Tensor) -> bool:
    """Floating, not quantized: the only tensors the guard may cast."""
    return tensor.is_floating_point() and not is_quantized(tensor)


def zero3_dtype(p: torch.Tensor) -> torch.dtype | None:
    """The storage dtype of a parameter DeepSpeed ZeRO-3 partitioned (its ``ds_tensor``, the
    local partition), or ``None`` for any other tensor. Metadata only: nothing is gathered."""
    if not hasattr(p, "ds_id"):
        return None
    part = getattr(p, "ds_tensor", None)
    return part.dtype if isinstance(part, torch.Tensor) else p.dtype


def narrows_range(src: torch.dtype, dst: torch.dtype) -> bool:
    """True when ``dst`` cannot hold every finite value of ``src`` (e.g. fp32/bf16 -> fp16)."""
    if not (src.is_floating_point and dst.is_floating_point):
        return False
    return bool(torch.finfo(dst).max < torch.finfo(src).max)


def majority_dtype(pairs: Iterable[tuple[torch.dtype, int]]) -> torch.dtype | None:
    """The dtype holding most elements among ``(dtype, numel)`` pairs (ties: first seen)."""
    counts: dict[torch.dtype, int] = {}
    for dtype, numel in pairs:
        counts[dtype] = counts.get(dtype, 0) + numel
    if not counts:
        return None
    return max(counts, key=lambda d: counts[d])
