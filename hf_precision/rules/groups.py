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

import inspect
import logging
import re
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..base.wrappers import clean_name, unwrap_model
from ..errors import PrecisionError, PrecisionWarning, check_model

logger = logging.getLogger("hf_precision")

#: The groups every VLM rule speaks of, in forward order.
VLM_GROUPS: tuple[str, ...] = (
    "vision_encoder",
    "resampler",
    "projector",
    "language_model",
    "lm_head",
)
#: Parameters outside every group.
OTHER = "other"
#: Groups that build tensors inside forward, so their leaves are guarded under
#: ``leaf_guards="auto"`` even when their weights agree: resamplers (MiniCPM-V 2.x's numpy sin-cos
#: table is fp32 whatever the weights are) and, registered by
# :mod:`hf_precision.rules.diffusion_rules`,
#: denoisers (the sinusoidal timestep embedding is made in fp32).
LEAF_GUARDED_GROUPS: set[str] = {"resampler"}
_GROUP_NAMES: list[str] = [*VLM_GROUPS[:3], "audio_encoder", *VLM_GROUPS[3:]]
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def register_group(name: str) -> str:
    """Declare a new group name (lowercase, ``[a-z0-9_]``) so policies may refer to it."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name == OTHER:
        raise PrecisionError(
            f"register_group({name!r}): group names are lowercase identifiers "
            f"([a-z][a-z0-9_]*) and not {OTHER!r}. Fix: use e.g. 'depth_encoder'."
        )
    if name not in _GROUP_NAMES:
        _GROUP_NAMES.append(name)
    return name


def group_names() -> tuple[str, ...]:
    """Every known group name (built-in and registered)."""
    return tuple(_GROUP_NAMES)


PathMap = Mapping[str, "tuple[str, ...] | str"]


def _norm(call: str, what: str, value: PathMap) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for group, paths in value.items():
        # A bare string would otherwise be iterated character by character.
        items = (paths,) if isinstance(paths, str) else tuple(paths)
        # "" (paths only) is the model itself: a denoiser or text encoder that is one group.
        if not all(isinstance(p, str) and (p or what == "paths") for p in items):
            raise PrecisionError(
                f"{call}: {what}[{group!r}]={paths!r} must be module paths (non-empty strings). "
                f"Fix: {what}={{{group!r}: ('model.vision_tower',)}}."
            )
        out[group] = items
    return out


@dataclass(frozen=True)
class GroupRule:
    """How to find the groups of one architecture family.

    ``paths`` maps a group to candidate module paths (the first that exists wins); ``extra``
    adds every listed module that exists (a second tower, a deepstack merger list); ``params``
    maps a group to direct parameters it owns (``image_newline``, ``query_tokens``,
    ``latent_query``). A bare string counts as a one-element tuple; the path ``""`` in
    ``paths`` is the model itself (a diffusers UNet found on its own is wholly ``unet``).
    """

    name: str
    paths: PathMap
    model_types: tuple[str, ...] = ()
    params: PathMap = field(default_factory=dict)
    required: tuple[str, ...] = ("language_model",)
    match: Callable[[nn.Module], bool] | None = None
    extra: PathMap = field(default_factory=dict)
    #: What the rule covers beyond ``model_types``, in words (remote-code families).
    note: str = ""
    #: A group's former name under this rule -> its name now (Qwen2-VL's merger was the
    #: ``resampler``, it is the ``projector``): a policy naming the old one still reaches it.
    renamed: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        call = f"GroupRule(name={self.name!r})"
        for attr in ("paths", "params", "extra"):
            object.__setattr__(self, attr, _norm(call, attr, getattr(self, attr)))
        object.__setattr__(self, "renamed", dict(self.renamed))
        if isinstance(self.model_types, str):
            object.__setattr__(self, "model_types", (self.model_types,))

    def applies_to(self, root: nn.Module, model_type: str | None) -> bool:
        if model_type is not None and model_type in self.model_types:
            return True
        return self.match is not None and bool(self.match(root))


_RULES: list[GroupRule] = []


def register_group_rule(rule: GroupRule, *, first: bool = False) -> GroupRule:
    """Add an architecture rule. Names are unique and lowercase; groups must be known.
    ``first=True`` puts it before the built-in rules (to override one for a model type).

    >>> from hf_precision.rules.groups import GroupRule, register_group_rule, unregister_group_rule
    >>> _ = register_group_rule(GroupRule(
    ...     name="my_vlm", model_types=("my_vlm",),
    ...     paths={"vision_encoder": ("encoder",), "language_model": ("decoder",)}))
    >>> unregister_group_rule("my_vlm")
    """
    call = f"register_group_rule(GroupRule(name={rule.name!r}))"
    if not isinstance(rule.name, str) or not _NAME_RE.match(rule.name):
        raise PrecisionError(
            f"{call}: rule names are lowercase identifiers ([a-z][a-z0-9_]*). "
            "Fix: e.g. name='my_vlm'."
        )
    if any(r.name == rule.name for r in _RULES):
        raise PrecisionError(
            f"{call}: a rule of that name exists. Fix: choose another name, "
            "or unregister_group_rule() the old one first."
        )
    used = set(rule.paths) | set(rule.params) | set(rule.extra) | set(rule.required)
    used |= set(rule.renamed) | set(rule.renamed.values())
    unknown = sorted(used - set(_GROUP_NAMES))
    if unknown:
        raise PrecisionError(
            f"{call}: unknown group(s) {unknown}. Allowed: "
            f"{', '.join(_GROUP_NAMES)}. Fix: register_group(name) first."
        )
    _RULES.insert(0, rule) if first else _RULES.append(rule)
    return rule


def unregister_group_rule(name: str) -> None:
    """Remove a rule by name (no error when absent)."""
    _RULES[:] = [r for r in _RULES if r.name != name]


def group_rules() -> tuple[GroupRule, ...]:
    return tuple(_RULES)


def architecture_table(rules: Iterable[GroupRule] | None = None) -> str:
    """The supported-architecture table (Markdown), generated from the rule registry: one row
    per rule (model-layout rules only; diffusion rules have their own groups), the model types
    it matches and, per group, its candidate paths (the first that exists wins), ``+`` modules
    it adds when present, and direct parameters.

    >>> row = architecture_table([group_rules()[0]]).splitlines()[2].split(" | ")
    >>> row[0], row[2]
    ('| llava', '`model.vision_tower`')
    """
    columns = _GROUP_NAMES[:6]  # vision, resampler, projector, audio, language model, head
    head = ["rule", "model types", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rule in rules if rules is not None else _RULES:
        if not set(rule.paths) | set(rule.extra) | set(rule.params) <= set(columns):
            continue
        types = "; ".join(x for x in (", ".join(rule.model_types), rule.note) if x)
        cells = [_cell(rule, g) for g in columns]
        lines.append("| " + " | ".join([rule.name, types, *cells]) + " |")
    lines.append(
        '| *fallback* | any other model (says what matched) | `get_encoder(modality="image")` '
        'or a tower name | a name pattern | a name pattern | `get_encoder(modality="audio")` '
        "or a tower name | `get_decoder()` or a name | `get_output_embeddings()` or a name |"
    )
    return "\n".join(lines) + "\n"


def _cell(rule: GroupRule, group: str) -> str:
    cell = " / ".join(f"`{p}`" if p else "the model" for p in rule.paths.get(group, ()))
    for p in rule.extra.get(group, ()):
        cell += f" + `{p}`" if cell else f"+ `{p}`"
    for p in rule.params.get(group, ()):
        cell += f", `{p}` (param)" if cell else f"`{p}` (param)"
    return cell or "—"


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
        return tuple(g for g in _GROUP_NAMES if g in found) + tuple(
            g for g in sorted(found) if g not in _GROUP_NAMES
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


def _hidden(root: nn.Module, path: str) -> bool:
    """A module reachable by attribute access but not registered (OmniLMM's list-hidden tower)."""
    return resolve_hidden(root, path) is not None


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


_FALLBACK_NAMES: dict[str, tuple[str, ...]] = {
    "vision_encoder": (
        "vision_tower",
        "visual",
        "vision_model",
        "vision_encoder",
        "image_tower",
        "image_encoder",
        "vpm",
        "vit",
        "vision_embed_tokens",
    ),
    "audio_encoder": ("audio_tower", "audio_encoder", "speech_encoder", "audio_model", "apm"),
    "language_model": ("language_model", "text_model", "llm", "decoder", "text_decoder"),
    "lm_head": ("lm_head", "output", "embed_out"),
}
_PATTERN_GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("resampler", re.compile(r"(resampler|merger|connector|qformer|abstractor|perceiver)$")),
    (
        "projector",
        re.compile(
            r"(multi_modal_projector|mm_projector|projector|language_projection|modality_projection"
            r"|vision_proj|visual_projection|img_projection|image_projection|aligner|mlp1)$"
        ),
    ),
)
_GETTERS = {
    "vision_encoder": "get_encoder",
    "audio_encoder": "get_encoder",
    "language_model": "get_decoder",
    "lm_head": "get_output_embeddings",
}
_MAX_DOTS = 3  # fallback looks at paths of at most 4 segments (``model.visual.merger.mlp``)
_PARAM_PATTERN = re.compile(r"^(image_newline|view_separator|query_tokens|latent_query)$")


def _getter(root: nn.Module, group: str) -> tuple[object, str] | None:
    """What the transformers accessor for ``group`` returns, and its name for the report."""
    get: Any = getattr(root, _GETTERS[group], None)
    if not callable(get):
        return None
    try:
        if group in ("vision_encoder", "audio_encoder"):
            if "modality" not in inspect.signature(get).parameters:
                return None  # transformers 4.x: get_encoder() takes no modality
            modality = "image" if group == "vision_encoder" else "audio"
            found = get(modality=modality)
            # get_encoder returns the model (or its base model) itself when it finds nothing.
            if found is root or found is getattr(root, "base_model", None):
                return None
            return found, f"get_encoder({modality})"
        return get(), _GETTERS[group]
    except Exception:  # best effort: some models raise for parts they lack
        return None


def _fallback(
    root: nn.Module,
) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]], list[str]]:
    # One shallow walk (4 levels) serves every lookup below: groups sit near the top, and a
    # 7B model's ~1k leaf modules need not be visited.
    modules: dict[str, nn.Module] = {"": root}
    path_of: dict[int, str] = {id(root): ""}
    todo = deque([("", root)])
    while todo:
        base, mod = todo.popleft()
        for child_name, child in mod._modules.items():
            if child is None or id(child) in path_of:
                continue
            name = f"{base}.{child_name}" if base else child_name
            modules[name] = child
            path_of[id(child)] = name
            if name.count(".") < _MAX_DOTS:
                todo.append((name, child))
    how: list[str] = []
    paths: dict[str, tuple[str, ...]] = {}
    for group in _FALLBACK_NAMES:
        got = _getter(root, group)
        path = path_of.get(id(got[0])) if got is not None else None
        if got is not None and path:
            paths[group] = (path,)
            how.append(f"{group}={got[1]}")
            continue
        hit = next(
            (p + n for n in _FALLBACK_NAMES[group] for p in ("model.", "") if p + n in modules),
            None,
        )
        if hit:
            paths[group] = (hit,)
            how.append(f"{group}=name:{hit}")
    lm = paths.get("language_model", ("\0",))[0]
    taken = {p for ps in paths.values() for p in ps}
    for group, pattern in _PATTERN_GROUPS:
        for name in modules:
            if (
                not name
                or name in taken
                or name.startswith(lm + ".")
                or not pattern.search(name.rsplit(".", 1)[-1])
            ):
                continue
            paths[group] = (name,)
            taken.add(name)
            how.append(f"{group}=pattern:{name}")
            break
    # Direct parameters of the wrapper levels (``model.image_newline``) join the resampler.
    params = tuple(
        f"{p}.{n}" if p else n
        for p in ("", "model")
        if p in modules
        for n, t in modules[p]._parameters.items()
        if t is not None and _PARAM_PATTERN.match(n)
    )
    if params:
        how.append("resampler=param:" + "+".join(params))
    return paths, ({"resampler": params} if params else {}), how


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
    for rule in _RULES:
        if rule.applies_to(root, mt):
            found = _apply_rule(rule, root)
            if found is not None:
                found.prefix = prefix
                if found.hidden:
                    _warn_hidden(root, found)
                return found
    paths, params, how = _fallback(root)
    if "language_model" not in paths and "vision_encoder" not in paths:
        msg = (
            f"find_module_groups({type(root).__name__}): no module groups recognised "
            f"(model_type={mt!r}); tried {len(_RULES)} rules and the get_encoder/get_decoder/"
            "name-pattern fallback."
        )
        fix = (
            "\nFix: register_group_rule(GroupRule(name=..., paths={'vision_encoder': ('path',), "
            "'language_model': ('path',)})) for this architecture."
        )
        looks = _looks_multimodal(root)
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


_MULTIMODAL_CONFIG = (
    "vision_config",
    "audio_config",
    "image_token_id",
    "image_token_index",
    "video_token_id",
    "mm_vision_tower",
)
_MULTIMODAL_NAME = re.compile(
    r"vision|visual|image|pixel|patch_embed|vit|clip|siglip|audio|speech|mm_proj|projector|"
    r"resampler|qformer",
    re.I,
)


def _looks_multimodal(root: nn.Module) -> str:
    """Why ``root`` looks like a multimodal model (a config field, a module name or class),
    or ``""``: text-only and custom models are guarded as one group without advice."""
    config = getattr(root, "config", None)
    for key in _MULTIMODAL_CONFIG:
        if getattr(config, key, None) is not None:
            return f"config.{key}"
    for name, mod in root.named_modules():
        for text in (name.rsplit(".", 1)[-1], type(mod).__name__):
            if text and _MULTIMODAL_NAME.search(text):
                return f"module {name or '<root>'} ({type(mod).__name__})"
    return ""


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
