"""The fallback when no rule fits: transformers' accessors first, then names; and whether a
model without groups looks multimodal."""

from __future__ import annotations

from torch import nn

from hf_precision.rules.groups.fallback import fallback_groups, looks_multimodal
from hf_precision.tiny import tiny_text_llama


def test_a_text_model_is_found_by_its_getters() -> None:
    paths, params, how = fallback_groups(tiny_text_llama())
    assert paths == {"language_model": ("model",), "lm_head": ("lm_head",)}
    assert params == {}
    assert how == ["language_model=get_decoder", "lm_head=get_output_embeddings"]


def test_names_and_patterns_say_what_matched() -> None:
    model = nn.Module()
    model.vision_tower = nn.Linear(2, 2)
    model.mm_projector = nn.Linear(2, 2)
    model.llm = nn.Linear(2, 2)
    paths, _, how = fallback_groups(model)
    assert paths["vision_encoder"] == ("vision_tower",)
    assert paths["projector"] == ("mm_projector",)
    assert "projector=pattern:mm_projector" in how


def test_only_a_model_that_looks_multimodal_says_why() -> None:
    assert looks_multimodal(nn.Sequential(nn.Linear(2, 2))) == ""
    model = nn.Module()
    model.patch_embed = nn.Linear(2, 2)
    assert looks_multimodal(model) == "module patch_embed (Linear)"
