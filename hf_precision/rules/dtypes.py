"""Dtype names, parsing and the few facts about dtypes the guard relies on."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from ..base.registry import add_entry
from ..errors import PrecisionError, did_you_mean

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
#: Quantized storage recognised by type, never by dtype (torchao and optimum-quanto tensors
#: report the floating dtype they dequantize to): class names (any class in the MRO) and
#: module prefixes of the classes -> the library. Libraries are never imported to check.
QUANTIZED_CLASSES: dict[str, str] = {
    "Params4bit": "bitsandbytes",
    "Int8Params": "bitsandbytes",
    "QTensor": "optimum-quanto",
    "QBytesTensor": "optimum-quanto",
    "AffineQuantizedTensor": "torchao",
    "TorchAOBaseTensor": "torchao",
    "NF4Tensor": "torchao",
    "Float8Tensor": "torchao",
    "HQQLinear": "hqq",
}
QUANTIZED_MODULES: dict[str, str] = {
    "torchao.": "torchao",
    "optimum.quanto.": "optimum-quanto",
    "bitsandbytes.": "bitsandbytes",
    "hqq.": "hqq",
    "compressed_tensors.": "compressed-tensors",
}


def register_quantized(name: str, library: str) -> None:
    """Recognise a new library's quantized tensors: ``name`` is a tensor class name (any class
    in the MRO) or, ending with ``.``, a module prefix.

    >>> register_quantized("mylib.", "mylib")
    """

    def add(key: str) -> None:
        (QUANTIZED_MODULES if key.endswith(".") else QUANTIZED_CLASSES)[key] = library

    add_entry(
        f"register_quantized({name!r}, {library!r})",
        name,
        pattern=_QUANTIZED_NAME_RE,
        example="register_quantized('MyQTensor', 'mylib') or ('mylib.', 'mylib')",
        exists=lambda key: key in QUANTIZED_MODULES or key in QUANTIZED_CLASSES,
        add=add,
        duplicate="replace",
        rule="a tensor class name or a module prefix ending with '.'",
    )


#: A tensor class name, or a dotted module prefix ending with ``.``.
_QUANTIZED_NAME_RE = re.compile(r"^[A-Za-z_][\w.]*$")


def quantized_library(tensor: torch.Tensor) -> str | None:
    """The library whose quantized storage ``tensor`` is (``"torchao"``, ``"bitsandbytes"``,
    ...), ``"packed"`` for integer/fp8 storage of unknown origin, or ``None``."""
    cls = type(tensor)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return "packed" if tensor.dtype in _QUANT_DTYPES else None
    for base in cls.__mro__:
        if base is torch.Tensor:
            break
        lib = QUANTIZED_CLASSES.get(base.__name__)
        if lib is None:
            module = base.__module__ + "."
            lib = next((v for k, v in QUANTIZED_MODULES.items() if module.startswith(k)), None)
        if lib is not None:
            return lib
    return "packed" if tensor.dtype in _QUANT_DTYPES else None


def quantized_compute_dtype(
    tensor: torch.Tensor, module: torch.nn.Module | None = None
) -> torch.dtype | None:
    """The floating dtype a quantized weight computes in: the dtype torchao and optimum-quanto
    tensors report (what they dequantize to), bitsandbytes' ``compute_dtype`` (its module's, or
    the quant state's), ``None`` when the storage does not say (packed int8, bnb 8-bit: those
    layers compute in the dtype of their input)."""
    if tensor.is_floating_point() and quantized_library(tensor) not in (None, "packed"):
        return tensor.dtype
    dtype = getattr(module, "compute_dtype", None)
    if dtype is None:
        dtype = getattr(getattr(tensor, "quant_state", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def quantized_format(tensor: torch.Tensor, module: torch.nn.Module | None = None) -> str:
    """How the dtype map names quantized storage: ``library:format->compute dtype``
    (``"bitsandbytes:nf4->bfloat16"``, ``"optimum-quanto:qint8->bfloat16"``,
    ``"torchao:Int8Tensor->bfloat16"``), or the storage dtype (``"int8"``) for packed tensors
    of unknown origin.

    >>> quantized_format(torch.zeros(2, dtype=torch.int8))
    'int8'
    """
    library = quantized_library(tensor)
    if library is None or library == "packed":
        return dtype_name(tensor.dtype)
    qtype = getattr(tensor, "qtype", None)  # optimum-quanto
    fmt = getattr(tensor, "quant_type", None) or getattr(qtype, "name", None)  # bnb 4-bit
    if not isinstance(fmt, str):
        fmt = {"Int8Params": "int8"}.get(type(tensor).__name__, type(tensor).__name__)
    compute = quantized_compute_dtype(tensor, module)
    return f"{library}:{fmt}" + (f"->{dtype_name(compute)}" if compute is not None else "")


def logical_numel(tensor: torch.Tensor) -> int:
    """How many weights a tensor stands for: bitsandbytes packs two 4-bit weights per byte and
    keeps the real shape in its quant state; every other tensor reports its own."""
    shape = getattr(getattr(tensor, "quant_state", None), "shape", None)
    if isinstance(shape, (torch.Size, tuple, list)) and shape:
        return int(torch.Size(shape).numel())
    return tensor.numel()


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes the tensor really holds: the sum of a tensor subclass's inner tensors
    (``__tensor_flatten__``: torchao, optimum-quanto), else ``numel * element_size``."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(
        tensor, "__tensor_flatten__"
    ):
        try:
            names = tensor.__tensor_flatten__()[0]
        except Exception:  # a subclass that cannot flatten: count what it reports
            names = ()
        inner = [getattr(tensor, n, None) for n in names]
        if inner and all(isinstance(t, torch.Tensor) for t in inner):
            return sum(storage_bytes(t) for t in inner if isinstance(t, torch.Tensor))
    return tensor.numel() * tensor.element_size()


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
        hint = did_you_mean(key, _ALIASES)
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
    """True for quantized storage: packed int8/uint8/fp8 tensors and the tensor classes of
    bitsandbytes, torchao, optimum-quanto, HQQ, compressed-tensors (see
    :func:`quantized_library`). Such tensors are never cast, range-checked or written."""
    return quantized_library(tensor) is not None


def is_castable(tensor: torch.Tensor) -> bool:
    """Floating, not quantized: the only tensors the guard may cast."""
    return tensor.is_floating_point() and not is_quantized(tensor)


def is_castable_input(tensor: torch.Tensor) -> bool:
    """An input a guard may cast at run time: a castable tensor, or a plain fp8 one (an
    activation code cast to ``model.dtype`` where that reads a layer's fp8 storage: nothing
    owns it, and no layer takes an fp8 input as it is)."""
    if is_castable(tensor):
        return True
    plain = type(tensor) in (torch.Tensor, torch.nn.Parameter)
    return plain and tensor.is_floating_point() and tensor.dtype in _QUANT_DTYPES


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
