"""Weights read outside their module: what no forward hook sees.

The guards are forward pre-hooks: they see a module's inputs when the module is called. Some
code reads a weight without calling its module, so no hook of that module runs:

- **fused LM heads**: a patched model ``forward`` that reads ``lm_head.weight`` and computes the
  loss in chunks without materialising the logits. TRL 1.16's ``add_fused_lm_head`` (the SFT,
  DPO, GRPO, RLOO and KTO trainers call it; ``model(..., fused_lm_head=True)``), Liger's fused
  linear cross-entropy (``apply_liger_kernel_to_*`` / ``use_liger_kernel=True``: the forward
  comes from ``liger_kernel.transformers.model.*``), cut-cross-entropy (``cce_patch``: from
  ``cut_cross_entropy.*``). Found by the module the patched ``forward`` (on the instance or the
  class) comes from: nothing is imported.
- **raw parameters**: an ``nn.Parameter`` of 2 or more dimensions held directly by a module
  that has children, multiplied in that module's own ``forward`` (Gemma 3's projector:
  ``mm_input_projection_weight``, not a ``Linear``). The module's boundary guard and the exit
  hook of the image path bridge it; the report names it.

What the guard does about it:

- every read is reported (:class:`OutsideRead`, ``EnforceReport.outside_reads``, the event
  JSON's ``outside_reads``), and a fused head once on the console;
- TRL's fused head casts the weight to its compute dtype itself (``weight.to(compute_dtype)``
  per vocabulary chunk; fp32 with ``cast_lm_head_to_fp32=True``): nothing to bridge;
- Liger's and cut-cross-entropy's kernels multiply ``hidden @ weight.T`` as they get them: an
  fp32 ``lm_head`` (trainable, ``modules_to_save``) beside bf16 hidden states outside autocast
  fails inside the kernel on the GPU (``mat1 and mat2 must have the same dtype``). The guard
  checks before each forward (one dtype comparison) and raises a :class:`PrecisionError`
  naming ``lm_head``, both dtypes and the fix, instead: it never lowers the precision of a
  weight the user or a library chose without being told.

>>> from torch import nn
>>> find_outside_reads(nn.Linear(2, 2))
[]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Literal

import torch
from torch import nn

from ..errors import PrecisionError
from ..rules.dtypes import dtype_name

ReadKind = Literal["fused_head", "raw_parameter"]

#: top-level package of a patched ``forward`` -> (the kernel in words, it casts the weight
#: itself)
FUSED_HEAD_LIBRARIES: dict[str, tuple[str, bool]] = {
    "trl": ("TRL's fused LM head (add_fused_lm_head)", True),
    "liger_kernel": ("Liger's fused linear cross-entropy", False),
    "cut_cross_entropy": ("cut-cross-entropy (linear_cross_entropy)", False),
}
_ATTR = "_hf_precision_fused_head_check"


@dataclass(frozen=True)
class OutsideRead:
    """One weight read outside its module: ``tensor`` (its path), ``dtype``, ``reader`` (who
    reads it, in words), ``kind`` and whether the reader casts the weight to its compute
    dtype itself (``casts_itself``)."""

    tensor: str
    dtype: torch.dtype
    reader: str
    kind: ReadKind
    casts_itself: bool

    def describe(self) -> str:
        how = (
            "the kernel casts it to its compute dtype itself"
            if self.casts_itself
            else "the kernel multiplies it as it is"
            if self.kind == "fused_head"
            else "bridged at its module's boundary and the image path's exit"
        )
        return (
            f"{self.tensor} ({dtype_name(self.dtype)}) is read outside its module by "
            f"{self.reader}: no forward hook of that module sees the read; {how}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "dtype": dtype_name(self.dtype),
            "reader": self.reader,
            "kind": self.kind,
            "casts_itself": self.casts_itself,
        }


def _forward_functions(model: nn.Module) -> list[Any]:
    """The instance's own ``forward`` (a bound method set by a patch) and its class's."""
    out = []
    own = model.__dict__.get("forward")
    if own is not None:
        out.append(getattr(own, "__func__", own))
    out.append(type(model).forward)
    return out


#: the name of TRL's patched forward: TRL's own model classes (``trl.models``' value heads)
#: have forwards of their own that are not fused heads
_TRL_FUSED = "_fused_forward"


def _library_of(fn: Any) -> tuple[str, bool] | None:
    """The fused-head library ``fn`` comes from: by its module, or (``functools.wraps`` copies
    ``__module__`` from the function it wraps, as TRL's does) by the file its code is in."""
    code = getattr(fn, "__code__", None)
    top = (getattr(fn, "__module__", None) or "").split(".")[0]
    parts = PurePath(code.co_filename).parts[:-1] if code is not None else ()
    for package in (top, *parts):
        if package in FUSED_HEAD_LIBRARIES:
            if package == "trl" and getattr(code, "co_name", None) != _TRL_FUSED:
                return None
            return FUSED_HEAD_LIBRARIES[package]
    return None


def _closure_value(fn: Any, name: str) -> Any:
    """A variable the patched ``forward`` closes over (TRL's ``cast_lm_head_to_fp32``)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    for var, cell in zip(names, cells, strict=False):
        if var == name:
            try:
                return cell.cell_contents
            except ValueError:  # an empty cell
                return None
    return None


def fused_head_reader(model: nn.Module) -> tuple[str, bool] | None:
    """``(kernel in words, casts the weight itself)`` when ``model``'s forward is a fused LM
    head patched in by TRL, Liger or cut-cross-entropy; ``None`` otherwise. TRL's with
    ``cast_lm_head_to_fp32=True`` says so (it computes the head in float32 on purpose)."""
    for fn in _forward_functions(model):
        lib = _library_of(fn)
        if lib is not None:
            if lib[1] and _closure_value(fn, "cast_lm_head_to_fp32") is True:
                return f"{lib[0]} with cast_lm_head_to_fp32=True (float32, on purpose)", lib[1]
            return lib
    return None


Modules = Iterable[tuple[str, nn.Module]]


def _output_weight(model: nn.Module, modules: Modules) -> tuple[str, torch.Tensor] | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if not isinstance(head, nn.Module) or not isinstance(weight, torch.Tensor):
        return None
    for name, mod in modules:
        if mod is head:
            return (f"{name}.weight" if name else "weight"), weight
    return None


def find_outside_reads(model: nn.Module, modules: Modules | None = None) -> list[OutsideRead]:
    """Every weight of ``model`` read outside its module (see the module docstring);
    ``modules`` is the event's walk of the model, ``(path, module)`` pairs (the guard passes
    its view's, so the model is walked once per event), else ``model.named_modules()``."""
    walk = list(modules) if modules is not None else list(model.named_modules())
    out: list[OutsideRead] = []
    lib = fused_head_reader(model)
    head = _output_weight(model, walk) if lib is not None else None
    if lib is not None and head is not None:
        what = f"{lib[0]} ({type(model).__name__}.forward patched)"
        out.append(OutsideRead(head[0], head[1].dtype, what, "fused_head", lib[1]))
    for path, mod in walk:
        if not mod._modules:
            continue  # a leaf: its own hook sees its inputs
        for key, p in mod._parameters.items():
            if p is not None and p.dim() >= 2 and p.is_floating_point():
                reader = f"{type(mod).__name__}.forward (a raw nn.Parameter, not a Linear)"
                name = f"{path}.{key}" if path else key
                out.append(OutsideRead(name, p.dtype, reader, "raw_parameter", False))
    return out


def _hidden_dtype(model: nn.Module) -> torch.dtype | None:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    weight = getattr(emb, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else None


def check_fused_head(model: nn.Module, read: OutsideRead, weight: torch.Tensor) -> None:
    """Raise before a fused kernel that does not cast (Liger, cut-cross-entropy) multiplies
    hidden states and ``lm_head.weight`` of different dtypes outside autocast."""
    hidden = _hidden_dtype(model)
    if hidden is None or hidden == weight.dtype or torch.is_autocast_enabled(weight.device.type):
        return
    half = dtype_name(hidden)
    raise PrecisionError(
        f"{read.tensor} is {dtype_name(weight.dtype)} and the hidden states are {half}: "
        f"{read.reader} reads {read.tensor} outside its module and multiplies the two as they "
        "are (on a GPU: 'mat1 and mat2 must have the same dtype' in "
        "fused_linear_cross_entropy_forward). No hook can bridge a read it does not see, and "
        "the guard does not lower a weight's precision on its own.\n"
        f"Fix: train under autocast (bf16=True / --bf16 / mixed_precision='bf16'), or keep "
        f"the head in the hidden states' dtype: PrecisionGuardCallback(policy."
        f"replace(group_dtypes={{'lm_head': '{half}'}})) (or load the model in {half}), or "
        "turn the fused kernel off (Liger: fused_linear_cross_entropy=False)."
    )


def _fused_head_hook(module: nn.Module, args: Any, kwargs: Any) -> None:
    state = module.__dict__.get(_ATTR)
    if state is not None:
        model, read, head, _ = state
        check_fused_head(model, read, head.weight)


def _backbone(model: nn.Module) -> nn.Module:
    """The module a fused forward calls through ``__call__`` (``self.model(...)``,
    ``self.base_model(...)``): PEFT calls the model's ``forward`` directly, past its hooks."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) and base is not model else model


def install_fused_head_check(model: nn.Module, reads: list[OutsideRead]) -> bool:
    """A forward pre-hook on ``model``'s backbone that runs :func:`check_fused_head` when a
    fused head that multiplies as it gets (Liger, cut-cross-entropy) reads the output weight;
    one hook per model, updated in place. Returns whether one is installed."""
    read = next((r for r in reads if r.kind == "fused_head" and not r.casts_itself), None)
    get = getattr(model, "get_output_embeddings", None)
    head = get() if read is not None and callable(get) else None
    backbone = _backbone(model)
    old = backbone.__dict__.get(_ATTR)
    if read is None or not isinstance(head, nn.Module):
        if old is not None:
            del backbone.__dict__[_ATTR]
            old[3].remove()
        return False
    handle = (
        old[3]
        if old is not None
        else backbone.register_forward_pre_hook(_fused_head_hook, with_kwargs=True)
    )
    backbone.__dict__[_ATTR] = (model, read, head, handle)
    return True
