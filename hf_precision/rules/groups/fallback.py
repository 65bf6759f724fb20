"""When no group rule fits: find the groups by what transformers' accessors return
(``get_encoder(modality=...)``, ``get_decoder()``, ``get_output_embeddings()``), tower names and
name patterns, saying which of them matched; and whether a model with no group looks multimodal
(then :func:`~hf_precision.rules.groups.module_groups.find_module_groups` warns with the fix).

>>> from hf_precision.tiny import tiny_text_llama
>>> paths, params, how = fallback_groups(tiny_text_llama())
>>> paths["language_model"], how[0]
(('model',), 'language_model=get_decoder')
"""

from __future__ import annotations

import inspect
import re
from collections import deque
from typing import Any

from torch import nn

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


def _shallow_modules(root: nn.Module) -> tuple[dict[str, nn.Module], dict[int, str]]:
    """path -> module and id(module) -> path for the top 4 levels, breadth first (a module
    reached twice keeps its first path). One shallow walk serves every lookup of the fallback:
    groups sit near the top, and a 7B model's ~1k leaf modules need not be visited."""
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
    return modules, path_of


def fallback_groups(
    root: nn.Module,
) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]], list[str]]:
    """The groups of a model no rule fits: ``(paths, params, how)``, ``how`` saying what
    matched each group (a getter, a name, a pattern)."""
    modules, path_of = _shallow_modules(root)
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


def looks_multimodal(root: nn.Module) -> str:
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
