"""Module groups: which part of a multimodal model is the vision encoder, resampler, projector,
language model and LM head.

Discovery is a registry of :class:`GroupRule` objects, tried in order; the first rule whose
``model_types`` (or ``match``) fits and whose required groups exist wins. When none fits, a
fallback uses ``get_encoder(modality="image")``, ``get_decoder()``, ``get_output_embeddings()``
and name patterns, and says so in :attr:`ModuleGroups.rule`.

>>> from hf_precision import find_module_groups
>>> from hf_precision.tiny import tiny_llava
>>> groups = find_module_groups(tiny_llava())
>>> groups.rule, groups.paths["vision_encoder"]
('llava', ('model.vision_tower',))
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from torch import nn

from .errors import PrecisionError, PrecisionWarning

#: The groups every VLM rule speaks of, in forward order.
VLM_GROUPS: tuple[str, ...] = ("vision_encoder", "resampler", "projector", "language_model", "lm_head")
#: Parameters outside every group.
OTHER = "other"
_GROUP_NAMES: list[str] = list(VLM_GROUPS)
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def register_group(name: str) -> str:
    """Declare a new group name (lowercase, ``[a-z0-9_]``) so policies may refer to it."""
    if not _NAME_RE.match(name) or name == OTHER:
        raise PrecisionError(
            f"register_group({name!r}): group names are lowercase identifiers "
            f"([a-z][a-z0-9_]*) and not {OTHER!r}. Fix: use e.g. 'audio_encoder'."
        )
    if name not in _GROUP_NAMES:
        _GROUP_NAMES.append(name)
    return name


def group_names() -> tuple[str, ...]:
    """Every known group name (built-in and registered)."""
    return tuple(_GROUP_NAMES)


@dataclass(frozen=True)
class GroupRule:
    """How to find the groups of one architecture family.

    ``paths`` maps a group to candidate module paths (first that exists wins); ``params`` maps a
    group to direct parameters it owns (``image_newline``, ``query_tokens``, ``latent_query``).
    """

    name: str
    paths: Mapping[str, tuple[str, ...]]
    model_types: tuple[str, ...] = ()
    params: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    required: tuple[str, ...] = ("language_model",)
    match: Callable[[nn.Module], bool] | None = None

    def applies_to(self, root: nn.Module, model_type: str | None) -> bool:
        if model_type is not None and model_type in self.model_types:
            return True
        return self.match is not None and bool(self.match(root))


_RULES: list[GroupRule] = []


def register_group_rule(rule: GroupRule, *, first: bool = False) -> GroupRule:
    """Add an architecture rule. Names are unique and lowercase; groups must be known.

    >>> from hf_precision.groups import GroupRule, register_group_rule
    >>> _ = register_group_rule(GroupRule(
    ...     name="my_vlm", model_types=("my_vlm",),
    ...     paths={"vision_encoder": ("encoder",), "language_model": ("decoder",)}))
    """
    if not _NAME_RE.match(rule.name):
        raise PrecisionError(
            f"register_group_rule(GroupRule(name={rule.name!r})): rule names are lowercase "
            "identifiers. Fix: e.g. name='my_vlm'."
        )
    if any(r.name == rule.name for r in _RULES):
        raise PrecisionError(
            f"register_group_rule(GroupRule(name={rule.name!r})): a rule of that name exists. "
            "Fix: choose another name, or unregister_group_rule() the old one first."
        )
    unknown = sorted((set(rule.paths) | set(rule.params)) - set(_GROUP_NAMES))
    if unknown:
        raise PrecisionError(
            f"register_group_rule(GroupRule(name={rule.name!r})): unknown group(s) {unknown}. "
            f"Allowed: {', '.join(_GROUP_NAMES)}. Fix: register_group(name) first."
        )
    _RULES.insert(0, rule) if first else _RULES.append(rule)
    return rule


def unregister_group_rule(name: str) -> None:
    """Remove a rule by name (no error when absent)."""
    _RULES[:] = [r for r in _RULES if r.name != name]


def group_rules() -> tuple[GroupRule, ...]:
    return tuple(_RULES)


# --------------------------------------------------------------------------------------------
# Wrappers

_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """Drop FSDP1 / checkpoint / compile wrapper segments from a parameter or module path."""
    for seg in _WRAPPER_SEGMENTS:
        if seg in name:
            name = name.replace(seg, "")
    return name.removesuffix("._fsdp_wrapped_module").removesuffix("._orig_mod")


def unwrap_model(model: nn.Module) -> tuple[nn.Module, str]:
    """Peel DDP/FSDP1/DataParallel, ``torch.compile`` and PEFT wrappers.

    Returns the innermost model and the path prefix of it inside ``model``.
    """
    prefix = ""
    while True:
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model, prefix = model._orig_mod, prefix + "_orig_mod."
        elif type(model).__name__ in {
            "DistributedDataParallel",
            "DataParallel",
            "FullyShardedDataParallel",
        } and isinstance(getattr(model, "module", None), nn.Module):
            model, prefix = model.module, prefix + "module."
        elif (
            hasattr(model, "peft_config")
            and isinstance(getattr(model, "base_model", None), nn.Module)
            and isinstance(getattr(model.base_model, "model", None), nn.Module)
        ):
            model, prefix = model.base_model.model, prefix + "base_model.model."
        elif type(model).__name__ == "DeepSpeedEngine" and isinstance(
            getattr(model, "module", None), nn.Module
        ):
            model, prefix = model.module, prefix + "module."
        else:
            return model, prefix


def model_type_of(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    mt = getattr(config, "model_type", None)
    return mt if isinstance(mt, str) else None


# --------------------------------------------------------------------------------------------
# Result


@dataclass
class ModuleGroups:
    """The groups found in a model. Paths are relative to the unwrapped model (:attr:`root`)."""

    root: nn.Module
    paths: dict[str, tuple[str, ...]]
    params: dict[str, tuple[str, ...]]
    rule: str
    model_type: str | None = None
    prefix: str = ""
    _lookup: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for group, paths in self.paths.items():
            for path in paths:
                self._lookup.setdefault(path, group)
        for group, names in self.params.items():
            for name in names:
                self._lookup[name] = group

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
        resampler nested in the vision encoder (Qwen2-VL's ``model.visual.merger``) is its own."""
        name = clean_name(name)
        lookup = self._lookup
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
        }

    def __str__(self) -> str:
        lines = [f"ModuleGroups(rule={self.rule!r}, model_type={self.model_type!r})"]
        for g in self.names:
            where = list(self.paths.get(g, ())) + [f"{p} (param)" for p in self.params.get(g, ())]
            lines.append(f"  {g:<15} {', '.join(where)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Discovery


def _has(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True


def _has_param(root: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    try:
        mod = root.get_submodule(owner) if owner else root
    except AttributeError:
        return False
    return leaf in mod._parameters and mod._parameters[leaf] is not None


def _apply_rule(rule: GroupRule, root: nn.Module) -> tuple[dict, dict] | None:
    paths: dict[str, tuple[str, ...]] = {}
    for group, candidates in rule.paths.items():
        for cand in candidates:
            if _has(root, cand):
                paths[group] = (cand,)
                break
    params: dict[str, tuple[str, ...]] = {}
    for group, names in rule.params.items():
        present = tuple(n for n in names if _has_param(root, n))
        if present:
            params[group] = present
    if any(g not in paths and g not in params for g in rule.required):
        return None
    return paths, params


def _path_of(root: nn.Module, target: object) -> str | None:
    if target is root:
        return ""
    for name, mod in root.named_modules():
        if mod is target:
            return name
    return None


_FALLBACK_NAMES: dict[str, tuple[str, ...]] = {
    "vision_encoder": ("vision_tower", "visual", "vision_model", "vision_encoder", "image_tower",
                       "vpm", "vit", "vision_embed_tokens", "image_encoder"),
    "language_model": ("language_model", "text_model", "llm", "decoder", "text_decoder"),
    "lm_head": ("lm_head", "output", "embed_out"),
}
_PATTERN_GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("resampler", re.compile(r"(resampler|merger|connector|qformer|abstractor|perceiver)$")),
    ("projector", re.compile(
        r"(multi_modal_projector|mm_projector|projector|language_projection|modality_projection"
        r"|vision_proj|visual_projection|img_projection|image_projection|mlp1)$")),
)


_GETTER_NAMES = {"vision_encoder": "get_encoder(image)", "language_model": "get_decoder",
                 "lm_head": "get_output_embeddings"}


def _fallback(root: nn.Module) -> tuple[dict, dict, list[str]]:
    how: list[str] = []
    paths: dict[str, tuple[str, ...]] = {}
    getters: dict[str, Callable[[], object]] = {}
    if hasattr(root, "get_encoder"):
        getters["vision_encoder"] = lambda: root.get_encoder(modality="image")
    if hasattr(root, "get_decoder"):
        getters["language_model"] = root.get_decoder
    if hasattr(root, "get_output_embeddings"):
        getters["lm_head"] = root.get_output_embeddings
    for group, getter in getters.items():
        try:
            found = getter()
        except Exception:  # noqa: BLE001 - best effort: some models raise for missing parts
            continue
        path = _path_of(root, found) if isinstance(found, nn.Module) else None
        if path:
            paths[group] = (path,)
            how.append(f"{group}={_GETTER_NAMES[group]}")
    modules = dict(root.named_modules())
    for group, names in _FALLBACK_NAMES.items():
        hit = next((p + n for p in ("model.", "") for n in names if p + n in modules), None)
        if group not in paths and hit:
            paths[group] = (hit,)
            how.append(f"{group}=name:{hit}")
    lm = paths.get("language_model", ("\0",))[0]
    taken = {p for ps in paths.values() for p in ps}
    for group, pattern in _PATTERN_GROUPS:
        for name in modules:
            if (not name or name in taken or name.count(".") > 3 or name.startswith(lm + ".")
                    or not pattern.search(name.rsplit(".", 1)[-1])):
                continue
            paths[group] = (name,)
            taken.add(name)
            how.append(f"{group}=pattern:{name}")
            break
    return paths, {}, how


def find_module_groups(model: nn.Module, *, strict: bool = False) -> ModuleGroups:
    """Find the module groups of ``model`` (PEFT, DDP/FSDP1 and ``torch.compile`` unwrapped).

    With no recognisable group, warns and returns everything as one group ``"other"``
    (``strict=True`` raises :class:`PrecisionError` instead).
    """
    root, prefix = unwrap_model(model)
    mt = model_type_of(root)
    for rule in _RULES:
        if not rule.applies_to(root, mt):
            continue
        found = _apply_rule(rule, root)
        if found is not None:
            return ModuleGroups(root, found[0], found[1], rule.name, mt, prefix)
    paths, params, how = _fallback(root)
    if "language_model" not in paths and "vision_encoder" not in paths:
        msg = (
            f"find_module_groups({type(root).__name__}): no module groups recognised "
            f"(model_type={mt!r}); tried {len(_RULES)} rules and the get_encoder/get_decoder/"
            "name-pattern fallback.\n"
            "Fix: register_group_rule(GroupRule(name=..., paths={'vision_encoder': ('path',), "
            "'language_model': ('path',)})) for this architecture."
        )
        if strict:
            raise PrecisionError(msg)
        warnings.warn(msg + " The whole model is treated as one group.", PrecisionWarning,
                      stacklevel=2)
        return ModuleGroups(root, {}, {}, "none", mt, prefix)
    return ModuleGroups(root, paths, params, "fallback(" + ", ".join(how) + ")", mt, prefix)


# --------------------------------------------------------------------------------------------
# Built-in rules (transformers 5.23 paths; remote-code layouts matched by attribute names)


def _attrs(*names: str) -> Callable[[nn.Module], bool]:
    return lambda m: all(isinstance(getattr(m, n, None), nn.Module) for n in names)


_LM_HEAD = ("lm_head",)
for _rule in (
    GroupRule(
        "llava",
        model_types=("llava", "llava_next", "llava_onevision", "llava_next_video", "vipllava"),
        paths={"vision_encoder": ("model.vision_tower",),
               "projector": ("model.multi_modal_projector",),
               "language_model": ("model.language_model",), "lm_head": _LM_HEAD},
        params={"resampler": ("model.image_newline",)},
    ),
    GroupRule(
        "idefics2",
        model_types=("idefics2",),
        paths={"vision_encoder": ("model.vision_model",),
               "resampler": ("model.connector.perceiver_resampler",),
               "projector": ("model.connector.modality_projection",),
               "language_model": ("model.text_model",), "lm_head": _LM_HEAD},
    ),
    GroupRule(
        "idefics3",
        model_types=("idefics3", "smolvlm"),
        paths={"vision_encoder": ("model.vision_model",), "resampler": ("model.connector",),
               "projector": ("model.connector.modality_projection",),
               "language_model": ("model.text_model",), "lm_head": _LM_HEAD},
    ),
    GroupRule(
        "vision_tower_projector",
        model_types=("paligemma", "gemma3", "internvl", "aya_vision", "mistral3", "mllama",
                     "got_ocr2", "cohere2_vision", "lfm2_vl", "ovis2", "perception_lm",
                     "janus", "deepseek_vl", "deepseek_vl_hybrid", "gemma3n", "llama4",
                     "florence2", "emu3", "chameleon", "glm4v", "glm4v_moe", "shieldgemma2"),
        paths={"vision_encoder": ("model.vision_tower", "model.vision_model", "model.visual"),
               "projector": ("model.multi_modal_projector", "model.aligner",
                             "model.visual.merger"),
               "language_model": ("model.language_model", "model.text_model"),
               "lm_head": _LM_HEAD},
    ),
    GroupRule(
        "qwen2_vl",
        model_types=("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_omni_thinker"),
        paths={"vision_encoder": ("model.visual",), "resampler": ("model.visual.merger",),
               "language_model": ("model.language_model",), "lm_head": _LM_HEAD},
    ),
    GroupRule(
        "blip_2",
        model_types=("blip-2", "blip_2", "instructblip", "instructblipvideo"),
        paths={"vision_encoder": ("vision_model",), "resampler": ("qformer",),
               "projector": ("language_projection",), "language_model": ("language_model",),
               "lm_head": ("language_model.lm_head", "lm_head")},
        params={"resampler": ("query_tokens",)},
    ),
    GroupRule(
        "kosmos2",
        model_types=("kosmos-2", "kosmos2"),
        paths={"vision_encoder": ("vision_model",), "resampler": ("image_to_text_projection",),
               "projector": ("image_to_text_projection.dense",),
               "language_model": ("text_model",), "lm_head": ("text_model.lm_head",)},
        params={"resampler": ("image_to_text_projection.latent_query",)},
    ),
    GroupRule(
        "fuyu",
        model_types=("fuyu",),
        paths={"vision_encoder": ("model.vision_embed_tokens",),
               "language_model": ("model.language_model",), "lm_head": _LM_HEAD},
    ),
    GroupRule(
        "minicpmv",
        model_types=("minicpmv4_6", "minicpmv4_7", "minicpm_ocr"),
        paths={"vision_encoder": ("model.vision_tower",), "resampler": ("model.merger",),
               "language_model": ("model.language_model",), "lm_head": _LM_HEAD},
    ),
    # Remote-code layouts (trust_remote_code checkpoints), matched by attribute names.
    GroupRule(
        "minicpmv2_omnilmm",
        model_types=("minicpmv", "omnilmm"),
        match=_attrs("vpm", "resampler", "llm"),
        paths={"vision_encoder": ("vpm",), "resampler": ("resampler",), "language_model": ("llm",),
               "lm_head": ("llm.lm_head", "lm_head")},
    ),
    GroupRule(
        "internlm_xcomposer",
        model_types=("internlmxcomposer2", "internlm_xcomposer2"),
        match=_attrs("vit", "vision_proj", "model", "output"),
        paths={"vision_encoder": ("vit",), "projector": ("vision_proj",),
               "language_model": ("model",), "lm_head": ("output",)},
    ),
    GroupRule(
        "internvl_chat",
        model_types=("internvl_chat",),
        match=_attrs("vision_model", "mlp1", "language_model"),
        paths={"vision_encoder": ("vision_model",), "projector": ("mlp1",),
               "language_model": ("language_model",),
               "lm_head": ("language_model.lm_head", "language_model.output")},
    ),
):
    register_group_rule(_rule)
