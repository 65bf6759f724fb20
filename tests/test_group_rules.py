"""The built-in rule table: well-formed rules, one model type to one rule, remote-code
layouts matched by their attributes, and a generated table row for every VLM rule."""

from __future__ import annotations

from collections import Counter

import torch

from hf_precision import find_module_groups
from hf_precision.groups import VLM_GROUPS, architecture_table, group_rules
from hf_precision.tiny import MiniCPMV2Tiny, XComposerTiny, XTunerLLaVATiny


def _vlm_rules() -> list:
    return [r for r in group_rules() if set(r.paths) <= {*VLM_GROUPS, "audio_encoder"}]


def test_every_rule_is_named_once_and_finds_a_language_model() -> None:
    rules = group_rules()
    names = [r.name for r in rules]
    assert len(names) == len(set(names))
    for rule in _vlm_rules():
        assert "language_model" in rule.paths, rule.name
        assert rule.model_types or rule.match is not None, rule.name


def test_a_model_type_belongs_to_one_rule() -> None:
    counts = Counter(t for r in _vlm_rules() for t in r.model_types)
    assert [t for t, n in counts.items() if n > 1] == []


def test_the_generated_table_has_a_row_per_vlm_rule_and_says_what_covers_remote_code() -> None:
    table = architecture_table()
    rows = {line.split(" | ")[0].removeprefix("| ") for line in table.splitlines()[2:]}
    assert {r.name for r in _vlm_rules()} | {"*fallback*"} == rows
    remote = next(line for line in table.splitlines() if line.startswith("| xtuner_llava |"))
    assert "XTuner's LLaVAModel" in remote and "`visual_encoder`" in remote


def test_remote_code_layouts_are_matched_by_their_attributes() -> None:
    expected = {
        MiniCPMV2Tiny: "minicpmv2_omnilmm",  # vpm / resampler / llm
        XComposerTiny: "internlm_xcomposer",
        XTunerLLaVATiny: "xtuner_llava",
    }
    for build, rule in expected.items():
        model = build(torch.float32)
        model.config.model_type = "a_name_no_rule_knows"  # the attributes decide
        assert find_module_groups(model).rule == rule, build.__name__
