"""One walk of a model for one event: the second step of the data walk (model -> **view** ->
plan -> apply -> guards -> report, ``docs/architecture.md``).

:class:`ModelView` lists every module with its path and group, modules held outside the module
tree included; the plan, the wrapper check, the guards and the dtype map read it instead of
walking the model again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..base.wrapper_kinds import unwrap_model, wrapper_compute_dtypes
from ..errors import check_model
from ..rules.dtypes import is_castable, majority_dtype
from ..rules.groups.group_rule import OTHER
from ..rules.groups.module_groups import ModuleGroups, find_module_groups, hidden_module
from .fp8 import layerwise_cast


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
    walking the model again; what they derive from it (the parameters, a module's subtree, the
    dtype and device each group receives) is cached here, for this event.

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
    #: the wrappers from ``model`` down to ``root`` (``root`` excluded; empty when unwrapped)
    outer: tuple[nn.Module, ...] = field(default=(), repr=False, compare=False)
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = self.root

    @classmethod
    def of(
        cls,
        model: nn.Module,
        groups: ModuleGroups | None = None,
        *,
        call: str = "ModelView.of",
        unwrapped: tuple[nn.Module, str] | None = None,
    ) -> ModelView:
        """The event's walk of ``model``: its one model check (a :class:`PrecisionError` that
        repeats ``call`` when ``model`` is no module), its one unwrap (``unwrapped``: the
        ``unwrap_model(model)`` the caller made for this event already) and its one walk."""
        check_model(model, call)
        root, prefix = unwrapped if unwrapped is not None else unwrap_model(model)
        return cls._walk(model, root, prefix, groups)

    @classmethod
    def _walk(
        cls, model: nn.Module, root: nn.Module, prefix: str, groups: ModuleGroups | None
    ) -> ModelView:
        groups = groups if groups is not None else find_module_groups(root)
        outer = _outer(model, prefix)
        return cls(root, groups, list(walk_modules(root, groups)), model, outer=outer)

    @classmethod
    def reuse(
        cls,
        view: ModelView | None,
        model: nn.Module,
        groups: ModuleGroups | None = None,
        *,
        call: str = "ModelView.reuse",
    ) -> ModelView:
        """``view`` when it is a walk of ``model``'s root (the caller's walk for this event),
        else a new walk (``call``: as in :meth:`of`)."""
        if view is not None and model is view.model:
            return view
        if view is not None and model is view.root:  # the model inside the view's wrappers
            return replace(view, model=model, outer=())
        check_model(model, call)
        root, prefix = unwrap_model(model)
        if view is None or view.root is not root:
            return cls._walk(model, root, prefix, groups)
        return replace(view, model=model, outer=_outer(model, prefix))

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter once, in walk order (``root.parameters()`` plus hidden modules'),
        listed once per view."""
        if self._parameters is None:
            self._parameters = _unique_parameters(self.modules)
        return list(self._parameters)

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """``path -> parameter`` of every module of the walk (a tied parameter under each of
        its names)."""
        return {
            f"{path}.{key}" if path else key: p
            for path, _, mod in self.modules
            for key, p in mod._parameters.items()
            if p is not None
        }

    def within(self, mod: nn.Module) -> list[tuple[str, str, nn.Module]]:
        """``mod`` and the modules below it, as this walk lists them (``mod.named_modules()``
        without walking it again); every module for the root."""
        if mod is self.root:
            return self.modules
        index = self._cache.get("index")
        if index is None:
            index = self._cache["index"] = {}
            for i, (_, _, m) in enumerate(self.modules):
                index.setdefault(id(m), i)
        start = index.get(id(mod))
        if start is None:  # not in this walk (a module the caller built since): walk it
            return [(p, OTHER, m) for p, m in mod.named_modules()]
        path = self.modules[start][0]
        below = path + "."
        end = start + 1
        while end < len(self.modules) and self.modules[end][0].startswith(below):
            end += 1
        return self.modules[start:end]

    def parameters_of(self, mod: nn.Module) -> list[nn.Parameter]:
        """``mod.parameters()``, from this walk (cached per module)."""
        key = ("params", id(mod))
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = _unique_parameters(self.within(mod))
        return list(found)

    def every_module(self) -> list[nn.Module]:
        """The wrappers around the root (:attr:`outer`), then every module of the walk:
        ``model.modules()`` of the object the walk was asked for, without walking it."""
        return [*self.outer, *(m for _, _, m in self.modules)]

    def modules_of(self, model: nn.Module) -> list[nn.Module] | None:
        """``model.modules()`` from this walk when ``model`` is the walked object or its root
        (``None`` for another model: the caller walks it)."""
        if model is self.model:
            return self.every_module()
        return [m for _, _, m in self.modules] if model is self.root else None

    @property
    def compute(self) -> dict[int, torch.dtype]:
        """``id(parameter) -> dtype`` FSDP mixed precision computes it in (empty without FSDP):
        :func:`~hf_precision.base.wrapper_kinds.wrapper_compute_dtypes` on this walk."""
        found = self._cache.get("compute")
        if found is None:
            found = wrapper_compute_dtypes(self.model, self.every_module())
            self._cache["compute"] = found
        return found  # type: ignore[no-any-return]

    @property
    def layerwise(self) -> dict[int, torch.dtype]:
        """``id(parameter) -> dtype`` a layerwise casting hook (diffusers, accelerate) computes
        a weight it stores in fp8 in (empty without one): the storage dtype never decides what
        a layer receives (:func:`layerwise_compute_dtype`)."""
        found = self._cache.get("layerwise")
        if found is None:
            found = self._cache["layerwise"] = {
                id(p): dt
                for _, _, mod in self.modules
                if "_diffusers_hook" in mod.__dict__ or "_hf_hook" in mod.__dict__
                for p in mod._parameters.values()
                if p is not None and (dt := layerwise_compute_dtype(p, mod)) is not None
            }
        return found  # type: ignore[no-any-return]

    def receiving_of(self, mod: nn.Module) -> tuple[torch.dtype | None, torch.device | None]:
        """:func:`receiving` of ``mod`` under this walk's FSDP compute dtypes and layerwise
        casting (cached)."""
        key = ("receiving", id(mod))
        found = self._cache.get(key)
        if found is None:
            params = self.parameters_of(mod)
            found = receiving(mod, self.compute, params, layerwise=self.layerwise)
            self._cache[key] = found
        return found  # type: ignore[no-any-return]

    def receiving_dtypes(self) -> dict[str, torch.dtype]:
        """Per group, the dtype its entry receives: the first of its roots that has one."""
        out = {}
        for group in self.groups.names:
            for mod in self.groups.modules(group):
                dtype, _ = self.receiving_of(mod)
                if dtype is not None:
                    out[group] = dtype
                    break
        return out

    def model_device(self) -> torch.device | None:
        """Where the model lives: the language model's device, else the majority device."""
        lm = self.groups.modules("language_model")
        counts = _weights_per_device(p for mod in lm for p in self.parameters_of(mod))
        counts = counts or _weights_per_device(self.parameters())
        return max(counts, key=lambda d: counts[d]) if counts else None


def _outer(model: nn.Module, prefix: str) -> tuple[nn.Module, ...]:
    """The wrappers ``unwrap_model`` peeled, outermost first (attribute reads, no walk)."""
    out: list[nn.Module] = []
    at = model
    for name in prefix.split(".")[:-1]:
        out.append(at)
        at = getattr(at, name)
    return tuple(out)


def _unique_parameters(walk: Iterable[tuple[str, str, nn.Module]]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for _, _, mod in walk:
        for p in mod._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _weights_per_device(params: Iterable[torch.Tensor]) -> dict[torch.device, int]:
    counts: dict[torch.device, int] = {}
    for p in params:
        if p.device.type != "meta":
            counts[p.device] = counts.get(p.device, 0) + p.numel()
    return counts


def layerwise_compute_dtype(tensor: torch.Tensor, mod: nn.Module | None) -> torch.dtype | None:
    """The dtype ``tensor``, a weight of ``mod``, is computed in when a layerwise casting hook
    on ``mod`` (diffusers, accelerate: :func:`~hf_precision.model.fp8.layerwise_cast`) stores it
    in its storage dtype; ``None`` otherwise."""
    cast = layerwise_cast(mod) if mod is not None else None
    if cast is None or tensor.dtype != cast[0]:
        return None
    return cast[1]


def receiving(
    mod: nn.Module,
    compute: Mapping[int, torch.dtype] | None = None,
    params: Iterable[torch.Tensor] | None = None,
    *,
    layerwise: Mapping[int, torch.dtype] | None = None,
) -> tuple[torch.dtype | None, torch.device | None]:
    """The dtype a module's inputs must have (the majority dtype of its frozen floating
    weights, of all of them when none is frozen; FSDP's compute dtype where ``compute`` says
    so, a layerwise casting hook's compute dtype for the fp8 weights it stores:
    :attr:`ModelView.layerwise`) and the device most of its weights are on (``None`` on meta).
    ``params``: the module's parameters when the caller has them."""
    frozen: list[tuple[torch.dtype, int]] = []
    every: list[tuple[torch.dtype, int]] = []
    devices: dict[torch.device, int] = {}
    for p in params if params is not None else mod.parameters():
        if not is_castable(p):
            if not layerwise or id(p) not in layerwise:
                continue
            dt = layerwise[id(p)]  # stored in fp8, computed in this
        else:  # FSDP computes in its MixedPrecisionPolicy.param_dtype, not the storage dtype
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
    counts = _weights_per_device(
        p for mod in groups.modules("language_model") for p in mod.parameters()
    )
    counts = counts or _weights_per_device(root.parameters())
    return max(counts, key=lambda d: counts[d]) if counts else None
