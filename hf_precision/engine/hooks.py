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
  output written into fp32 embeddings. A trainable fp32 linear/conv layer inside a group held
  in half precision gets one too (``hook_targets.trainable_handovers``): its output leaves in
  the group's dtype, as autocast would hand it on (a trained fp32 ``q_proj`` beside half
  ``k``/``v`` in attention).

Targets are computed at install time, from the event's
:class:`~hf_precision.model.view.ModelView` (:func:`guards_on`; :func:`install_guards` is its
shell for callers without a view): :mod:`.hook_targets` chooses them, :mod:`.cast_hooks` holds
the hooks that run at every forward, whose per-call cost is a dtype comparison.

>>> from hf_precision import enforce_policy
>>> from hf_precision.engine.hooks import install_guards
>>> from hf_precision.tiny import tiny_llava
>>> model = tiny_llava()
>>> handle = install_guards(model, "bf16-true", enforce_policy(model, "bf16-true"))
>>> handle.remove()
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..base.names import EXIT_ATTR, GUARD_ATTR
from ..base.wrapper_kinds import unwrap_model
from ..model.view import ModelView
from ..rules.dtypes import dtype_name
from ..rules.groups.module_groups import ModuleGroups
from ..rules.keep_rules import first_parameter_kept, strict_modules
from ..rules.policy.precision_policy import PrecisionPolicy
from .batch import key_dtypes_for
from .cast_hooks import (
    ExitState,
    GuardState,
    Notice,
    eager_hooks,
    install_exit,
    install_hook,
    uninstall_exit,
    uninstall_hook,
)
from .fp8.shapes import uninstall_token_check
from .fp8.storage import fp8_first_layers
from .hook_targets import (
    HIDDEN_ATTR,
    SKIP_LEAVES,
    batch_state,
    device_ref,
    embedding_weight,
    group_roots,
    handover_roots,
    leaf_guard_groups,
    leaf_state,
    norm_held_fp32,
    own_weight,
    ref_param,
    trainable_handovers,
    weight_of,
)

__all__ = ["GuardHandle", "guard_targets", "install_guards", "installed_guards", "remove_guards"]


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
    #: handles made in this process (the launcher's exit line reads it: a process that trained
    #: with none made reached no model)
    made: ClassVar[int] = 0

    def __post_init__(self) -> None:
        GuardHandle.made += 1

    @property
    def count(self) -> int:
        """The forward pre-hooks (batch, boundary, entry, leaf); the exit hooks sit on group
        roots that carry a boundary guard too."""
        return len(self.batch) + len(self.boundary) + len(self.leaf)

    def counts(self) -> dict[str, int]:
        """The hooks by kind and in all (:attr:`count`), as the event's ``hooks`` section."""
        kinds = {k: len(getattr(self, k)) for k in ("batch", "boundary", "leaf", "exit")}
        return {**kinds, "pre_hooks": self.count}

    def remove(self) -> None:
        remove_guards(self.root)

    def __repr__(self) -> str:
        return (
            f"GuardHandle(batch={len(self.batch)}, boundary={len(self.boundary)}, "
            f"leaf={len(self.leaf)}, exit={len(self.exit)})"
        )


def _all_modules(root: nn.Module) -> Iterator[nn.Module]:
    """``root.modules()`` plus guarded modules held outside the tree (see ``group_roots``)."""
    yield from root.modules()
    for hidden in root.__dict__.get(HIDDEN_ATTR, ()):
        yield from hidden.modules()


def remove_guards(model: nn.Module) -> int:
    """Remove every hf-precision hook from ``model``; returns how many were removed."""
    root, _ = unwrap_model(model)
    n = 0
    for mod in list(_all_modules(root)):
        n += uninstall_token_check(mod)  # the fp8 shape gate's (engine/fp8/shapes)
        if GUARD_ATTR in mod.__dict__ or EXIT_ATTR in mod.__dict__:
            uninstall_hook(mod)
            uninstall_exit(mod)
            n += 1
    return n


def installed_guards(model: nn.Module) -> int:
    """How many modules carry an hf-precision hook."""
    root, _ = unwrap_model(model)
    return sum(1 for m in _all_modules(root) if GUARD_ATTR in m.__dict__ or EXIT_ATTR in m.__dict__)


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

    ``report`` (an :class:`~hf_precision.engine.records.EnforceReport`) tells which groups mix
    dtypes; leaf guards go there when ``policy.leaf_guards == "auto"``. ``view`` is this event's
    walk of the model (:class:`~hf_precision.model.view.ModelView`), when the caller has one:
    the guards read it, nothing is walked again. ``notice`` (a :class:`Notice`) hears of the
    first input each kind of guard casts at run time.
    """
    if view is None or (model is not view.model and model is not view.root):
        if groups is None and report is not None:
            groups = report.groups
        view = ModelView.reuse(None, model, groups, call="install_guards(model, policy)")
    policy = PrecisionPolicy.resolve(policy, view.root)
    return guards_on(view, policy, report, leaf_groups=leaf_groups, notice=notice)


def guards_on(
    view: ModelView,
    policy: PrecisionPolicy,
    report: Any = None,
    *,
    leaf_groups: tuple[str, ...] | None = None,
    notice: Notice | None = None,
) -> GuardHandle:
    """:func:`install_guards` on the event's walk ``view``: what the guards target comes from
    it (each group's receiving dtype and device, its first weighted leaf, the leaves of the
    groups that mix dtypes), and guards no longer wanted come off."""
    eager_hooks()
    put = _Installer(view, policy, notice)
    root, groups = view.root, view.groups
    if policy.cast_batch:
        recv = view.receiving_dtypes()
        _, root_device = view.receiving_of(root)
        device = root_device if put.move else None
        st = batch_state(root, policy, key_dtypes_for(policy, recv), device)
        if put.move:  # the batch goes where the model is at each call (offloading moves it)
            st.weight = device_ref((m for _, _, m in view.modules), root_device)
            st.follow_dtype, st.follow_device = False, True
        put(root, st, "batch")
    if policy.boundary_guards:
        put.boundaries()
    for first in fp8_first_layers(view):  # model.dtype reads its fp8 storage: inputs come in fp8
        if id(first.module) not in put.wanted:
            computes: tuple[torch.dtype, None] = (first.compute, None)
            st = leaf_state("entry", first.path, first.module, computes, policy, {}, put.move)
            put(first.module, st, "boundary")
    exits = _put_exits(put, report)
    if leaf_groups is None:
        leaf_groups = leaf_guard_groups(policy, groups, report)
    if leaf_groups:
        # modules holding a _keep_in_fp32_modules_strict tensor (routers) compute on their own
        strict = strict_modules(report.kept) if report is not None else set()
        for path, group, mod in view.modules:
            if group not in leaf_groups or id(mod) in put.wanted or isinstance(mod, SKIP_LEAVES):
                continue
            own = own_weight(mod) if path not in strict else None
            if own is not None and not norm_held_fp32(mod, own):
                st = leaf_state("leaf", path, mod, own, policy, view.compute, put.move)
                put(mod, st, "leaf")
    _drop_unwanted(view, put.wanted, exits)
    return put.handle


class _Installer:
    """Puts the guards of one :func:`guards_on` call on their modules (``put(mod, state,
    kind)``) and remembers which modules carry one."""

    def __init__(self, view: ModelView, policy: PrecisionPolicy, notice: Notice | None) -> None:
        self.view, self.policy, self.notice = view, policy, notice
        self.move = policy.move_devices and not getattr(view.root, "hf_device_map", None)
        self.handle = GuardHandle(view.root)
        self.wanted: set[int] = set()

    def __call__(self, mod: nn.Module, st: GuardState, bucket: str) -> None:
        st.notice = self.notice
        self.wanted.add(id(mod))
        self.handle.added += install_hook(mod, st)
        getattr(self.handle, bucket).append(st.path)

    def exit(self, mod: nn.Module, st: ExitState) -> None:
        self.handle.added += install_exit(mod, st)
        self.handle.exit.append(st.path)

    def boundaries(self) -> None:
        """The boundary and entry guards, one of each per group."""
        view, policy = self.view, self.policy
        compute = view.compute
        for path, mod in group_roots(view.root, view.groups):
            if mod is not view.root:  # the root's own inputs are the batch guard's
                dtype, device = view.receiving_of(mod)
                if dtype is not None:
                    ref = ref_param((m for _, _, m in view.within(mod)), dtype, compute)
                    dev = device if self.move else None
                    st = GuardState(
                        "boundary",
                        path,
                        dtype,
                        dev,
                        policy.mode,
                        weight=ref,
                        follow_device=self.move,
                    )
                    self(mod, st, "boundary")
            self.entry(mod)

    def entry(self, mod: nn.Module) -> None:
        """Guard the first weighted leaf of a group too: remote code often bypasses the group's
        own forward (MiniCPM-V / OmniLMM call ``vpm.forward_features(...)``), so only hooks
        below the group root see its input."""
        for sub_path, _, sub in self.view.within(mod)[1:]:
            if isinstance(sub, SKIP_LEAVES):
                continue
            own = own_weight(sub)
            if own is None or norm_held_fp32(sub, own):
                continue
            st = leaf_state("entry", sub_path, sub, own, self.policy, self.view.compute, self.move)
            self(sub, st, "boundary")
            return


def _drop_unwanted(view: ModelView, wanted: set[int], exits: set[int]) -> None:
    """Remove the guards no longer wanted (a group stopped mixing); hidden modules are in the
    view."""
    for _, _, mod in view.modules:
        if GUARD_ATTR in mod.__dict__ and id(mod) not in wanted:
            uninstall_hook(mod)
        if EXIT_ATTR in mod.__dict__ and id(mod) not in exits:
            uninstall_exit(mod)


def _put_exits(put: _Installer, report: Any) -> set[int]:
    """:func:`guards_on`' exit hooks; the ids of the modules that have one."""
    view, policy = put.view, put.policy
    exits: set[int] = set()
    emb = embedding_weight(view.root, view.groups) if policy.mode == "fix" else None
    if emb is not None and policy.boundary_guards:
        for path, mod in handover_roots(view.root, view.groups):
            exits.add(id(mod))
            put.exit(mod, ExitState(path, emb, notice=put.notice))
    first = first_parameter_kept(view.modules, report.kept) if report is not None else None
    after = first[3] if first is not None and policy.mode == "fix" else None
    if first is not None and after is not None and after[1].dtype.itemsize < 4:
        # model.dtype reads an fp32 kept parameter: its module hands over in the next layer's dtype
        path, mod = first[0].rpartition(".")[0], first[2]
        ref = weight_of((m for _, _, m in view.modules), after[1])
        if policy.boundary_guards and id(mod) not in exits and ref is not None:
            exits.add(id(mod))
            put.exit(mod, ExitState(path, ref, notice=put.notice))
    if policy.mode == "fix" and policy.boundary_guards and report is not None:
        # a trainable fp32 layer in a half group hands its output on in the group's dtype
        for path, mod, ref in trainable_handovers(view, report.kept):
            if id(mod) not in exits:
                exits.add(id(mod))
                put.exit(mod, ExitState(path, ref, notice=put.notice))
    return exits


def guard_targets(model: nn.Module) -> Mapping[str, tuple[str, str]]:
    """``path -> (kind, dtype)`` of every installed guard (for reports and tests)."""
    root, _ = unwrap_model(model)
    out = {}
    for path, mod in root.named_modules():
        st = mod.__dict__.get(GUARD_ATTR)
        if st is not None:
            out[path] = (st.kind, dtype_name(st.dtype))
    return out
