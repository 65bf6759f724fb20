"""Group discovery on every image-text-to-text architecture transformers lists, at full size.

Each model is built from its default config on the meta device (no memory, ~20 s for all of
them, built once per module). Architectures whose default config does not build are skipped
with the build error as the reason; a few get a one-line documented config repair first.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as MAPPING,
)

from hf_precision.rules.groups.group_rule import OTHER
from hf_precision.rules.groups.module_groups import ModuleGroups, find_module_groups
from hf_precision.rules.groups.registry import group_rules
from hf_precision.tools.checkpoint import CONFIG_REPAIRS, fill_subconfigs

pytestmark = pytest.mark.xdist_group("all_architectures")  # one worker builds them once

ARCHITECTURES = sorted(MAPPING)
Paths = dict[str, tuple[str, ...]]

# Default configs that do not build, and the smallest repair that makes them build: the same
# table `hf-precision audit <model_type>` uses. Each is tried only after the default failed.
REPAIRS: dict[str, Callable[[Any], None]] = CONFIG_REPAIRS
_VISUAL = re.compile(r"vision|visual|image|pixel|patch|vq", re.I)


class Built:
    """What building the architectures gave: models, skip reasons, notes on repairs/fills."""

    def __init__(self) -> None:
        self.models: dict[str, nn.Module] = {}
        self.skipped: dict[str, str] = {}
        self.notes: dict[str, str] = {}
        self.groups: dict[str, ModuleGroups] = {}


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _from_config(config: Any) -> nn.Module:
    from transformers import AutoModelForImageTextToText
    from transformers.initialization import no_init_weights

    # Meta tensors hold no values: skipping the init functions halves the build time.
    with torch.device("meta"), no_init_weights():
        model: nn.Module = AutoModelForImageTextToText.from_config(config)
    return model


_fill_vision = fill_subconfigs


@pytest.fixture(scope="module")
def built() -> Built:
    from transformers import AutoConfig
    from transformers.utils import logging

    logging.set_verbosity_error()
    out = Built()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for arch in ARCHITECTURES:
            config = AutoConfig.for_model(arch)
            filled = _fill_vision(config)
            try:
                out.models[arch] = _from_config(config)
                if filled:
                    out.notes[arch] = "vision/audio sub-configs filled with their defaults"
                continue
            except Exception as exc:  # the reason is the report
                reason = _error(exc)
            repair = REPAIRS.get(arch)
            if repair is None:
                out.skipped[arch] = f"default config does not build: {reason}"
                continue
            try:
                config = AutoConfig.for_model(arch)
                repair(config)
                out.models[arch] = _from_config(config)
                out.notes[arch] = f"repaired config (default failed with {reason})"
            except Exception as exc:
                out.skipped[arch] = f"{reason}; repair failed: {_error(exc)}"
        for arch, model in out.models.items():
            out.groups[arch] = find_module_groups(model)
    return out


def _text_only(model: nn.Module) -> bool:
    return not any(
        _VISUAL.search(name) or _VISUAL.search(type(mod).__name__)
        for name, mod in model.named_modules()
    )


def test_most_architectures_build_and_every_skip_has_a_reason(built: Built) -> None:
    assert len(ARCHITECTURES) > 50
    assert len(built.models) >= 0.85 * len(ARCHITECTURES), built.skipped
    assert set(built.models) | set(built.skipped) == set(ARCHITECTURES)
    for arch, reason in built.skipped.items():
        assert re.search(r"\w+(Error|Exception): ", reason), (arch, reason)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_groups_of_architecture(built: Built, arch: str) -> None:
    if arch in built.skipped:
        pytest.skip(built.skipped[arch])
    model, groups = built.models[arch], built.groups[arch]
    assert groups.rule, "the rule that matched is always reported"
    registered = dict(model.named_modules())
    for group, paths in groups.paths.items():
        for path in paths:
            assert path in registered, (group, path)
            assert groups.group_of(path) == group  # nested groups resolve by longest prefix
    for group, names in groups.params.items():
        for name in names:
            assert groups.group_of(name) == group
            assert isinstance(model.get_parameter(name), nn.Parameter)
    assert "language_model" in groups and "lm_head" in groups, groups
    if _text_only(model):  # e.g. a ForCausalLM class listed in the mapping
        assert groups.rule.startswith("fallback("), groups.rule
        assert "vision_encoder" not in groups
    else:
        assert "vision_encoder" in groups, groups
        assert groups.rule in {r.name for r in group_rules()}, groups.rule
    others = [n for n, _ in model.named_parameters() if groups.group_of(n) == OTHER]
    assert not others, others[:5]


# docs/api.md's group table, at full size (transformers 5.24 paths).
_VT: Paths = {
    "vision_encoder": ("model.vision_tower",),
    "projector": ("model.multi_modal_projector",),
    "language_model": ("model.language_model",),
    "lm_head": ("lm_head",),
}
_IDEFICS3: Paths = {
    "vision_encoder": ("model.vision_model",),
    "resampler": ("model.connector",),
    "projector": ("model.connector.modality_projection",),
    "language_model": ("model.text_model",),
    "lm_head": ("lm_head",),
}
_QWEN: Paths = {
    "vision_encoder": ("model.visual",),
    "projector": ("model.visual.merger",),
    "language_model": ("model.language_model",),
    "lm_head": ("lm_head",),
}
_BLIP2: Paths = {
    "vision_encoder": ("vision_model",),
    "resampler": ("qformer",),
    "projector": ("language_projection",),
    "language_model": ("language_model",),
    "lm_head": ("language_model.lm_head",),
}
_MINICPM: Paths = {
    "vision_encoder": ("model.vision_tower",),
    "resampler": ("model.merger",),
    "language_model": ("model.language_model",),
    "lm_head": ("lm_head",),
}
_NEWLINE: Paths = {"resampler": ("model.image_newline",)}
DESIGN_TABLE: dict[str, tuple[str, Paths, Paths]] = {
    "llava": ("llava", _VT, {}),
    "llava_next": ("llava", _VT, _NEWLINE),
    "llava_onevision": ("llava", _VT, _NEWLINE),
    "idefics2": (
        "idefics2",
        {
            "vision_encoder": ("model.vision_model",),
            "resampler": ("model.connector.perceiver_resampler",),
            "projector": ("model.connector.modality_projection",),
            "language_model": ("model.text_model",),
            "lm_head": ("lm_head",),
        },
        {},
    ),
    "idefics3": ("idefics3", _IDEFICS3, {}),
    "smolvlm": ("idefics3", _IDEFICS3, {}),
    **{
        t: ("vision_tower_projector", _VT, {})
        for t in ("paligemma", "gemma3", "internvl", "aya_vision", "mistral3")
    },
    "qwen2_vl": ("qwen2_vl", _QWEN, {}),
    "qwen2_5_vl": ("qwen2_vl", _QWEN, {}),
    "qwen3_vl": (
        "qwen2_vl",
        {**_QWEN, "projector": ("model.visual.merger", "model.visual.deepstack_merger_list")},
        {},
    ),
    "blip-2": ("blip_2", _BLIP2, {"resampler": ("query_tokens",)}),
    "instructblip": ("blip_2", _BLIP2, {"resampler": ("query_tokens",)}),
    "mllama": ("vision_tower_projector", {**_VT, "vision_encoder": ("model.vision_model",)}, {}),
    "kosmos-2": (
        "kosmos2",
        {
            "vision_encoder": ("vision_model",),
            "resampler": ("image_to_text_projection",),
            "projector": ("image_to_text_projection.dense",),
            "language_model": ("text_model",),
            "lm_head": ("text_model.lm_head",),
        },
        {"resampler": ("image_to_text_projection.latent_query",)},
    ),
    "fuyu": (
        "fuyu",
        {
            "vision_encoder": ("model.vision_embed_tokens",),
            "language_model": ("model.language_model",),
            "lm_head": ("lm_head",),
        },
        {},
    ),
    "minicpmv4_6": ("minicpmv", _MINICPM, {}),
    "minicpmv4_7": ("minicpmv", _MINICPM, {}),
    "minicpm_ocr": ("minicpmv", _MINICPM, {}),
}


@pytest.mark.parametrize("arch", sorted(DESIGN_TABLE))
def test_design_table_paths(built: Built, arch: str) -> None:
    if arch not in MAPPING or arch in built.skipped:
        pytest.skip(built.skipped.get(arch, f"{arch} not in this transformers"))
    rule, paths, params = DESIGN_TABLE[arch]
    groups = built.groups[arch]
    assert (groups.rule, groups.paths, groups.params) == (rule, paths, params)


def test_minicpmv_vit_merger_stays_in_the_vision_tower(built: Built) -> None:
    if "minicpmv4_6" not in built.models:
        pytest.skip(built.skipped.get("minicpmv4_6", "minicpmv4_6 not in this transformers"))
    g = built.groups["minicpmv4_6"]
    assert g.group_of("model.vision_tower.vit_merger") == "vision_encoder"
    assert g.group_of("model.merger.mlp.0") == "resampler"


def test_omni_models_get_an_audio_encoder(built: Built) -> None:
    omni = {
        a: g
        for a, g in built.groups.items()
        if any("audio" in n for n, _ in built.models[a].named_children())
        or any(n.startswith("model.audio") for n, _ in built.models[a].named_modules())
    }
    assert omni, "no omni architecture built"
    for arch, g in omni.items():
        assert "audio_encoder" in g, (arch, g)


def test_filled_and_repaired_configs_are_reported(built: Built) -> None:
    for arch, note in built.notes.items():
        assert note.startswith(
            ("vision/audio sub-configs filled", "repaired config (default failed with ")
        ), (arch, note)
    if "gemma4" in built.models:  # default config: text only; filled: both towers found
        assert "filled" in built.notes["gemma4"]
        g = built.groups["gemma4"]
        assert g.paths["vision_encoder"] == ("model.vision_tower",)
        assert g.paths["audio_encoder"] == ("model.audio_tower", "model.embed_audio")
        assert g.paths["projector"] == ("model.embed_vision",)
