"""One walk of a model for one event: the second step of the data walk (model -> **view** ->
plan -> apply -> guards -> report, ``docs/architecture.md``).

:class:`ModelView` lists every module with its path and group, modules held outside the module
tree included; the plan, the wrapper check, the guards and the dtype map read it instead of
walking the model again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..base.wrappers import unwrap_model
from ..rules.dtypes import is_castable, majority_dtype
from ..rules.groups import OTHER, ModuleGroups, find_module_groups, hidden_module


def walk_modules(root: nn.Module, groups: ModuleGroups) -> Iterator[tuple[str, str, nn.Module]]:
    """``(path, group, module)`` of every module of ``root`` in pre-order, the group derived
    from the parent in O(1); modules held outside the module tree come last, under their group.
    The walk :func:`~hf_precision.enforce_policy` and the leaf guards share."""
    group_at: dict[str, str] = {}
    lookup = groups.by_path
    for path, mod in root.named_modules():
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        group = lookup.get(path) or (group_at.get(parent, OTHER) if path else lookup.get("", OTHER))
        group_at[path] = group
        yield path, group, mod
    # Modules held outside the module tree (OmniLMM's tune_clip=False keeps its vision tower in a
    # list, so model.to() never reaches it) are walked too: that is the seed's device bug.
    for group, hidden_path in groups.hidden.items():
        hidden = hidden_module(root, hidden_path)
        if hidden is not None:
            for sub, mod in hidden.named_modules(prefix=hidden_path):
                yield sub, group, mod


@dataclass
class ModelView:
    """One walk of a model for one event: every module with its path and group (modules held
    outside the module tree included, last). The plan (:func:`~hf_precision.enforce_policy`),
    the guards (:func:`~hf_precision.install_guards`) and the engine read this list instead of
    walking the model again.

    >>> from hf_precision.tiny import tiny_llava
    >>> view = ModelView.of(tiny_llava())
    >>> view.modules[1][:2], len(view.parameters()) == len(list(view.root.parameters()))
    (('model', 'other'), True)
    """

    root: nn.Module
    groups: ModuleGroups
    modules: list[tuple[str, str, nn.Module]]
    #: the object the walk was asked for (``root`` or the DDP/DeepSpeed/PEFT wrapper around it)
    model: nn.Module = field(default=None, repr=False)  # type: ignore[assignment]
    _parameters: list[nn.Parameter] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = self.root

    @classmethod
    def of(cls, model: nn.Module, groups: ModuleGroups | None = None) -> ModelView:
        root, _ = unwrap_model(model)
        groups = groups if groups is not None else find_module_groups(root)
        return cls(root, groups, list(walk_modules(root, groups)), model)

    @classmethod
    def reuse(
        cls, view: ModelView | None, model: nn.Module, groups: ModuleGroups | None = None
    ) -> ModelView:
        """``view`` when it is a walk of ``model``'s root (the caller's walk for this event),
        else a new walk."""
        root, _ = unwrap_model(model)
        if view is None or view.root is not root:
            return cls.of(model, groups)
        return view if view.model is model else replace(view, model=model)

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter once, in walk order (``root.parameters()`` plus hidden modules'),
        listed once per view."""
        if self._parameters is not None:
            return list(self._parameters)
        seen: set[int] = set()
        out = []
        for _, _, mod in self.modules:
            for p in mod._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        self._parameters = out
        return list(out)


def receiving(
    mod: nn.Module,
    compute: Mapping[int, torch.dtype] | None = None,
    params: Iterable[torch.Tensor] | None = None,
) -> tuple[torch.dtype | None, torch.device | None]:
    """The dtype a module's inputs must have (the majority dtype of its frozen floating
    weights, of all of them when none is frozen; FSDP's compute dtype where ``compute`` says
    so) and the device most of its weights are on (``None`` on meta). ``params``: the module's
    parameters when the caller has them."""
    frozen: list[tuple[torch.dtype, int]] = []
    every: list[tuple[torch.dtype, int]] = []
    devices: dict[torch.device, int] = {}
    for p in params if params is not None else mod.parameters():
        if not is_castable(p):
            continue
        # FSDP computes in its MixedPrecisionPolicy.param_dtype, not the storage dtype
        dt = compute.get(id(p), p.dtype) if compute else p.dtype
        every.append((dt, p.numel()))
        if not p.requires_grad:
            frozen.append((dt, p.numel()))
        devices[p.device] = devices.get(p.device, 0) + p.numel()
    dtype = majority_dtype(frozen) or majority_dtype(every)
    device = max(devices, key=lambda d: devices[d]) if devices else None
    if device is not None and device.type == "meta":
        device = None
    return dtype, device


def model_device(root: nn.Module, groups: ModuleGroups) -> torch.device | None:
    """Where the model lives: the language model's device, else the majority device."""

    def weights_per_device(mods: list[nn.Module]) -> dict[torch.device, int]:
        counts: dict[torch.device, int] = {}
        for p in (p for mod in mods for p in mod.parameters()):
            if p.device.type != "meta":
                counts[p.device] = counts.get(p.device, 0) + p.numel()
        return counts

    counts = weights_per_device(groups.modules("language_model") or [root])
    counts = counts or weights_per_device([root])
    return max(counts, key=lambda d: counts[d]) if counts else None
