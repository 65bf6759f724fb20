"""Guards: forward pre-hooks that make inputs follow the receiving module's dtype and device.

Module hooks fire on every path — training forward, evaluation, ``generate()`` (which encodes
images through ``get_image_features`` outside the top-level forward), ``PeftModel.generate`` and
callbacks calling submodules — which is why the guard uses them rather than wrapping ``forward``.

Four kinds of forward pre-hooks (:data:`GuardKind`) and one forward hook, all removable and
idempotent (installing twice adds nothing):

* **batch** — on the model itself: batch keys (``pixel_values``, float masks, ``latents`` …)
  follow the policy (labels untouched);
* **boundary** — on each group's root (vision encoder, resampler, projector, language model,
  LM head): floating inputs follow the group's receiving dtype/device;
* **entry** — on the first weighted leaf of each group: remote code often calls a submodule of
  the group directly (``vpm.forward_features(...)``), past the boundary hook;
* **leaf** — on every module with its own weights inside groups that mix dtypes (or everywhere
  with ``leaf_guards="on"``): inputs follow that module's weight dtype. This covers fp32 norm
  upcasts and tensors built inside ``forward`` (MiniCPM-V's numpy sin-cos table);
* **exit** (a forward hook) — on the group that hands image features to the language model
  (the projector, else the resampler, else the vision encoder): its floating outputs leave in
  the dtype of the language model's input embeddings, so plain tensor code after it
  (``input_embeds[selected] = vit_embeds``, ``masked_scatter``, ``cat``) sees one dtype: a
  projector trained in fp32 beside a bf16 language model, or a projector's bf16 autocast
  output written into fp32 embeddings.

Targets are computed at install time; the per-call cost is a dtype comparison.

>>> from hf_precision import enforce_policy
>>> from hf_precision.engine.hooks import install_guards
>>> from hf_precision.tiny import tiny_llava
>>> model = tiny_llava()
>>> handle = install_guards(model, "bf16-true", enforce_policy(model, "bf16-true"))
>>> handle.remove()
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ..base.wrappers import unwrap_model, wrapper_compute_dtypes
from ..errors import PrecisionError, check_model
from ..model.dtype_maps import receiving, receiving_dtypes
from ..model.view import ModelView
from ..rules.batch_keys import batch_key_kind, is_metadata_key, notice_unknown
from ..rules.dtypes import dtype_name, is_castable, quantized_compute_dtype
from ..rules.groups import LEAF_GUARDED_GROUPS, OTHER, ModuleGroups, find_module_groups
from ..rules.keep_rules import first_parameter_kept, strict_modules
from ..rules.policy import Mode, PrecisionPolicy, is_norm_module
from .batch import cast_batch, cast_tensor, eager_when_compiled_alone, key_dtypes_for

# moved to hf_precision.engine.claims; still importable from here
from .claims import claim_model as claim_model
from .claims import claimed_by as claimed_by
from .claims import release_model as release_model

#: Where a guard sits: the model (batch), a group root (boundary), the first weighted leaf of a
#: group (entry), any weighted leaf of a mixed group (leaf).
GuardKind = Literal["batch", "boundary", "entry", "leaf"]

_ATTR = "_hf_precision_guard"
_EXIT_ATTR = "_hf_precision_exit"
#: The groups on the image path, in the order they usually run (see :func:`_handover_roots`).
_IMAGE_PATH = ("vision_encoder", "resampler", "projector")
#: Modules whose whole forward is one op autocast runs in its own dtype (F.linear, F.conv*).
_AUTOCAST_OPS: frozenset[type[nn.Module]] = frozenset((nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
#: Leaves whose inputs are integer ids: a hook there would only cost time.
_SKIP_LEAVES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)


@dataclass(slots=True)
class _GuardState:
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
    # A weight of the receiving module: when someone casts the module after install (Trainer's
    # *_full_eval does model.to(bf16) in place), the target follows it instead of fighting it.
    ref: torch.Tensor | None = None
    notice: Notice | None = None  # told of the first cast of each kind (shared by all guards)


@dataclass(slots=True)
class Notice:
    """Who hears of the first input a guard of each kind casts at run time: ``say(kind, path,
    what, from_dtype, to_dtype)`` is called once per kind (so a run the hooks alone keep going
    says so, once). Not while ``torch.compile`` traces: a log call would break the graph."""

    say: Any
    seen: set[str] = field(default_factory=set)

    def first(self, kind: str, path: str, what: str, src: torch.dtype, dst: torch.dtype) -> None:
        if kind not in self.seen:
            self.seen.add(kind)
            self.say(kind, path, what, src, dst)


def _fix_error(st: _GuardState, module: nn.Module, what: str, t: torch.Tensor) -> PrecisionError:
    dev = f" on {st.device}" if st.device is not None else ""
    return PrecisionError(
        f"{st.path or '<model>'} ({type(module).__name__}) received {what} as "
        f"{dtype_name(t.dtype)} on {t.device}, but its weights are {dtype_name(st.dtype)}{dev} "
        f"[{st.kind} guard, mode='raise'].\n"
        "Fix: cast the tensor where it is made, or use PrecisionGuardCallback(mode='fix') "
        "to let the guard cast it."
    )


def _cast_value(st: _GuardState, module: nn.Module, value: Any, key: str) -> Any:
    if isinstance(value, torch.Tensor):
        wrong_dtype = value.dtype != st.dtype and value.is_floating_point() and is_castable(value)
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
            return cast_tensor(value, st.dtype, st.device, key=key, where=st.path)
        return value.to(st.device)  # ids and masks follow the receiver's device too
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        items = [_cast_value(st, module, v, key) for v in value]
        if any(a is not b for a, b in zip(items, value, strict=True)):
            return type(value)(items)
    return value


def _cast_arg(st: _GuardState, module: nn.Module, i: int, value: Any) -> Any:
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
            _key=key,
        )
    return _cast_value(st, module, value, key or f"input {i}")


def _arg_names(module: nn.Module) -> tuple[str, ...]:
    """Names of ``forward``'s positional parameters (none past a ``*args``)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    names = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return tuple(names)


def _notice_batch(st: _GuardState, old: dict[str, Any], new: dict[str, Any]) -> None:
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


def _guard_hook(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    st: _GuardState | None = module.__dict__.get(_ATTR)
    if st is None:
        return None
    if st.kind == "batch":
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
        )
        new_args = tuple(_cast_arg(st, module, i, a) for i, a in enumerate(args))
        if new_kwargs is kwargs and all(a is b for a, b in zip(new_args, args, strict=True)):
            return None
        if st.notice is not None and not torch.compiler.is_compiling():
            _notice_batch(st, kwargs, new_kwargs)
        return new_args, new_kwargs
    ref = st.ref
    if ref is not None:
        if ref.dtype != st.dtype:
            st.dtype = ref.dtype
        if st.device is not None and ref.device != st.device:
            st.device = ref.device
    dtype, device = st.dtype, st.device
    # Hot path: one dtype comparison per tensor argument, nothing allocated.
    hit = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if (a.dtype != dtype and a.is_floating_point()) or (
                device is not None and a.device != device
            ):
                hit = True
                break
        elif isinstance(a, (list, tuple)):
            hit = True
            break
    if not hit and kwargs:
        for v in kwargs.values():
            if isinstance(v, torch.Tensor) and (
                (v.dtype != dtype and v.is_floating_point())
                or (device is not None and v.device != device)
            ):
                hit = True
                break
    if not hit or st.mode == "audit":
        return None
    new_args = tuple(_cast_value(st, module, a, f"input {i}") for i, a in enumerate(args))
    new_kwargs = {
        k: _follow_device(st, v) if is_metadata_key(k) else _cast_value(st, module, v, k)
        for k, v in kwargs.items()
    }
    return new_args, new_kwargs


def _follow_device(st: _GuardState, value: Any) -> Any:
    """Metadata passed down by name (``num_items_in_batch``, ``second_per_grid_ts``): its
    dtype is kept at every guard, only the device follows the receiver."""
    if isinstance(value, torch.Tensor) and st.device is not None and value.device != st.device:
        return value.to(st.device)
    return value


@dataclass(slots=True)
class _ExitState:
    """An exit guard: outputs follow ``ref``'s dtype (the language model's input embeddings,
    read at call time so a later cast of the embeddings moves the target with it)."""

    path: str
    ref: torch.Tensor
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


def _exit_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    st: _ExitState | None = module.__dict__.get(_EXIT_ATTR)
    if st is None:
        return None
    out = _cast_out(output, st.ref.dtype)
    if out is output:
        return None
    if st.notice is not None and "exit" not in st.notice.seen and not torch.compiler.is_compiling():
        st.notice.first("exit", st.path, "its output", _first_dtype(output), st.ref.dtype)
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


def _install_exit(module: nn.Module, st: _ExitState) -> bool:
    old: _ExitState | None = module.__dict__.get(_EXIT_ATTR)
    if old is not None:
        st.handle = old.handle
        module.__dict__[_EXIT_ATTR] = st
        return False
    st.handle = module.register_forward_hook(_exit_hook)
    module.__dict__[_EXIT_ATTR] = st
    return True


def _uninstall_exit(module: nn.Module) -> None:
    st: _ExitState | None = module.__dict__.pop(_EXIT_ATTR, None)
    if st is not None and st.handle is not None:
        st.handle.remove()


def _install(module: nn.Module, st: _GuardState) -> bool:
    """Install or update the hook of one module; True when a new hook was added."""
    old: _GuardState | None = module.__dict__.get(_ATTR)
    if old is not None:
        st.handle = old.handle
        module.__dict__[_ATTR] = st
        return False
    st.handle = module.register_forward_pre_hook(_guard_hook, with_kwargs=True)
    module.__dict__[_ATTR] = st
    return True


_EAGER_ALONE: list[bool] = []  # eager_when_compiled_alone ran (once per process)


def _eager_when_compiled_alone() -> None:
    """The guard's hook frames run eagerly when ``torch.compile(model)`` calls them outside
    the model's graph (see :func:`~hf_precision.engine.batch.eager_when_compiled_alone`)."""
    if not _EAGER_ALONE:
        _EAGER_ALONE.append(True)
        eager_when_compiled_alone(_guard_hook, _cast_value, _cast_arg, _follow_device)


def _uninstall(module: nn.Module) -> None:
    st: _GuardState | None = module.__dict__.pop(_ATTR, None)
    if st is not None and st.handle is not None:
        st.handle.remove()


@dataclass
class GuardHandle:
    """The guards installed on a model; :meth:`remove` takes them all off."""

    root: nn.Module
    batch: list[str] = field(default_factory=list)
    boundary: list[str] = field(default_factory=list)
    leaf: list[str] = field(default_factory=list)
    #: group roots whose outputs leave in the language model's embedding dtype (forward hooks)
    exit: list[str] = field(default_factory=list)
    added: int = 0

    @property
    def count(self) -> int:
        """The forward pre-hooks (batch, boundary, entry, leaf); the exit hooks sit on group
        roots that carry a boundary guard too."""
        return len(self.batch) + len(self.boundary) + len(self.leaf)

    def remove(self) -> None:
        remove_guards(self.root)

    def __repr__(self) -> str:
        return (
            f"GuardHandle(batch={len(self.batch)}, boundary={len(self.boundary)}, "
            f"leaf={len(self.leaf)}, exit={len(self.exit)})"
        )


_HIDDEN_ATTR = "_hf_precision_hidden"


def _all_modules(root: nn.Module) -> Iterator[nn.Module]:
    """``root.modules()`` plus guarded modules held outside the tree (see ``_group_roots``)."""
    yield from root.modules()
    for hidden in root.__dict__.get(_HIDDEN_ATTR, ()):
        yield from hidden.modules()


def remove_guards(model: nn.Module) -> int:
    """Remove every hf-precision hook from ``model``; returns how many were removed."""
    root, _ = unwrap_model(model)
    n = 0
    for mod in list(_all_modules(root)):
        if _ATTR in mod.__dict__ or _EXIT_ATTR in mod.__dict__:
            _uninstall(mod)
            _uninstall_exit(mod)
            n += 1
    return n


def installed_guards(model: nn.Module) -> int:
    """How many modules carry an hf-precision hook."""
    root, _ = unwrap_model(model)
    return sum(1 for m in _all_modules(root) if _ATTR in m.__dict__ or _EXIT_ATTR in m.__dict__)


def _own_weight(mod: nn.Module) -> tuple[torch.dtype, torch.Tensor | None] | None:
    """The dtype a leaf computes in and the weight to follow if it is cast later: a quantized
    weight's compute dtype first (torchao, optimum-quanto, bitsandbytes 4-bit kernels expect
    their input in it), else the first floating weight's dtype."""
    castable = None
    for p in mod._parameters.values():
        if p is None:
            continue
        if is_castable(p):
            castable = castable if castable is not None else p
            continue
        compute = quantized_compute_dtype(p, mod)
        if compute is not None:  # a library tensor reporting its compute dtype can lead too
            return compute, p if p.dtype == compute else None
    return (castable.dtype, castable) if castable is not None else None


def _norm_held_fp32(mod: nn.Module, own: tuple[torch.dtype, torch.Tensor | None]) -> bool:
    """A normalization layer whose weights are held in float32 (``upcast_layernorm``): it takes
    half inputs itself (torch's norms and transformers' RMSNorms compute in float32 inside and
    most return the input's dtype), so no guard casts its input up, which would carry float32
    into what follows it (Qwen3.5's ``q_norm`` into attention, MiniCPM-V's ``ln_post`` into a
    bare matmul); the layers after it get the leaf guards."""
    return own[0] == torch.float32 and is_norm_module(mod)


def _group_roots(root: nn.Module, groups: ModuleGroups) -> list[tuple[str, nn.Module]]:
    """(path, module) of every group root, those held outside the module tree included."""
    from ..rules.groups import hidden_module

    out = [
        (path, mod)
        for group in groups.names
        for path, mod in zip(groups.paths.get(group, ()), groups.modules(group), strict=True)
    ]
    hidden = []
    for path in groups.hidden.values():
        mod = hidden_module(root, path)
        if mod is not None:
            out.append((path, mod))
            hidden.append(mod)
    root.__dict__[_HIDDEN_ATTR] = hidden  # so remove_guards/installed_guards reach them
    return out


def _ref_param(
    mod: nn.Module, dtype: torch.dtype, compute: Mapping[int, torch.dtype]
) -> torch.Tensor | None:
    """A frozen weight of ``mod`` in its receiving dtype (None under FSDP mixed precision, where
    the storage dtype is not the compute dtype)."""
    if compute:
        return None
    fallback = None
    for p in mod.parameters():
        if p.dtype == dtype and is_castable(p):
            if not p.requires_grad:
                return p
            fallback = fallback if fallback is not None else p
    return fallback


def _leaf_state(
    kind: GuardKind,
    path: str,
    own: tuple[torch.dtype, torch.Tensor | None],
    policy: PrecisionPolicy,
    compute: Mapping[int, torch.dtype],
    move: bool,
) -> _GuardState:
    """The guard of one weighted leaf (``entry`` or ``leaf``): its inputs in the dtype the leaf
    computes in (FSDP mixed precision's param_dtype where that casts the weight)."""
    dtype, w = own
    wrapped = w is not None and id(w) in compute
    dev = w.device if w is not None and move and w.device.type != "meta" else None
    return _GuardState(
        kind,
        path,
        compute[id(w)] if w is not None and wrapped else dtype,
        dev,
        policy.mode,
        ref=None if wrapped else w,
    )


def _put_entry(
    mod: nn.Module,
    path: str,
    policy: PrecisionPolicy,
    compute: Mapping[int, torch.dtype],
    move: bool,
    put: Any,
    handle: GuardHandle,
) -> None:
    """Guard the first weighted leaf of a group too: remote code often bypasses the group's own
    forward (MiniCPM-V / OmniLMM call ``vpm.forward_features(...)``), so only hooks below the
    group root see its input."""
    for sub_path, sub in mod.named_modules():
        if sub is mod or isinstance(sub, _SKIP_LEAVES):
            continue
        own = _own_weight(sub)
        if own is None or _norm_held_fp32(sub, own):
            continue
        put(
            sub,
            _leaf_state(
                "entry", f"{path}.{sub_path}" if path else sub_path, own, policy, compute, move
            ),
            handle.boundary,
        )
        return


def _embedding_weight(root: nn.Module, groups: ModuleGroups) -> torch.Tensor | None:
    """The weight of the language model's input embeddings (what image features are written
    into), or ``None`` when the model has none that a cast could follow (quantized, absent)."""
    owners = [root, *groups.modules("language_model")]
    for owner in owners:
        get = getattr(owner, "get_input_embeddings", None)
        if get is None:
            continue
        try:
            emb = get()
        except (NotImplementedError, AttributeError, TypeError):
            continue
        w = getattr(emb, "weight", None)
        if isinstance(w, torch.Tensor) and w.is_floating_point() and is_castable(w):
            return w
    return None


def _handover_roots(root: nn.Module, groups: ModuleGroups) -> list[tuple[str, nn.Module]]:
    """Where image features leave the image path for the language model: the roots of the
    projector if the model has one, else the resampler's, else the vision encoder's. When the
    model has both a resampler and a projector under one module that holds no language model
    (Idefics2's ``connector``: projection, then perceiver), that module hands over, so the one
    running first keeps its dtype for the other; a root inside another image-path group's root
    (Qwen2-VL's merger inside ``visual``) hands over through the outer one."""
    present = [g for g in _IMAGE_PATH if groups.modules(g)]
    if not present:
        return []
    roots = {g: list(zip(groups.paths.get(g, ()), groups.modules(g), strict=True)) for g in present}
    text = [p for g in ("language_model", "lm_head") for p in groups.paths.get(g, ())]
    chosen = roots[present[-1]]
    joint = [path for g in ("resampler", "projector") if g in roots for path, _ in roots[g]]
    if "resampler" in roots and "projector" in roots:
        parts = [p.split(".") for p in joint]
        common = []
        for items in zip(*parts, strict=False):
            if len(set(items)) > 1:
                break
            common.append(items[0])
        lca = ".".join(common)
        holds_text = any(t == lca or t.startswith(lca + ".") for t in text)
        if lca and not holds_text:
            try:  # a path lookup, not another walk of the model
                chosen = [(lca, root.get_submodule(lca))]
            except AttributeError:  # the common path runs through a list: keep the groups'
                pass
    outer = {path: mod for g in present for path, mod in roots[g]}
    out: list[tuple[str, nn.Module]] = []
    for path, mod in chosen:
        holders = [p for p in outer if p and path.startswith(p + ".")]
        if holders:
            path = min(holders, key=len)
            mod = outer[path]
        if mod is not root and all(m is not mod for _, m in out):
            out.append((path, mod))
    return out


def _batch_state(
    root: nn.Module,
    policy: PrecisionPolicy,
    key_dtypes: dict[str, torch.dtype],
    device: torch.device | None,
) -> _GuardState:
    return _GuardState(
        "batch",
        "",
        policy.compute_dtype,
        device,
        policy.mode,
        key_dtypes=key_dtypes,
        skip_keys=policy.batch_skip_keys,
        arg_names=_arg_names(root),
    )


def _leaf_groups(policy: PrecisionPolicy, groups: ModuleGroups, report: Any) -> tuple[str, ...]:
    """Where leaf guards go: every group (``"on"``), the groups that mix dtypes and those that
    make tensors in forward (``"auto"``, given the plan's report), or none."""
    if policy.leaf_guards == "on":
        return (*groups.names, OTHER)
    if policy.leaf_guards == "auto" and report is not None:
        return (*report.mixed_groups, *sorted(LEAF_GUARDED_GROUPS))
    return ()


def install_guards(
    model: nn.Module,
    policy: PrecisionPolicy | str | None = None,
    report: Any = None,
    *,
    groups: ModuleGroups | None = None,
    leaf_groups: tuple[str, ...] | None = None,
    view: ModelView | None = None,
    notice: Notice | None = None,
) -> GuardHandle:
    """Install (or update, idempotently) the batch, boundary and leaf guards.

    ``report`` (an :class:`~hf_precision.engine.enforce.EnforceReport`) tells which groups mix
    dtypes;
    leaf guards go there when ``policy.leaf_guards == "auto"``. ``view`` is this event's walk
    of the model (:class:`~hf_precision.model.view.ModelView`), when the caller has one. ``notice``
    (a :class:`Notice`) hears of the first input each kind of guard casts at run time.
    """
    check_model(model, "install_guards(model, policy)")
    root, _ = unwrap_model(model)
    policy = PrecisionPolicy.resolve(policy, root)
    _eager_when_compiled_alone()
    if groups is None:
        groups = report.groups if report is not None else find_module_groups(root)
    view = ModelView.reuse(view, root, groups)
    move = policy.move_devices and not getattr(root, "hf_device_map", None)
    handle = GuardHandle(root)
    wanted: set[int] = set()

    def put(mod: nn.Module, st: _GuardState, bucket: list[str]) -> None:
        st.notice = notice
        wanted.add(id(mod))
        handle.added += _install(mod, st)
        bucket.append(st.path)

    # empty unless FSDP mixed precision casts params (a wrapper around the root: walk it)
    compute = wrapper_compute_dtypes(
        model, [m for _, _, m in view.modules] if model is root else None
    )
    recv = receiving_dtypes(root, groups, compute=compute)
    _, root_device = receiving(root, compute, view.parameters())
    if policy.cast_batch:
        device = root_device if move else None
        put(root, _batch_state(root, policy, key_dtypes_for(policy, recv), device), handle.batch)
    if policy.boundary_guards:
        _put_boundaries(root, groups, policy, compute, move, put, handle)
    exits = _put_exits(root, groups, policy, report, view, notice, handle)
    if leaf_groups is None:
        leaf_groups = _leaf_groups(policy, groups, report)
    if leaf_groups:
        # modules holding a _keep_in_fp32_modules_strict tensor (routers) compute on their own
        strict = strict_modules(report.kept) if report is not None else set()
        for path, group, mod in view.modules:
            if group not in leaf_groups or id(mod) in wanted or isinstance(mod, _SKIP_LEAVES):
                continue
            own = _own_weight(mod) if path not in strict else None
            if own is not None and not _norm_held_fp32(mod, own):
                put(mod, _leaf_state("leaf", path, own, policy, compute, move), handle.leaf)
    _drop_unwanted(view, wanted, exits)
    return handle


def _drop_unwanted(view: ModelView, wanted: set[int], exits: set[int]) -> None:
    """Remove the guards no longer wanted (a group stopped mixing); hidden modules are in the
    view."""
    for _, _, mod in view.modules:
        if _ATTR in mod.__dict__ and id(mod) not in wanted:
            _uninstall(mod)
        if _EXIT_ATTR in mod.__dict__ and id(mod) not in exits:
            _uninstall_exit(mod)


def _put_boundaries(
    root: nn.Module,
    groups: ModuleGroups,
    policy: PrecisionPolicy,
    compute: Any,
    move: bool,
    put: Any,
    handle: GuardHandle,
) -> None:
    """:func:`install_guards`' boundary and entry guards, one of each per group."""
    for path, mod in _group_roots(root, groups):
        if mod is not root:  # the root's own inputs are the batch guard's
            dtype, device = receiving(mod, compute)
            if dtype is not None:
                st = _GuardState(
                    "boundary",
                    path,
                    dtype,
                    device if move else None,
                    policy.mode,
                    ref=_ref_param(mod, dtype, compute),
                )
                put(mod, st, handle.boundary)
        _put_entry(mod, path, policy, compute, move, put, handle)


def _put_exits(
    root: nn.Module,
    groups: ModuleGroups,
    policy: PrecisionPolicy,
    report: Any,
    view: ModelView,
    notice: Notice | None,
    handle: GuardHandle,
) -> set[int]:
    """:func:`install_guards`' exit hooks; the ids of the modules that have one."""
    exits: set[int] = set()
    emb = _embedding_weight(root, groups) if policy.mode == "fix" else None
    if emb is not None and policy.boundary_guards:
        for path, mod in _handover_roots(root, groups):
            exits.add(id(mod))
            handle.added += _install_exit(mod, _ExitState(path, emb, notice=notice))
            handle.exit.append(path)
    first = first_parameter_kept(view.modules, report.kept) if report is not None else None
    after = first[3] if first is not None and policy.mode == "fix" else None
    if first is not None and after is not None and after[1].dtype.itemsize < 4:
        # model.dtype reads an fp32 kept parameter: its module hands over in the next layer's dtype
        path, mod = first[0].rpartition(".")[0], first[2]
        if policy.boundary_guards and id(mod) not in exits:
            exits.add(id(mod))
            handle.added += _install_exit(mod, _ExitState(path, after[1], notice=notice))
            handle.exit.append(path)
    return exits


def guard_targets(model: nn.Module) -> Mapping[str, tuple[str, str]]:
    """``path -> (kind, dtype)`` of every installed guard (for reports and tests)."""
    root, _ = unwrap_model(model)
    out = {}
    for path, mod in root.named_modules():
        st = mod.__dict__.get(_ATTR)
        if st is not None:
            out[path] = (st.kind, dtype_name(st.dtype))
    return out
