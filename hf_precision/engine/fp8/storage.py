"""fp8 storage: weights kept in fp8 between calls and computed in a wider dtype.

Layerwise casting (diffusers' ``enable_layerwise_casting``, accelerate's
``attach_layerwise_casting_hooks``; :func:`~hf_precision.model.fp8.layerwise_cast`) stores each
layer's weights in ``float8_e4m3fn`` and casts them to ``compute_dtype`` for that layer's
forward only. Two things follow, and the guard handles both before the first step:

- **no trainable fp8 tensor** (:func:`check_trainable_fp8`): a weight that requires grad and is
  stored in fp8 cannot be trained (its gradient arrives in the compute dtype, an optimizer's
  update fails on fp8 or rounds below its 2- or 3-bit mantissa). The usual cause is the
  order: a PEFT adapter added *after* the cast is created in its base layer's dtype, fp8.
  Refused with the modules, the dtype and the order fix (mode ``audit``: a finding).
- **storage is not compute** (:func:`fp8_first_layers`, :func:`fp8_model_dtype_note`):
  transformers' ``model.dtype`` is the first floating parameter; where that one is stored in
  fp8, ``pixel_values.to(self.dtype)`` (Idefics2/3, SmolVLM, InternVL) makes fp8 activations
  and the first convolution fails (``"slow_conv2d_cpu" not implemented for
  'Float8_e4m3fn'``). The layer holding it gets an entry guard in its compute dtype, as the
  group boundaries already receive it (the view reads a layerwise weight at its compute dtype),
  and the plan says once that the model's own cast rounded the values.

Tensor subclasses that hold fp8 data behind a floating dtype (torchao's, TransformerEngine's
fp8 primary weights) are not plain fp8 tensors: their libraries train them.

>>> from torch import nn
>>> from hf_precision.model.view import ModelView
>>> check_trainable_fp8(ModelView.of(nn.Linear(2, 2)), "setup", "fix")
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import PrecisionError, PrecisionWarning
from ...model.fp8 import is_fp8, layerwise_cast
from ...model.view import ModelView, layerwise_compute_dtype
from ...rules.dtypes import dtype_name, quantized_compute_dtype, quantized_format
from ...rules.keep_rules import DTYPE_CONSUMERS
from ...watch.finding import Finding

#: how many names a message lists before "and N more"
_LISTED = 3
#: ``(storage, compute, library)`` of a layerwise casting hook (:func:`layerwise_cast`)
LayerwiseCast = tuple[torch.dtype, torch.dtype, str]


def _plain_fp8(t: torch.Tensor) -> bool:
    """A plain tensor holding fp8 values (no library's subclass: torchao's and
    TransformerEngine's fp8 weights report a floating dtype and are trained by their library)."""
    return is_fp8(t.dtype) and type(t) in (torch.Tensor, nn.Parameter)


def stored_compute(t: torch.Tensor, mod: nn.Module | None) -> torch.dtype | None:
    """The dtype a weight that is not castable (quantized, fp8) computes in: a layerwise
    casting hook's compute dtype, else what the quantization library says
    (:func:`~hf_precision.rules.dtypes.quantized_compute_dtype`), else ``None``."""
    return layerwise_compute_dtype(t, mod) or quantized_compute_dtype(t, mod)


def stored_format(t: torch.Tensor, mod: nn.Module | None) -> str:
    """How the plan names such storage: ``"diffusers layerwise:float8_e4m3fn->bfloat16"``,
    else :func:`~hf_precision.rules.dtypes.quantized_format`."""
    cast = layerwise_cast(mod) if mod is not None else None
    if cast is not None and t.dtype == cast[0]:
        return f"{cast[2]} layerwise:{dtype_name(cast[0])}->{dtype_name(cast[1])}"
    return quantized_format(t, mod)


def casting_call(cast: LayerwiseCast, storage: str, compute: str) -> str:
    """The call that set up ``cast``, in its library's words (for fix messages)."""
    if cast[2] == "accelerate":
        return (
            f"attach_layerwise_casting_hooks(model, storage_dtype=torch.{storage}, "
            f"compute_dtype=torch.{compute})"
        )
    return (
        f"model.enable_layerwise_casting(storage_dtype=torch.{storage}, "
        f"compute_dtype=torch.{compute})"
    )


@dataclass(frozen=True)
class TrainableFp8:
    """One trainable parameter stored in fp8: its path, its module's path, its dtype, the
    path of the PEFT tuner layer it belongs to (``None`` for a model weight) and the layerwise
    casting that stored it (its own layer's, else its base layer's), when one did."""

    name: str
    module: str
    dtype: torch.dtype
    adapter: str | None
    cast: LayerwiseCast | None


def _tuner_of(path: str, tuners: dict[str, nn.Module]) -> str | None:
    """The PEFT tuner layer ``path`` lies under (a prefix of it), or ``None``."""
    end = path.rfind(".")
    while end > 0:
        if path[:end] in tuners:
            return path[:end]
        end = path.rfind(".", 0, end)
    return None


def trainable_fp8(view: ModelView) -> list[TrainableFp8]:
    """Every parameter of the walk that requires grad and is a plain fp8 tensor."""
    tuners: dict[str, nn.Module] = {}
    out: list[TrainableFp8] = []
    seen: set[int] = set()
    for path, _, mod in view.modules:
        if hasattr(mod, "adapter_layer_names"):  # peft's BaseTunerLayer
            tuners[path] = mod
        for key, p in mod._parameters.items():
            if p is None or id(p) in seen or not (p.requires_grad and _plain_fp8(p)):
                continue
            seen.add(id(p))
            tuner = _tuner_of(path, tuners) if tuners else None
            base = getattr(tuners[tuner], "base_layer", None) if tuner is not None else None
            adapter = None if tuner is None or path.startswith(f"{tuner}.base_layer") else tuner
            cast = layerwise_cast(mod) or (layerwise_cast(base) if base is not None else None)
            name = f"{path}.{key}" if path else key
            out.append(TrainableFp8(name, path, p.dtype, adapter, cast))
    return out


def _mantissa(dtype: torch.dtype) -> int:
    """The mantissa bits of an fp8 dtype (e5m2: 2, e4m3: 3)."""
    return 2 if "e5m2" in dtype_name(dtype) else 3


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def _fix(found: list[TrainableFp8]) -> str:
    """The cause and the fix: the order (adapters), or what to freeze (model weights)."""
    cast = next((f.cast for f in found if f.cast is not None), None)
    storage = dtype_name(found[0].dtype)
    compute = dtype_name(cast[1]) if cast is not None else "bfloat16"
    call = casting_call(cast, storage, compute) if cast is not None else None
    adapters = [f for f in found if f.adapter is not None]
    if adapters:
        how = f" ({cast[2]} layerwise casting)" if cast is not None else ""
        return (
            f"They are PEFT adapter weights created after their base layers were stored in "
            f"{storage}{how}: PEFT makes a new adapter in its base layer's dtype. Fix: add the "
            "adapter, then cast: model.add_adapter(lora_config) (or get_peft_model) first, "
            f"then {call or 'the cast to fp8'}; diffusers' enable_layerwise_casting skips PEFT "
            "layers by default (with accelerate's attach_layerwise_casting_hooks pass "
            "skip_modules_pattern=('lora_',))."
        )
    if cast is not None:
        return (
            f"{cast[2]} layerwise casting stores these weights in {storage} and they "
            f"still require grad. Fix: freeze them (requires_grad_(False)) and train an adapter "
            f"added before {call}, or keep the modules you train out of the cast "
            "(skip_modules_pattern=(...))."
        )
    return (
        "Fix: keep trainable weights in a floating dtype (load or cast the model in "
        "bfloat16/float32 and store only frozen weights in fp8), or freeze them."
    )


def check_trainable_fp8(
    view: ModelView, where: str, mode: str, say: Callable[[Finding], None] | None = None
) -> None:
    """Refuse trainable parameters stored in fp8, before any step; in mode ``audit`` a
    finding instead (``say``: the engine's findings channel; without one a warning)."""
    found = trainable_fp8(view)
    if not found:
        return
    dtypes = sorted({dtype_name(f.dtype) for f in found})
    modules = list(dict.fromkeys(f.adapter or f.module for f in found))
    msg = (
        f"{where}: {len(found)} trainable tensor(s) are stored in {'/'.join(dtypes)} "
        f"({_listed([f.name for f in found])}; in {len(modules)} module(s): "
        f"{_listed(modules)}). An fp8 weight cannot be trained: its gradient arrives in the "
        "compute dtype, and the optimizer's update fails on fp8 (AdamW: "
        "'\"mul_cpu_reduced_float\" not implemented for 'Float8_e4m3fn'') or is rounded away "
        f"by its {_mantissa(found[0].dtype)}-bit mantissa. {_fix(found)}"
    )
    if mode != "audit":
        raise PrecisionError(msg)
    if say is None:
        warnings.warn(msg, PrecisionWarning, stacklevel=3)
        return
    numbers = {"trainable_fp8": len(found), "modules": len(modules)}
    say(Finding("fp8_storage", "warning", f"hf-precision fp8: {msg}", numbers=numbers))


def _is_transformers_model(mod: nn.Module) -> bool:
    """A transformers ``PreTrainedModel``: its ``dtype`` is its first floating parameter's."""
    return any(c.__name__ == "PreTrainedModel" for c in type(mod).__mro__)


@dataclass(frozen=True)
class Fp8FirstLayer:
    """A layer whose weight is the first floating parameter of ``reader`` (the model whose
    ``dtype`` reads it), stored in fp8 and computed in ``compute``."""

    reader: str
    name: str
    path: str
    module: nn.Module
    storage: torch.dtype
    compute: torch.dtype


def fp8_first_layers(view: ModelView) -> list[Fp8FirstLayer]:
    """The layers that hold, stored in fp8, the first floating parameter of the root or of a
    transformers model inside it (what ``model.dtype`` / ``next(model.parameters())`` read);
    one record per layer. Empty without layerwise casting (no walk beyond the view's)."""
    layerwise = view.layerwise
    if not layerwise:
        return []
    firsts: dict[int, str] = {}
    for _, _, mod in view.modules:
        if mod is view.root or _is_transformers_model(mod):
            first = next((p for p in view.parameters_of(mod) if p.is_floating_point()), None)
            if first is not None and id(first) in layerwise:
                firsts.setdefault(id(first), type(mod).__name__)
    out: list[Fp8FirstLayer] = []
    for path, _, mod in view.modules:
        for key, p in mod._parameters.items():
            if p is not None and id(p) in firsts:
                name = f"{path}.{key}" if path else key
                rec = Fp8FirstLayer(firsts.pop(id(p)), name, path, mod, p.dtype, layerwise[id(p)])
                out.append(rec)
    return out


def fp8_model_dtype_note(view: ModelView) -> str | None:
    """What to say when ``model.dtype`` reads fp8 storage (see the module docstring)."""
    found = fp8_first_layers(view)
    if not found:
        return None
    first = found[0]
    cast = layerwise_cast(first.module)
    lib = f"{cast[2]} " if cast is not None else ""
    storage, compute = dtype_name(first.storage), dtype_name(first.compute)
    leaf = first.path.rsplit(".", 1)[-1]
    return (
        f"{first.reader}.dtype reads {storage}: its first floating parameter {first.name} is "
        f"stored in {storage} by {lib}layerwise casting and computes in {compute}. Code that "
        f"casts inputs to model.dtype ({DTYPE_CONSUMERS}) rounds them to {storage} before "
        f"any layer runs ({_mantissa(first.storage)} mantissa bits); the guards cast them "
        f"to {compute} (at the group boundary and at {first.path}) so the run goes on, but "
        "the rounding is done. Fix: keep {first.path} out of the "
        f"cast (skip_modules_pattern=(..., {leaf!r}); diffusers' default patterns keep "
        "'patch_embed' and 'norm' out)."
    )


__all__ = [
    "Fp8FirstLayer",
    "TrainableFp8",
    "check_trainable_fp8",
    "fp8_first_layers",
    "fp8_model_dtype_note",
    "trainable_fp8",
]
