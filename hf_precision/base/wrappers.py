"""Who holds the parameters: wrapper detection and the facts the guard reads from wrappers.

One place answers "is this tensor a shard" (:func:`is_sharded`: FSDP2's DTensor), "does a
wrapper own this model" (:func:`detect_wrapper`) and "which model is inside the wrappers"
(:func:`unwrap_model`: DDP/FSDP1/DeepSpeed, ``torch.compile``, PEFT);
:mod:`hf_precision.engine.enforce`,
:mod:`hf_precision.model.dtype_maps`, :mod:`hf_precision.engine.hooks` and the front ends ask here.
Nothing here
imports torch.distributed or a wrapper library: classes are recognised by name and attribute.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, get_args

import torch
from torch import nn

#: Who can hold a model's parameters in place of the model itself.
Wrapper = Literal["FSDP2", "FSDP", "DeepSpeed", "DDP"]
WRAPPERS: tuple[Wrapper, ...] = get_args(Wrapper)


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor (FSDP2 shards parameters as DTensors), directly or as ``.data``."""
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def is_fsdp2_module(m: nn.Module) -> bool:
    """A module ``fully_shard`` (FSDP2) turned into an FSDP module."""
    return callable(getattr(type(m), "_get_fsdp_state", None)) and hasattr(m, "reshard")


def wrapper_of(model: nn.Module, modules: Iterable[nn.Module] | None = None) -> Wrapper | None:
    """Who holds ``model``'s parameters right now (one of :data:`WRAPPERS`), or ``None``.
    ``modules``: the modules inside the wrappers, when the caller has walked them already."""
    name = type(model).__name__
    if name == "DeepSpeedEngine":
        return "DeepSpeed"
    if name == "FullyShardedDataParallel":
        return "FSDP"
    ddp = name in ("DistributedDataParallel", "DataParallel")
    inner = getattr(model, "module", model) if ddp else model
    walked = list(modules) if modules is not None else list(inner.modules())
    for m in walked:
        if is_fsdp2_module(m):
            return "FSDP2"
        if type(m).__name__ == "FullyShardedDataParallel":
            return "FSDP"
    for m in walked:
        for p in m._parameters.values():
            if p is None:
                continue
            if is_sharded(p):
                return "FSDP2"
            if getattr(p, "_is_flat_param", False):
                return "FSDP"
            if hasattr(p, "ds_id"):  # DeepSpeed ZeRO-3 partitions parameters in place
                return "DeepSpeed"
    return "DDP" if ddp else None


def planned_wrapper(accelerator: Any = None, args: Any = None) -> Wrapper | None:
    """The wrapper ``accelerator.prepare`` (or ``Trainer``) will put around the model."""
    if accelerator is not None:
        kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", "") or "")
        if kind == "DEEPSPEED":
            return "DeepSpeed"
        if kind == "FSDP":
            return "FSDP2" if getattr(accelerator, "is_fsdp2", False) else "FSDP"
        if kind.startswith("MULTI_") and int(getattr(accelerator, "num_processes", 1)) > 1:
            return "DDP"
    if args is not None:
        if getattr(args, "deepspeed", None):
            return "DeepSpeed"
        if getattr(args, "fsdp", None):
            cfg = getattr(args, "fsdp_config", None) or {}
            return "FSDP2" if str(cfg.get("version", cfg.get("fsdp_version", 1))) == "2" else "FSDP"
        if int(getattr(args, "world_size", 1) or 1) > 1:
            return "DDP"
    return None


def detect_wrapper(
    model: nn.Module | None = None,
    *,
    accelerator: Any = None,
    args: Any = None,
    modules: Iterable[nn.Module] | None = None,
) -> Wrapper | None:
    """``"FSDP2"``, ``"FSDP"``, ``"DeepSpeed"``, ``"DDP"`` or ``None``: the model's wrapper if it
    has one, else the one the accelerator / ``TrainingArguments`` will add.

    >>> from hf_precision.tiny import tiny_llava
    >>> detect_wrapper(tiny_llava()) is None
    True
    """
    found = wrapper_of(model, modules) if model is not None else None
    return found or planned_wrapper(accelerator, args)


def settle_shards(model: nn.Module, modules: Iterable[nn.Module] | None = None) -> int:
    """Re-register FSDP2's sharded parameters where a forward left unsharded ones (the root
    unit keeps them after forward), so dtypes read the stored weights; local, no collective.
    Returns how many FSDP2 modules were resharded. ``modules``: ``model.modules()`` when the
    caller has walked them already."""
    n = 0
    for m in modules if modules is not None else model.modules():
        if is_fsdp2_module(m) and not all(
            getattr(g, "is_sharded", True) for g in fsdp_param_groups(m)
        ):
            m.reshard()  # type: ignore[operator]
            n += 1
    return n


def fsdp_param_groups(m: nn.Module) -> list[Any]:
    """The parameter groups of an FSDP2 module's state (one or several, by torch version)."""
    state = m._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group per state
        one = getattr(state, "_fsdp_param_group", None)
        groups = [one] if one is not None else []
    return list(groups)


def wrapper_compute_dtypes(
    model: nn.Module, modules: Iterable[nn.Module] | None = None
) -> dict[int, torch.dtype]:
    """``id(parameter) -> dtype`` FSDP computes it in, for parameters whose FSDP mixed precision
    casts them (FSDP2 ``MixedPrecisionPolicy.param_dtype``, FSDP1 ``MixedPrecision.param_dtype``).
    Empty for models no FSDP wraps, so it is cheap to call."""
    out: dict[int, torch.dtype] = {}
    # pre-order: inner FSDP1 units override outer ones; ``modules``: a walk the caller has
    for m in modules if modules is not None else model.modules():
        if is_fsdp2_module(m):
            for group in fsdp_param_groups(m):
                # as FSDPParam.init_dtype_attrs decides it, which runs only at the first forward
                want = getattr(getattr(group, "mp_policy", None), "param_dtype", None)
                for fp in getattr(group, "fsdp_params", ()):
                    p = fp.sharded_param
                    out[id(p)] = want if want is not None and p.is_floating_point() else p.dtype
        elif type(m).__name__ == "FullyShardedDataParallel":
            mp = getattr(m, "mixed_precision", None)
            dtype = getattr(mp, "param_dtype", None)
            if dtype is not None:
                for p in m.parameters():
                    if p.is_floating_point():
                        out[id(p)] = dtype
    return out


# --------------------------------------------------------------------------------------------
# Paths through wrappers: the model inside, and parameter names without wrapper segments

_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """Drop FSDP1 / checkpoint / compile wrapper segments from a parameter or module path."""
    for seg in _WRAPPER_SEGMENTS:
        if seg in name:
            name = name.replace(seg, "")
    return name.removesuffix("._fsdp_wrapped_module").removesuffix("._orig_mod")


_MODULE_WRAPPERS = {
    "DistributedDataParallel",
    "DataParallel",
    "FullyShardedDataParallel",
    "DeepSpeedEngine",
}


def _module_wrapper(model: nn.Module) -> bool:
    """A DDP-like wrapper of any class: its one registered child is ``module``."""
    children = model._modules
    return len(children) == 1 and isinstance(children.get("module"), nn.Module)


def owning_wrapper(model: nn.Module) -> str | None:
    """The class name of a wrapper that holds the parameters of what it wraps (DDP, FSDP1,
    DeepSpeed, DataParallel), so that casting them in place desynchronises it; else ``None``."""
    name = type(model).__name__
    return name if name in _MODULE_WRAPPERS else None


def _is_peft(model: nn.Module) -> bool:
    """A peft wrapper (``PeftModel`` and subclasses): transformers 4.x models carry a
    ``peft_config`` of their own once an adapter is attached, so the attribute alone is not it."""
    return hasattr(model, "peft_config") and any(
        c.__module__.startswith("peft.") for c in type(model).__mro__
    )


def unwrap_model(model: nn.Module) -> tuple[nn.Module, str]:
    """Peel DDP/FSDP1/DataParallel/DeepSpeed (and any wrapper whose one child is ``module``),
    ``torch.compile`` and PEFT wrappers.

    Returns the innermost model and the path prefix of it inside ``model``.
    """
    prefix = ""
    while True:
        inner, seg = getattr(model, "_orig_mod", None), "_orig_mod."
        if not isinstance(inner, nn.Module) and (
            type(model).__name__ in _MODULE_WRAPPERS or _module_wrapper(model)
        ):
            inner, seg = getattr(model, "module", None), "module."
        if not isinstance(inner, nn.Module) and _is_peft(model):
            base = getattr(model, "base_model", None)
            inner, seg = getattr(base, "model", None), "base_model.model."
        if not isinstance(inner, nn.Module):
            return model, prefix
        model, prefix = inner, prefix + seg
