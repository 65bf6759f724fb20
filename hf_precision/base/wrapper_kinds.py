"""Who holds the parameters: one record per wrapper kind, and what the guard reads from them.

:data:`WRAPPERS` is the table: one frozen :class:`WrapperKind` per wrapper (FSDP2, FSDP1,
DeepSpeed, DDP) saying how to detect it (the class that wraps, a module or a parameter it marks,
the accelerator or ``TrainingArguments`` that will add it), how to get at the model inside it,
whether it owns the parameters (the guard then never writes to them) and which dtypes it is
expected to hold them in. :func:`detect_wrapper`, :func:`unwrap_model`, :func:`owning_wrapper`,
:data:`HOLDING_WRAPPERS`, the plan's "never cast" rule (:func:`owned_by`) and the wrapper check
(:mod:`hf_precision.engine.wrappers.check`) all read it: adding a wrapper kind is one
:func:`register_wrapper` call (or one record below). Nothing here imports torch.distributed or a
wrapper library: classes are recognised by name and attribute.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .registry import add_entry

#: A wrapper kind's name, a key of :data:`WRAPPERS` (``"FSDP2"``, ``"FSDP"``, ``"DeepSpeed"``,
#: ``"DDP"``).
Wrapper = str


@dataclass(frozen=True)
class WrapperKind:
    """One wrapper kind: how to detect it, how to unwrap it, whether it owns the parameters and
    which dtypes it is expected to hold them in. Fields left out mean "not this wrapper's way"."""

    name: str
    # ---- detection
    #: class names of the object that wraps the model (its outermost layer)
    classes: tuple[str, ...] = ()
    #: a module inside the model that marks it (``fully_shard`` turns modules into FSDP modules)
    module_test: Callable[[nn.Module], bool] | None = None
    #: a parameter that marks it (FSDP2's DTensor shards, FSDP1's flat parameters, ZeRO-3's
    #: ``ds_id``)
    param_test: Callable[[torch.Tensor], bool] | None = None
    #: the accelerator will add it: ``(accelerator.distributed_type value, accelerator)``
    accelerator_test: Callable[[str, Any], bool] | None = None
    #: ``TrainingArguments`` (or any object with its fields) say ``Trainer`` will add it
    args_test: Callable[[Any], bool] | None = None
    # ---- unwrapping
    #: the attribute of the wrapping object (one of ``classes``) that holds the model inside
    inner: str = "module"
    #: path segments it adds to parameter names (FSDP1's ``_fsdp_wrapped_module``)
    segments: tuple[str, ...] = ()
    # ---- ownership: the guard never writes to what the wrapper owns
    #: it owns the parameters (:data:`HOLDING_WRAPPERS`): the guard verifies and explains
    owns_params: bool = False
    #: tensors of ``kind`` (``"param"``/``"buffer"``) it owns one by one, which the plan never
    #: casts, and the words the plan says that with (``"sharded by FSDP2"``)
    owned_test: Callable[[torch.Tensor, str], bool] | None = None
    owned_words: str = ""
    #: each rank holds its own slice of a parameter (FSDP1 flat parameters, ZeRO-3 partitions):
    #: ranks compare dtypes, not element counts
    slices_per_rank: bool = False
    # ---- expected dtypes (the wrapper check, :func:`hf_precision.engine.wrappers.check.classify`)
    #: ``id(parameter) -> dtype`` it computes a parameter in, for the parameters of one module
    #: (FSDP mixed precision's ``param_dtype``); empty where it computes in the storage dtype
    compute_dtypes: Callable[[nn.Module], dict[int, torch.dtype]] | None = None
    #: it upcasts trainable weights to float32 (the fp32 copy is the master weight)
    upcasts_trainable: bool = False
    #: it casts every parameter to its config's dtype (the optimizer keeps fp32 master weights)
    #: and has no setting that keeps one module in float32
    holds_config_dtype: bool = False
    #: the fix said when it cast parameters against the policy (a generic one when empty)
    cast_fix: str = ""
    # ---- behaviour the guard's steps read (instead of comparing names)
    #: it keeps the root unsharded after forward and casts outputs (``output_dtype``): the
    #: guard settles the shards before reading dtypes and says/bridges the outputs (FSDP2)
    reshards: bool = False
    #: it built its gradient buckets for the dtypes at wrapping time: only a return to those
    #: is a safe cast (DDP)
    buckets_by_dtype: bool = False
    #: it partitions parameters while the model is built (``deepspeed.zero.Init``), before any
    #: engine holds them: at the first event those are cast like any weight, the partitions left
    partitions_at_build: bool = False
    #: it owns autocast: the guard never opens one around it (DeepSpeed >= 0.17.2)
    owns_autocast: bool = False


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor (FSDP2 shards parameters as DTensors), directly or as ``.data``."""
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def is_fsdp2_module(m: nn.Module) -> bool:
    """A module ``fully_shard`` (FSDP2) turned into an FSDP module."""
    return callable(getattr(type(m), "_get_fsdp_state", None)) and hasattr(m, "reshard")


def fsdp_param_groups(m: nn.Module) -> list[Any]:
    """The parameter groups of an FSDP2 module's state (one or several, by torch version)."""
    state = m._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group per state
        one = getattr(state, "_fsdp_param_group", None)
        groups = [one] if one is not None else []
    return list(groups)


def _fsdp2_compute(m: nn.Module) -> dict[int, torch.dtype]:
    out: dict[int, torch.dtype] = {}
    if is_fsdp2_module(m):
        for group in fsdp_param_groups(m):
            # as FSDPParam.init_dtype_attrs decides it, which runs only at the first forward
            want = getattr(getattr(group, "mp_policy", None), "param_dtype", None)
            for fp in getattr(group, "fsdp_params", ()):
                p = fp.sharded_param
                out[id(p)] = want if want is not None and p.is_floating_point() else p.dtype
    return out


def _is_fsdp1(m: nn.Module) -> bool:
    return type(m).__name__ == "FullyShardedDataParallel"


def _fsdp1_compute(m: nn.Module) -> dict[int, torch.dtype]:
    dtype = getattr(getattr(m, "mixed_precision", None), "param_dtype", None)
    if not _is_fsdp1(m) or dtype is None:
        return {}
    return {id(p): dtype for p in m.parameters() if p.is_floating_point()}


def _fsdp_version(args: Any) -> str | None:
    """The FSDP version ``TrainingArguments`` ask for (``"1"``, ``"2"``), or ``None``."""
    if getattr(args, "deepspeed", None) or not getattr(args, "fsdp", None):
        return None  # a DeepSpeed config wins over fsdp
    cfg = getattr(args, "fsdp_config", None) or {}
    return str(cfg.get("version", cfg.get("fsdp_version", 1)))


def _ddp_args(args: Any) -> bool:
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        return False
    return int(getattr(args, "world_size", 1) or 1) > 1


_DEEPSPEED_FIX = (
    "DeepSpeed casts every parameter to the dtype its config enables when the engine "
    "is built (bf16/fp16 'enabled'), and has no setting that keeps one module in "
    "float32. Fix: accept it by dropping the float32 rule (keep_fp32 / group_dtypes) "
    "from the policy, or train that part without DeepSpeed's half precision "
    "(bf16/fp16 'enabled': false and autocast)"
)

#: The wrapper kinds, in the order detection asks them (a kind registered later comes first).
WRAPPERS: dict[Wrapper, WrapperKind] = {
    k.name: k
    for k in (
        WrapperKind(
            "FSDP2",
            module_test=is_fsdp2_module,
            param_test=is_sharded,
            accelerator_test=lambda kind, acc: kind == "FSDP" and bool(getattr(acc, "is_fsdp2", 0)),
            args_test=lambda args: _fsdp_version(args) == "2",
            owns_params=True,
            owned_test=lambda t, kind: is_sharded(t),
            owned_words="sharded by FSDP2",
            compute_dtypes=_fsdp2_compute,
            upcasts_trainable=True,
            reshards=True,
        ),
        WrapperKind(
            "FSDP",
            classes=("FullyShardedDataParallel",),
            module_test=_is_fsdp1,
            param_test=lambda p: bool(getattr(p, "_is_flat_param", False)),
            accelerator_test=lambda kind, acc: kind == "FSDP" and not getattr(acc, "is_fsdp2", 0),
            args_test=lambda args: _fsdp_version(args) not in (None, "2"),
            segments=("_fsdp_wrapped_module",),
            owns_params=True,
            slices_per_rank=True,
            compute_dtypes=_fsdp1_compute,
            upcasts_trainable=True,
        ),
        WrapperKind(
            "DeepSpeed",
            classes=("DeepSpeedEngine",),
            # ZeRO-3 partitions parameters in place
            param_test=lambda p: hasattr(p, "ds_id"),
            accelerator_test=lambda kind, acc: kind == "DEEPSPEED",
            args_test=lambda args: bool(getattr(args, "deepspeed", None)),
            owns_params=True,
            owned_test=lambda t, kind: kind == "param" and hasattr(t, "ds_id"),
            owned_words="partitioned by DeepSpeed ZeRO-3",
            slices_per_rank=True,
            holds_config_dtype=True,
            cast_fix=_DEEPSPEED_FIX,
            partitions_at_build=True,
            owns_autocast=True,
        ),
        WrapperKind(
            "DDP",  # DataParallel replicates like DDP
            classes=("DistributedDataParallel", "DataParallel"),
            accelerator_test=lambda kind, acc: (
                kind.startswith("MULTI_") and int(getattr(acc, "num_processes", 1)) > 1
            ),
            args_test=_ddp_args,
            buckets_by_dtype=True,
        ),
    )
}


def register_wrapper(kind: WrapperKind) -> WrapperKind:
    """Add (or replace) a wrapper kind; it is asked before the built-in ones."""

    def add(name: str) -> WrapperKind:
        rest = {n: k for n, k in WRAPPERS.items() if n != name}
        WRAPPERS.clear()
        WRAPPERS.update({name: kind, **rest})
        return kind

    return add_entry(
        f"register_wrapper(WrapperKind({kind.name!r}, ...))",
        kind.name,
        pattern=_WRAPPER_NAME_RE,
        example="WrapperKind('MyShards', classes=('MyShardedModule',))",
        exists=WRAPPERS.__contains__,
        add=add,
        duplicate="replace",
    )


#: What a wrapper kind's name looks like (a class-like name: ``FSDP2``, ``DeepSpeed``).
_WRAPPER_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def wrapper_kind(name: str | None) -> WrapperKind | None:
    """The record of the wrapper called ``name``, or ``None``."""
    return WRAPPERS.get(name) if name is not None else None


class _Holding:
    """The names of the wrapper kinds that own the parameters, read from :data:`WRAPPERS` each
    time (``wrapper in HOLDING_WRAPPERS``)."""

    def __contains__(self, name: object) -> bool:
        kind = WRAPPERS.get(name) if isinstance(name, str) else None
        return kind is not None and kind.owns_params

    def __iter__(self) -> Iterator[str]:
        return iter([n for n, k in WRAPPERS.items() if k.owns_params])

    def __repr__(self) -> str:
        return repr(tuple(self))


#: Wrappers that own the parameters: the guard verifies and explains, never casts.
HOLDING_WRAPPERS = _Holding()


def owned_by(t: torch.Tensor, kind: str) -> WrapperKind | None:
    """The wrapper that owns tensor ``t`` (a ``"param"`` or ``"buffer"``) one by one (an FSDP2
    shard, a ZeRO-3 partition): writing its ``.data`` would desynchronise the wrapper."""
    for k in WRAPPERS.values():
        if k.owned_test is not None and k.owned_test(t, kind):
            return k
    return None


def _outer(model: nn.Module) -> WrapperKind | None:
    """The kind whose class wraps ``model`` (its outermost layer), or ``None``."""
    name = type(model).__name__
    return next((k for k in WRAPPERS.values() if name in k.classes), None)


def wrapper_of(model: nn.Module, modules: Iterable[nn.Module] | None = None) -> Wrapper | None:
    """Who holds ``model``'s parameters right now (a key of :data:`WRAPPERS`), or ``None``.
    ``modules``: the modules inside the wrappers, when the caller has walked them already.
    A wrapping class that owns the parameters decides; one that does not (DDP) decides only
    when nothing inside it (an FSDP module, a shard, a partition) names another kind."""
    outer = _outer(model)
    if outer is not None and outer.owns_params:
        return outer.name
    inner = getattr(model, outer.inner, model) if outer is not None else model
    walked = list(modules) if modules is not None else list(inner.modules())
    kinds = list(WRAPPERS.values())
    tests = [k for k in kinds if k.module_test is not None]
    for m in walked:
        for k in tests:
            if k.module_test(m):  # type: ignore[misc]
                return k.name
    tests = [k for k in kinds if k.param_test is not None]
    for m in walked:
        for p in m._parameters.values():
            if p is None:
                continue
            for k in tests:
                if k.param_test(p):  # type: ignore[misc]
                    return k.name
    return outer.name if outer is not None else None


def planned_wrapper(accelerator: Any = None, args: Any = None) -> Wrapper | None:
    """The wrapper ``accelerator.prepare`` (or ``Trainer``) will put around the model."""
    if accelerator is not None:
        kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", "") or "")
        for k in WRAPPERS.values():
            if k.accelerator_test is not None and k.accelerator_test(kind, accelerator):
                return k.name
    if args is not None:
        for k in WRAPPERS.values():
            if k.args_test is not None and k.args_test(args):
                return k.name
    return None


def detect_wrapper(
    model: nn.Module | None = None,
    *,
    accelerator: Any = None,
    args: Any = None,
    modules: Iterable[nn.Module] | None = None,
) -> Wrapper | None:
    """``"FSDP2"``, ``"FSDP"``, ``"DeepSpeed"``, ``"DDP"`` (a key of :data:`WRAPPERS`) or
    ``None``: the model's wrapper if it has one, else the one the accelerator /
    ``TrainingArguments`` will add.

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


def wrapper_compute_dtypes(
    model: nn.Module, modules: Iterable[nn.Module] | None = None
) -> dict[int, torch.dtype]:
    """``id(parameter) -> dtype`` a wrapper computes it in, for parameters whose wrapper's mixed
    precision casts them (FSDP2 ``MixedPrecisionPolicy.param_dtype``, FSDP1
    ``MixedPrecision.param_dtype``: :attr:`WrapperKind.compute_dtypes`). Empty for models no
    such wrapper holds, so it is cheap to call."""
    out: dict[int, torch.dtype] = {}
    kinds = [k.compute_dtypes for k in WRAPPERS.values() if k.compute_dtypes is not None]
    # pre-order: inner FSDP1 units override outer ones; ``modules``: a walk the caller has
    for m in modules if modules is not None else model.modules():
        for compute in kinds:
            out.update(compute(m))
    return out


# --------------------------------------------------------------------------------------------
# Paths through wrappers: the model inside, and parameter names without wrapper segments

#: segments of wrappers that are no parallel wrapper (activation checkpointing, torch.compile)
_CHECKPOINT, _COMPILE = "_checkpoint_wrapped_module", "_orig_mod"


def clean_name(name: str) -> str:
    """Drop FSDP1 / checkpoint / compile wrapper segments (:attr:`WrapperKind.segments`) from a
    parameter or module path."""
    ours = [seg for kind in WRAPPERS.values() for seg in kind.segments]
    for seg in (*ours, _CHECKPOINT, _COMPILE):
        if seg + "." in name:
            name = name.replace(seg + ".", "")
    for seg in (*ours, _COMPILE):
        name = name.removesuffix("." + seg)
    return name


def _module_wrapper(model: nn.Module) -> bool:
    """A DDP-like wrapper of any class: its one registered child is ``module``."""
    children = model._modules
    return len(children) == 1 and isinstance(children.get("module"), nn.Module)


def owning_wrapper(model: nn.Module) -> str | None:
    """The class name of a wrapper that holds the parameters of what it wraps (DDP, FSDP1,
    DeepSpeed, DataParallel: :attr:`WrapperKind.classes`), so that casting them in place
    desynchronises it; else ``None``."""
    return type(model).__name__ if _outer(model) is not None else None


def _is_peft(model: nn.Module) -> bool:
    """A peft wrapper (``PeftModel`` and subclasses): transformers 4.x models carry a
    ``peft_config`` of their own once an adapter is attached, so the attribute alone is not it."""
    return hasattr(model, "peft_config") and any(
        c.__module__.startswith("peft.") for c in type(model).__mro__
    )


def unwrap_model(model: nn.Module) -> tuple[nn.Module, str]:
    """Peel the wrappers of :data:`WRAPPERS` (DDP/FSDP1/DataParallel/DeepSpeed, and any wrapper
    whose one child is ``module``), ``torch.compile`` and PEFT wrappers.

    Returns the innermost model and the path prefix of it inside ``model``.
    """
    prefix = ""
    while True:
        inner, seg = getattr(model, "_orig_mod", None), "_orig_mod."
        outer = _outer(model) if not isinstance(inner, nn.Module) else None
        if outer is not None:
            inner, seg = getattr(model, outer.inner, None), f"{outer.inner}."
        elif not isinstance(inner, nn.Module) and _module_wrapper(model):
            inner, seg = getattr(model, "module", None), "module."
        if not isinstance(inner, nn.Module) and _is_peft(model):
            base = getattr(model, "base_model", None)
            inner, seg = getattr(base, "model", None), "base_model.model."
        if not isinstance(inner, nn.Module):
            return model, prefix
        model, prefix = inner, prefix + seg
