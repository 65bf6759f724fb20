"""Group names and the GroupRule value: forward order, registered names, normalised paths."""

from __future__ import annotations

import pytest

from hf_precision import PrecisionError
from hf_precision.rules.groups.group_rule import VLM_GROUPS, GroupRule, group_names


def test_the_built_in_group_names_are_in_forward_order() -> None:
    names = group_names()
    assert names[:6] == (*VLM_GROUPS[:3], "audio_encoder", *VLM_GROUPS[3:])


def test_a_rule_takes_a_bare_string_as_one_path_and_the_model_itself_only_in_paths() -> None:
    rule = GroupRule("my_vlm", paths={"language_model": "decoder", "vision_encoder": ""})
    assert rule.paths == {"language_model": ("decoder",), "vision_encoder": ("",)}
    with pytest.raises(PrecisionError, match=r"extra\['vision_encoder'\]=''"):
        GroupRule("my_vlm", paths={"language_model": "decoder"}, extra={"vision_encoder": ""})
