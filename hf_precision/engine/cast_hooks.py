"""The guards' run-time half: the forward pre-hook and forward hook every guarded module
calls, and the state each one reads (:class:`GuardState`, :class:`ExitState`).

Per call the cost is a dtype comparison per tensor argument; a cast happens only where an input
differs from what the receiving module computes in (see :mod:`hf_precision.engine.hooks` for
the kinds of guard and where they go, :mod:`hf_precision.engine.hook_targets` for how their
targets are chosen). Under ``torch.compile`` the hook frames run eagerly when compiled alone
and are traced inline inside a compiled caller: no graph break (``tests/engine/test_batch.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from ..base.names import EXIT_ATTR, GUARD_ATTR
from ..errors import PrecisionError
from ..rules.batch_keys import batch_key_kind, is_metadata_key, notice_unknown
from ..rules.dtypes import dtype_name, is_castable, is_castable_input
from ..rules.policy.fields import Mode
from .batch import cast_batch, cast_tensor, eager_when_compiled_alone
from .range_check import Site

#: Where a guard sits: the model (batch), a group root (boundary), the first weighted leaf of a
#: group (entry), any weighted leaf of a mixed group (leaf).
GuardKind = Literal["batch", "boundary", "entry", "leaf"]

#: Modules whose whole forward is one op autocast runs in its own dtype (F.linear, F.conv*).
_AUTOCAST_OPS: frozenset[type[nn.Module]] = frozenset((nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))


class Weight(NamedTuple):
    """A weight of the receiving module, named by the module that holds it and its attribute:
    read at call time, so a guard follows the weight the module holds *now*. ``module.to()``
    between CPU and CUDA keeps the ``Parameter`` objects, but a move to or from ``meta`` and
    ``to_empty`` put new ones in their place: a tensor kept from install time would stay behind
    on the old device."""

    owner: nn.Module
    name: str

    def current(self) -> torch.Tensor | None:
        return self.owner._parameters.get(self.name)


@dataclass(slots=True)
class GuardState:
    kind: GuardKind
    path: str
    dtype: torch.dtype
    device: torch.device | None
    mode: Mode
    handle: Any = None
    # batch hooks only
    key_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    skip_keys: tuple[str, ...] = ()
    arg_names: tuple[str, ...] = ()  # forward's positional parameter names
    # A weight of the receiving module, read at every call: when someone casts the module after
    # install (Trainer's *_full_eval does model.to(bf16) in place) the target dtype follows it
    # instead of fighting it (``follow_dtype``; not the batch guard's, which follows the policy),
    # and when someone moves it (offloading between CPU and GPU, ``to_empty`` after a build on
    # ``meta``) inputs go where it is now (``follow_device``: off where the guard moves nothing).
    weight: Weight | None = None
    follow_dtype: bool = True
    follow_device: bool = False
    notice: Notice | None = None  # told of the first cast of each kind (shared by all guards)
    # its casts to a narrower dtype, range-checked on the device (engine/range_check.py)
    ranges: dict[str, Site] = field(default_factory=dict)


@dataclass(slots=True)
class Notice:
    """Who hears of the first input a guard of each kind casts at run time: ``say(kind, path,
    what, from_dtype, to_dtype)`` is called once per kind (so a run whose inputs the hooks cast
    says so, once). Not while ``torch.compile`` traces: a log call would break the graph."""

    say: Any
    seen: set[str] = field(default_factory=set)

    def first(self, kind: str, path: str, what: str, src: torch.dtype, dst: torch.dtype) -> None:
        if kind not in self.seen:
            self.seen.add(kind)
            self.say(kind, path, what, src, dst)


def _fix_error(st: GuardState, module: nn.Module, what: str, t: torch.Tensor) -> PrecisionError:
    dev = f" on {st.device}" if st.device is not None else ""
    return PrecisionError(
        f"{st.path or '<model>'} ({type(module).__name__}) received {what} as "
        f"{dtype_name(t.dtype)} on {t.device}, but its weights are {dtype_name(st.dtype)}{dev} "
        f"[{st.kind} guard, mode='raise'].\n"
        "Fix: cast the tensor where it is made, or use PrecisionGuardCallback(mode='fix') "
        "to let the guard cast it."
    )


def _cast_value(st: GuardState, module: nn.Module, value: Any, key: str) -> Any:
    if isinstance(value, torch.Tensor):
        wrong_dtype = (
            value.dtype != st.dtype and value.is_floating_point() and is_castable_input(value)
        )
        wrong_device = st.device is not None and value.device != st.device
        if not (wrong_dtype or wrong_device):
            return value
        if st.mode == "raise":
            if not wrong_device and torch.is_autocast_enabled(value.device.type):
                return value  # autocast computes this op in its own dtype: not a failure
            raise _fix_error(st, module, key, value)
        if (
            wrong_dtype
            and not wrong_device
            and type(module) in _AUTOCAST_OPS
            and torch.is_autocast_enabled(value.device.type)
        ):
            # autocast runs this op in its own dtype whatever the input's: a cast here would be
            # undone at once, two kernels per call and two more in backward (a bf16 LoRA step
            # would upcast every lora_B input for nothing)
            return value
        if wrong_dtype:
            if st.notice is not None and not torch.compiler.is_compiling():
                st.notice.first(st.kind, st.path, key, value.dtype, st.dtype)
            return cast_tensor(
                value, st.dtype, st.device, key=key, where=st.path or "batch", ranges=st.ranges
            )
        return value.to(st.device)  # ids and masks follow the receiver's device too
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        items = [_cast_value(st, module, v, key) for v in value]
        if any(a is not b for a, b in zip(items, value, strict=True)):
            return type(value)(items)
    return value


def _cast_arg(st: GuardState, module: nn.Module, i: int, value: Any) -> Any:
    """A positional batch argument follows the key rules of its parameter name, so
    ``unet(latents, timesteps, ...)`` and ``unet(sample=latents, timestep=timesteps)`` agree."""
    key = st.arg_names[i] if i < len(st.arg_names) else ""
    if key in st.skip_keys:
        return value
    if key and key not in st.key_dtypes and isinstance(value, torch.Tensor):
        floating = value.is_floating_point() and value.dtype != st.dtype
        kind = batch_key_kind(key, value) if floating else "activation"
        if kind != "activation":  # metadata keeps its dtype, follows the device
            if kind == "unknown_small":
                notice_unknown(key, value, f"batch -> {type(module).__name__}")
            return value if st.device is None else value.to(st.device)
    if key in st.key_dtypes:
        return cast_batch(
            value,
            st.dtype,
            key_dtypes=st.key_dtypes,
            device=st.device,
            mode=st.mode,
            where=f"batch -> {type(module).__name__}",
            ranges=st.ranges,
            _key=key,
        )
    return _cast_value(st, module, value, key or f"input {i}")


def _notice_batch(st: GuardState, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Tell the notice which batch key the batch guard cast first (dtype changes only)."""
    assert st.notice is not None
    if "batch" in st.notice.seen:
        return
    for key, value in new.items():
        was = old.get(key)
        if (
            isinstance(value, torch.Tensor)
            and isinstance(was, torch.Tensor)
            and value.dtype != was.dtype
        ):
            st.notice.first("batch", "", key, was.dtype, value.dtype)
            return


def _batch_call(
    st: GuardState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The batch guard's call: batch keys (by name, positional ones by their parameter's name)
    follow the policy."""
    # raise mode checks where a mismatch fails — at module entries, where autocast is known
    # to be on or off — not the batch itself: an fp32 batch under bf16 autocast is fine.
    if st.mode in ("audit", "raise"):
        return None
    new_kwargs = cast_batch(
        kwargs,
        st.dtype,
        key_dtypes=st.key_dtypes,
        skip_keys=st.skip_keys,
        device=st.device,
        mode=st.mode,
        where=f"batch -> {type(module).__name__}",
        ranges=st.ranges,
    )
    new_args = tuple(_cast_arg(st, module, i, a) for i, a in enumerate(args))
    if new_kwargs is kwargs and all(a is b for a, b in zip(new_args, args, strict=True)):
        return None
    if st.notice is not None and not torch.compiler.is_compiling():
        _notice_batch(st, kwargs, new_kwargs)
    return new_args, new_kwargs


def _off_target(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device | None,
) -> bool:
    """Whether any input differs from ``dtype``/``device`` (a list or tuple argument counts as
    one: it is looked into only when casting). Hot path: one dtype comparison per tensor
    argument, nothing allocated."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if (a.dtype != dtype and a.is_floating_point()) or (
                device is not None and a.device != device
            ):
                return True
        elif isinstance(a, (list, tuple)):
            return True
    for v in kwargs.values():
        if isinstance(v, torch.Tensor) and (
            (v.dtype != dtype and v.is_floating_point())
            or (device is not None and v.device != device)
        ):
            return True
    return False


def guard_hook(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The forward pre-hook of every guarded module: its inputs follow its :class:`GuardState`."""
    st: GuardState | None = module.__dict__.get(GUARD_ATTR)
    if st is None:
        return None
    if st.weight is not None:
        _follow(st, st.weight.owner._parameters.get(st.weight.name))
    if st.kind == "batch":
        return _batch_call(st, module, args, kwargs)
    if st.mode == "audit" or not _off_target(args, kwargs, st.dtype, st.device):
        return None
    new_args = tuple(_cast_value(st, module, a, f"input {i}") for i, a in enumerate(args))
    new_kwargs = {
        k: _follow_device(st, v) if is_metadata_key(k) else _cast_value(st, module, v, k)
        for k, v in kwargs.items()
    }
    return new_args, new_kwargs


def _follow(st: GuardState, ref: torch.Tensor | None) -> None:
    """The target follows the module's weight as it is now: its dtype (unless the guard follows
    the policy) and its device (``None`` while it sits on ``meta``: nothing to send inputs to)."""
    if ref is None:
        return
    if st.follow_dtype and ref.dtype != st.dtype:
        st.dtype = ref.dtype
    if st.follow_device:
        dev = ref.device
        if dev != st.device:
            st.device = None if dev.type == "meta" else dev


def _follow_device(st: GuardState, value: Any) -> Any:
    """Metadata passed down by name (``num_items_in_batch``, ``second_per_grid_ts``): its
    dtype is kept at every guard, only the device follows the receiver."""
    if isinstance(value, torch.Tensor) and st.device is not None and value.device != st.device:
        return value.to(st.device)
    return value


@dataclass(slots=True)
class ExitState:
    """An exit guard: outputs follow the dtype of ``weight`` (the language model's input
    embeddings, read at call time so a later cast of the embeddings moves the target with it)."""

    path: str
    weight: Weight
    handle: Any = None
    notice: Notice | None = None  # told of the first hand-over it casts


def _cast_out(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dtype != dtype and value.is_floating_point() and is_castable(value):
            return value.to(dtype)
        return value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        items = [_cast_out(v, dtype) for v in value]
        if any(a is not b for a, b in zip(items, value, strict=True)):
            return type(value)(items)
        return value
    if isinstance(value, dict):  # ModelOutput included: its direct tensors, in place
        for k in list(value.keys()):
            v = value[k]
            if isinstance(v, torch.Tensor):
                new = _cast_out(v, dtype)
                if new is not v:
                    value[k] = new
    return value


def exit_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    st: ExitState | None = module.__dict__.get(EXIT_ATTR)
    if st is None:
        return None
    ref = st.weight.owner._parameters.get(st.weight.name)
    if ref is None:
        return None
    out = _cast_out(output, ref.dtype)
    if out is output:
        return None
    if st.notice is not None and "exit" not in st.notice.seen and not torch.compiler.is_compiling():
        st.notice.first("exit", st.path, "its output", _first_dtype(output), ref.dtype)
    return out


def _first_dtype(value: Any) -> torch.dtype:
    """The dtype of the first floating tensor in an output (a tensor, tuple, dict, ModelOutput)."""
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    for v in items:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.dtype
    return torch.float32


def _install(module: nn.Module, attr: str, st: Any, register: Callable[[], Any]) -> bool:
    """Keep ``st`` under ``attr`` on the module; an existing hook keeps its handle (the state is
    updated), otherwise ``register()`` adds one. True when a new hook was added."""
    old = module.__dict__.get(attr)
    st.handle = register() if old is None else old.handle
    module.__dict__[attr] = st
    return old is None


def _uninstall(module: nn.Module, attr: str) -> None:
    st = module.__dict__.pop(attr, None)
    if st is not None and st.handle is not None:
        st.handle.remove()


def install_exit(module: nn.Module, st: ExitState) -> bool:
    """Install or update the exit hook of one module; True when a new hook was added."""
    return _install(module, EXIT_ATTR, st, lambda: module.register_forward_hook(exit_hook))


def uninstall_exit(module: nn.Module) -> None:
    _uninstall(module, EXIT_ATTR)


def install_hook(module: nn.Module, st: GuardState) -> bool:
    """Install or update the hook of one module; True when a new hook was added."""
    return _install(
        module,
        GUARD_ATTR,
        st,
        lambda: module.register_forward_pre_hook(guard_hook, with_kwargs=True),
    )


_EAGER_ALONE: list[bool] = []  # eager_when_compiled_alone ran (once per process)


def eager_hooks() -> None:
    """The guard's hook frames run eagerly when ``torch.compile(model)`` calls them outside
    the model's graph (see :func:`~hf_precision.engine.batch.eager_when_compiled_alone`)."""
    if not _EAGER_ALONE:
        _EAGER_ALONE.append(True)
        eager_when_compiled_alone(
            guard_hook, _batch_call, _off_target, _cast_value, _cast_arg, _follow, _follow_device
        )


def uninstall_hook(module: nn.Module) -> None:
    _uninstall(module, GUARD_ATTR)
