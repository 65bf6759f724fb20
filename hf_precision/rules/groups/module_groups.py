"""Module groups: which part of a multimodal model is the vision encoder, resampler, projector,
language model and LM head (plus ``audio_encoder`` for omni models).

Discovery is a registry of :class:`GroupRule` objects, tried in order; the first rule whose
``model_types`` (or ``match``) fits and whose required groups exist wins. When none fits, a
fallback uses ``get_encoder(modality=...)``, ``get_decoder()``, ``get_output_embeddings()`` and
name patterns, and says which of them matched in :attr:`ModuleGroups.rule`. Paths are checked
against transformers 5.24 (``tests/rules/test_groups_all_architectures.py`` builds every
image-text-to-text architecture on the meta device).

The supported-architecture table (rules, model types, the paths of each group) is generated
from this registry by :func:`architecture_table`; docs/api.md's copy is checked against it, and
``hf-precision architectures`` prints it.

>>> from hf_precision import find_module_groups
>>> from hf_precision.tiny import tiny_llava
>>> groups = find_module_groups(tiny_llava())
>>> groups.rule, groups.paths["vision_encoder"]
('llava', ('model.vision_tower',))
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...base.wrapper_kinds import clean_name, unwrap_model
from ...errors import PrecisionError, PrecisionWarning, check_model
from .fallback import fallback_groups, looks_multimodal
from .group_rule import (
    GROUP_NAMES,
    OTHER,
    GroupRule,
)
from .registry import (
    group_rules,
)

__all__ = ["ModuleGroups", "find_module_groups", "hidden_module", "model_type_of", "resolve_hidden"]

logger = logging.getLogger("hf_precision")


def model_type_of(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    mt = getattr(config, "model_type", None)
    return mt if isinstance(mt, str) else None


# --------------------------------------------------------------------------------------------
# Result


@dataclass
class ModuleGroups:
    """The groups found in a model. Paths are relative to the unwrapped model (:attr:`root`);
    :attr:`hidden` lists group modules reachable as attributes but not registered submodules
    (``model.to()`` and :func:`enforce_policy` cannot reach them)."""

    root: nn.Module
    paths: dict[str, tuple[str, ...]]
    params: dict[str, tuple[str, ...]]
    rule: str
    model_type: str | None = None
    prefix: str = ""
    hidden: dict[str, str] = field(default_factory=dict)
    #: how each hidden group module is held: ``"list"``, ``"tuple"``, ``"dict"``, ``"attribute"``
    held: dict[str, str] = field(default_factory=dict)
    #: exact entries, group path or direct parameter name -> group (filled from ``paths`` and
    #: ``params``; :meth:`group_of` resolves any name inside them)
    by_path: dict[str, str] = field(default_factory=dict, repr=False)
    #: former group names of the rule that matched -> the group found under the new name
    #: (:attr:`GroupRule.renamed`, only where the old name was not found itself)
    renamed: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for group, paths in self.paths.items():
            for path in paths:
                self.by_path.setdefault(path, group)
        for group, names in self.params.items():
            for name in names:
                self.by_path[name] = group

    @property
    def names(self) -> tuple[str, ...]:
        """Groups that were found (have a module or a parameter), in forward order."""
        found = set(self.paths) | set(self.params)
        return tuple(g for g in GROUP_NAMES if g in found) + tuple(
            g for g in sorted(found) if g not in GROUP_NAMES
        )

    def __contains__(self, group: object) -> bool:
        return group in self.paths or group in self.params

    def group_of(self, name: str) -> str:
        """Group of a module path or parameter name: the longest matching group path wins, so a
        projector nested in the vision encoder (Qwen2-VL's ``model.visual.merger``) is its own.
        Names from the wrapped model (``base_model.model.…``, ``module.…``) are accepted."""
        if self.prefix and name.startswith(self.prefix):
            name = name[len(self.prefix) :]
        name = clean_name(name)
        lookup = self.by_path
        hit = lookup.get(name)
        if hit is not None:
            return hit
        while "." in name:
            name = name.rsplit(".", 1)[0]
            hit = lookup.get(name)
            if hit is not None:
                return hit
        return lookup.get("", OTHER)

    def modules(self, group: str) -> list[nn.Module]:
        """The root modules of a group (empty for parameter-only groups)."""
        return [self.root.get_submodule(p) if p else self.root for p in self.paths.get(group, ())]

    def items(self) -> Iterator[tuple[str, tuple[str, ...]]]:
        return iter(self.paths.items())

    def to_dict(self) -> dict[str, object]:
        return {
            "rule": self.rule,
            "model_type": self.model_type,
            "groups": {g: list(p) for g, p in self.paths.items()},
            "params": {g: list(p) for g, p in self.params.items()},
            "hidden": {
                g: {"path": p, "held": self.held.get(g, "attribute")}
                for g, p in self.hidden.items()
            },
        }

    def __str__(self) -> str:
        lines = [f"ModuleGroups(rule={self.rule!r}, model_type={self.model_type!r})"]
        for g in self.names:
            where = list(self.paths.get(g, ())) + [f"{p} (param)" for p in self.params.get(g, ())]
            lines.append(f"  {g:<15} {', '.join(where)}")
        for g, p in self.hidden.items():
            lines.append(
                f"  {g:<15} {p} (hidden: held in a {self.held.get(g, 'attribute')}, "
                "not a registered submodule)"
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Discovery


def _get(root: nn.Module, path: str) -> nn.Module | None:
    """The registered submodule at ``path`` (through ``_modules`` only, never ``__getattr__``
    tricks), or None. ``""`` is ``root`` itself."""
    if not path:
        return root
    mod: nn.Module | None = root
    for part in path.split("."):
        mod = mod._modules.get(part) if mod is not None else None
        if mod is None:
            return None
    return mod


def resolve_hidden(root: nn.Module, path: str) -> tuple[nn.Module, str] | None:
    """The module at ``path`` when some step of it is not a registered submodule, and how it is
    held: ``"list"``/``"tuple"``/``"dict"`` (a plain container attribute holding exactly one
    module: OmniLMM's ``self.vision_tower = [tower]``, which ``nn.Module.__setattr__`` keeps in
    the instance ``__dict__``) or ``"attribute"`` (an unregistered attribute or ``__getattr__``
    indirection). ``None`` when nothing is there or every step is registered."""
    obj: Any = root
    how = ""
    for part in path.split("."):
        if not isinstance(obj, nn.Module):
            return None
        if part in obj._modules:
            obj = obj._modules[part]
            continue
        try:
            obj = getattr(obj, part)
        except Exception:  # a custom __getattr__ may raise anything for a missing name
            return None
        if isinstance(obj, (list, tuple)) and len(obj) == 1 and isinstance(obj[0], nn.Module):
            how, obj = type(obj).__name__, obj[0]
        elif isinstance(obj, dict) and len(obj) == 1:
            how, obj = "dict", next(iter(obj.values()))
        else:
            how = how or "attribute"
    return (obj, how) if how and isinstance(obj, nn.Module) else None


def hidden_module(root: nn.Module, path: str) -> nn.Module | None:
    """The module a hidden group path leads to (see :func:`resolve_hidden`), or ``None``."""
    found = resolve_hidden(root, path)
    return found[0] if found is not None else None


def _has_param(root: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    mod = _get(root, owner) if owner else root
    return mod is not None and mod._parameters.get(leaf) is not None


def _apply_rule(rule: GroupRule, root: nn.Module) -> ModuleGroups | None:
    paths: dict[str, tuple[str, ...]] = {}
    hidden: dict[str, str] = {}
    held: dict[str, str] = {}
    taken: set[str] = set()
    for group, candidates in rule.paths.items():
        for cand in candidates:
            if cand not in taken and _get(root, cand) is not None:
                paths[group] = (cand,)
                taken.add(cand)
                break
        else:
            for cand in candidates:
                found = resolve_hidden(root, cand)
                if found is not None:
                    hidden[group], held[group] = cand, found[1]
                    break
    for group, extras in rule.extra.items():
        more = tuple(p for p in extras if p not in taken and _get(root, p) is not None)
        if more:
            paths[group] = paths.get(group, ()) + more
            taken.update(more)
    params: dict[str, tuple[str, ...]] = {}
    for group, names in rule.params.items():
        present = tuple(n for n in names if _has_param(root, n))
        if present:
            params[group] = present
    if any(g not in paths and g not in params for g in rule.required):
        return None
    renamed = {
        old: new
        for old, new in rule.renamed.items()
        if old not in paths and old not in params and (new in paths or new in params)
    }
    return ModuleGroups(
        root,
        paths,
        params,
        rule.name,
        model_type_of(root),
        hidden=hidden,
        held=held,
        renamed=renamed,
    )


def find_module_groups(model: nn.Module, *, strict: bool = False) -> ModuleGroups:
    """Find the module groups of ``model`` (PEFT, DDP/FSDP1/DataParallel and ``torch.compile``
    unwrapped). :attr:`ModuleGroups.rule` names the rule, or how the fallback matched.

    With no recognisable group, warns (:class:`PrecisionWarning`) and returns everything as one
    group ``"other"``; ``strict=True`` raises :class:`PrecisionError` instead.

    >>> from hf_precision.tiny import tiny_qwen2_vl
    >>> g = find_module_groups(tiny_qwen2_vl())
    >>> g.rule, g.group_of("model.visual.merger.mlp.0.weight"), g.group_of("model.visual.blocks.0")
    ('qwen2_vl', 'projector', 'vision_encoder')
    """
    check_model(model, "find_module_groups(model)")
    root, prefix = unwrap_model(model)
    mt = model_type_of(root)
    rules = group_rules()  # the built-in ones are read on first use
    for rule in rules:
        if rule.applies_to(root, mt):
            found = _apply_rule(rule, root)
            if found is not None:
                found.prefix = prefix
                if found.hidden:
                    _warn_hidden(root, found)
                return found
    paths, params, how = fallback_groups(root)
    if "language_model" not in paths and "vision_encoder" not in paths:
        msg = (
            f"find_module_groups({type(root).__name__}): no module groups recognised "
            f"(model_type={mt!r}); tried {len(rules)} rules and the get_encoder/get_decoder/"
            "name-pattern fallback."
        )
        fix = (
            "\nFix: register_group_rule(GroupRule(name=..., paths={'vision_encoder': ('path',), "
            "'language_model': ('path',)})) for this architecture."
        )
        looks = looks_multimodal(root)
        if strict:
            raise PrecisionError(msg + fix)
        if looks:  # a VLM the rules miss: the advice helps
            warnings.warn(
                f"{msg} It looks multimodal ({looks}).{fix} The whole model is treated as one "
                "group.",
                PrecisionWarning,
                stacklevel=2,
            )
        else:  # a text-only or custom model: one group is all there is, nothing to advise
            # (debug: the front ends' one info line names the rule, 'none')
            logger.debug("hf-precision: %s The whole model is one group.", msg)
        return ModuleGroups(root, {}, {}, "none", mt, prefix)
    return ModuleGroups(root, paths, params, "fallback(" + ", ".join(how) + ")", mt, prefix)


def _warn_hidden(root: nn.Module, found: ModuleGroups) -> None:
    where = ", ".join(
        f"{g}={p!r} (held in a {found.held.get(g, 'attribute')})" for g, p in found.hidden.items()
    )
    warnings.warn(
        f"find_module_groups({type(root).__name__}): {where} is reachable as an attribute but is "
        "not a registered submodule, so model.to(dtype/device), "
        "state_dict() and the optimizer's model.parameters() never see it. enforce_policy and "
        "the guards reach it by attribute and cast/move it with its group.\n"
        "Fix: register it as a submodule (OmniLMM: tune_clip=True) so the rest of the stack "
        "sees it too.",
        PrecisionWarning,
        stacklevel=3,
    )
