"""The guards' install-time half: where each guard goes and what it targets, read from the
event's :class:`~hf_precision.model.view.ModelView` (group roots, the first weighted leaf of a
group, the leaves of a mixed group, the module that hands image features to the language model)
and the :class:`~hf_precision.engine.cast_hooks.GuardState` each one gets.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..rules.dtypes import is_castable
from ..rules.groups.group_rule import OTHER, leaf_guarded_groups
from ..rules.groups.module_groups import ModuleGroups, hidden_module
from ..rules.policy.precision_policy import PrecisionPolicy
from ..rules.roles import is_norm_module
from .cast_hooks import GuardKind, GuardState, Weight
from .fp8.storage import stored_compute

#: The attribute of the model's root listing the guarded modules held outside its module tree
#: (see :func:`group_roots`), so that removing the guards reaches them.
HIDDEN_ATTR = "_hf_precision_hidden"
#: The groups on the image path, in the order they usually run (see :func:`handover_roots`).
_IMAGE_PATH = ("vision_encoder", "resampler", "projector")
#: Leaves whose inputs are integer ids: a hook there would only cost time.
SKIP_LEAVES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)


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


def own_weight(mod: nn.Module) -> tuple[torch.dtype, torch.Tensor | None] | None:
    """The dtype a leaf computes in and the weight to follow if it is cast later: a quantized
    weight's compute dtype first (torchao, optimum-quanto, bitsandbytes 4-bit kernels expect
    their input in it; a layerwise casting hook's compute dtype for the fp8 weights it stores),
    else the first floating weight's dtype."""
    castable = None
    for p in mod._parameters.values():
        if p is None:
            continue
        if is_castable(p):
            castable = castable if castable is not None else p
            continue
        compute = stored_compute(p, mod)  # layerwise casting's compute dtype, a library's
        if compute is not None:  # a library tensor reporting its compute dtype can lead too
            return compute, p if p.dtype == compute else None
    return (castable.dtype, castable) if castable is not None else None


def norm_held_fp32(mod: nn.Module, own: tuple[torch.dtype, torch.Tensor | None]) -> bool:
    """A normalization layer whose weights are held in float32 (``upcast_layernorm``): it takes
    half inputs itself (torch's norms and transformers' RMSNorms compute in float32 inside and
    most return the input's dtype), so no guard casts its input up, which would carry float32
    into what follows it (Qwen3.5's ``q_norm`` into attention, MiniCPM-V's ``ln_post`` into a
    bare matmul); the layers after it get the leaf guards."""
    return own[0] == torch.float32 and is_norm_module(mod)


def group_roots(root: nn.Module, groups: ModuleGroups) -> list[tuple[str, nn.Module]]:
    """(path, module) of every group root, those held outside the module tree included."""
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
    root.__dict__[HIDDEN_ATTR] = hidden  # so remove_guards/installed_guards reach them
    return out


def weight_of(modules: Iterable[nn.Module], tensor: torch.Tensor | None) -> Weight | None:
    """``tensor`` as a :class:`~hf_precision.engine.cast_hooks.Weight`: the first of
    ``modules`` holding it, and its attribute name there."""
    if tensor is None:
        return None
    for mod in modules:
        for name, p in mod._parameters.items():
            if p is tensor:
                return Weight(mod, name)
    return None


def ref_param(
    modules: Iterable[nn.Module], dtype: torch.dtype, compute: Mapping[int, torch.dtype]
) -> Weight | None:
    """A frozen weight of ``modules`` (a module's subtree) in its receiving dtype (None under
    FSDP mixed precision, where the storage dtype is not the compute dtype)."""
    if compute:
        return None
    fallback = None
    for mod in modules:
        for name, p in mod._parameters.items():
            if p is not None and p.dtype == dtype and is_castable(p):
                if not p.requires_grad:
                    return Weight(mod, name)
                fallback = fallback if fallback is not None else Weight(mod, name)
    return fallback


def device_ref(modules: Iterable[nn.Module], device: torch.device | None) -> Weight | None:
    """A weight of ``modules`` on ``device`` (any castable one when ``device`` is ``None``): the
    batch guard's inputs go where it is at each call."""
    for mod in modules:
        for name, p in mod._parameters.items():
            if p is not None and is_castable(p) and (device is None or p.device == device):
                return Weight(mod, name)
    return None


def leaf_state(
    kind: GuardKind,
    path: str,
    mod: nn.Module,
    own: tuple[torch.dtype, torch.Tensor | None],
    policy: PrecisionPolicy,
    compute: Mapping[int, torch.dtype],
    move: bool,
) -> GuardState:
    """The guard of one weighted leaf ``mod`` (``entry`` or ``leaf``): its inputs in the dtype
    the leaf computes in (FSDP mixed precision's param_dtype where that casts the weight), on
    the device its weight is on at each call."""
    dtype, w = own
    wrapped = w is not None and id(w) in compute
    dev = w.device if w is not None and move and w.device.type != "meta" else None
    return GuardState(
        kind,
        path,
        compute[id(w)] if w is not None and wrapped else dtype,
        dev,
        policy.mode,
        weight=None if wrapped else weight_of((mod,), w),
        follow_device=move,
    )


def embedding_weight(root: nn.Module, groups: ModuleGroups) -> Weight | None:
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
            return weight_of((emb,), w)
    return None


def handover_roots(root: nn.Module, groups: ModuleGroups) -> list[tuple[str, nn.Module]]:
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


def batch_state(
    root: nn.Module,
    policy: PrecisionPolicy,
    key_dtypes: dict[str, torch.dtype],
    device: torch.device | None,
) -> GuardState:
    return GuardState(
        "batch",
        "",
        policy.compute_dtype,
        device,
        policy.mode,
        key_dtypes=key_dtypes,
        skip_keys=policy.batch_skip_keys,
        arg_names=_arg_names(root),
    )


def leaf_guard_groups(
    policy: PrecisionPolicy, groups: ModuleGroups, report: Any
) -> tuple[str, ...]:
    """Where leaf guards go: every group (``"on"``), the groups that mix dtypes and those that
    make tensors in forward (``"auto"``, given the plan's report), or none."""
    if policy.leaf_guards == "on":
        return (*groups.names, OTHER)
    if policy.leaf_guards == "auto" and report is not None:
        return (*report.mixed_groups, *leaf_guarded_groups())
    return ()


#: The layers autocast runs in half precision: a trainable float32 one of these inside a half
#: group hands its output on in the group's dtype (:func:`trainable_handovers`), as it would
#: under autocast.
_AUTOCAST_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: Groups whose outputs nothing half follows (logits): a float32 head there keeps its output.
_FINAL_GROUPS = ("lm_head",)


def trainable_handovers(
    view: Any, kept: Iterable[tuple[str, str, str, str]]
) -> list[tuple[str, nn.Module, Weight]]:
    """``(path, module, ref)`` of every trainable float32 linear/conv layer inside a group held
    in half precision (``ref``: a frozen weight of that group, read at call time): the policy
    keeps its weight in float32 for the optimizer, and outside autocast its float32 output
    would meet the group's half tensors in plain tensor code (attention's ``q`` beside half
    ``k``/``v``). Its output leaves in the group's dtype, as autocast would hand it on. Layers
    a keep rule holds, layers inside a PEFT adapter (PEFT casts its adapters' outputs itself)
    and the LM head keep their outputs."""
    names = {name.rpartition(".")[0] for name, *_ in kept}
    recv: dict[str, torch.dtype] | None = None  # read at the first candidate
    refs: dict[str, Weight | None] = {}
    out: list[tuple[str, nn.Module, Weight]] = []
    adapters: set[str] = set()  # paths of PEFT tuner layers seen so far (parents come first)
    for path, group, mod in view.modules:
        if hasattr(mod, "adapter_layer_names"):  # peft's BaseTunerLayer
            adapters.add(path)
        if not isinstance(mod, _AUTOCAST_LAYERS) or group in _FINAL_GROUPS or path in names:
            continue
        weight = mod._parameters.get("weight")
        if weight is None or weight.dtype != torch.float32 or not weight.requires_grad:
            continue
        recv = view.receiving_dtypes() if recv is None else recv
        half = recv.get(group)
        if half not in (torch.bfloat16, torch.float16):
            continue
        if adapters and _inside(path, adapters):
            continue
        if group not in refs:
            roots = view.groups.modules(group)
            subtree = [m for r in roots for _, _, m in view.within(r)]
            refs[group] = ref_param(subtree, half, view.compute)
        ref = refs[group]
        held = ref.current() if ref is not None else None
        if ref is not None and held is not None and not held.requires_grad:
            out.append((path, mod, ref))
    return out


def _inside(path: str, ancestors: set[str]) -> bool:
    """Whether a module path lies under one of ``ancestors`` (its prefixes, one per depth)."""
    end = path.rfind(".")
    while end > 0:
        if path[:end] in ancestors:
            return True
        end = path.rfind(".", 0, end)
    return False
