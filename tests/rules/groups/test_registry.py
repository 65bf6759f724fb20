"""The built-in rule table: well-formed rules, one model type to one rule, remote-code
layouts matched by their attributes, and a generated table row for every VLM rule."""

from __future__ import annotations

from collections import Counter
from importlib import resources

import pytest
import torch

from hf_precision import PrecisionError, find_module_groups
from hf_precision.rules.groups.group_rule import VLM_GROUPS
from hf_precision.rules.groups.registry import (
    RULES_FILE,
    architecture_table,
    group_rules,
    read_rules,
)
from hf_precision.tiny import (
    DeepSeekVLTiny,
    InternVLTiny,
    MiniCPMV2Tiny,
    XComposerTiny,
    XTunerLLaVATiny,
)


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
        InternVLTiny: "internvl_chat",
        DeepSeekVLTiny: "deepseek_vl_remote",  # vision_model / aligner / language_model
    }
    for build, rule in expected.items():
        model = build(torch.float32)
        model.config.model_type = "a_name_no_rule_knows"  # the attributes decide
        assert find_module_groups(model).rule == rule, build.__name__


@pytest.mark.parametrize("cls", [InternVLTiny, DeepSeekVLTiny])
def test_the_lm_head_is_found_after_the_familys_own_lora_on_the_language_model(cls) -> None:
    """InternVL's ``wrap_llm_lora`` (and DeepSeek-VL fine-tunes doing the same) make
    ``language_model`` a PeftModel: its head moves to ``language_model.base_model.model``."""
    from peft import LoraConfig, get_peft_model

    model = cls(torch.float32)
    if isinstance(model, InternVLTiny):
        model.wrap_llm_lora()
    else:
        lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        model.language_model = get_peft_model(model.language_model, lora)
    groups = find_module_groups(model)
    assert groups.paths["lm_head"] == ("language_model.base_model.model.lm_head",)
    assert groups.paths["language_model"] == ("language_model",)
    assert groups.group_of("language_model.base_model.model.lm_head.weight") == "lm_head"


def test_the_built_in_rules_are_read_from_the_packaged_toml_in_its_order() -> None:
    text = _toml()
    built_in = read_rules(text)
    registered = {r.name: r for r in group_rules()}
    assert [r.name for r in built_in] == [r.name for r in _vlm_rules()]
    for rule in built_in:
        same = registered[rule.name]
        assert (rule.model_types, rule.paths, rule.extra, rule.params, rule.note) == (
            same.model_types,
            same.paths,
            same.extra,
            same.params,
            same.note,
        )
    llava = registered["llava"]
    assert llava.paths["vision_encoder"] == ("model.vision_tower",)
    assert llava.paths["lm_head"] == ("lm_head",)  # the default
    assert llava.params == {"resampler": ("model.image_newline",)}
    assert registered["blip_2"].paths["lm_head"] == ("language_model.lm_head", "lm_head")


def test_read_rules_builds_attribute_matches_and_defaults() -> None:
    (rule,) = read_rules(
        '[[rule]]\nname = "two_part"\nattrs = ["encoder", "decoder"]\n'
        'paths.vision_encoder = "encoder"\npaths.language_model = "decoder"\n'
        'extra.vision_encoder = ["a", "b"]\n'
    )
    assert rule.model_types == () and rule.note == ""
    assert rule.extra == {"vision_encoder": ("a", "b")}
    assert rule.match is not None
    both = torch.nn.Module()
    both.encoder, both.decoder = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    one = torch.nn.Module()
    one.encoder = torch.nn.Linear(2, 2)
    assert rule.match(both) and not rule.match(one)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[[rule]]\nname = "x"\npath.vision_encoder = "v"\n', "unknown key(s) ['path']"),
        ('[[rule]]\nmodel_types = "x"\n', "or no name"),
        ('[[rule]]\nname = "x"\npaths.vision_encoder = [1]\n', "must be module paths"),
        ('[rules]\nname = "x"\n', "expected only [[rule]] tables, found ['rules']"),
        ('[[rule]]\nname = "x"\npaths = "model"\n', "paths must be a table of group = path(s)"),
        ('[[rule]]\nname = "x"\nmodel_types = [1]\n', "model_types must be a string or a list"),
        ("[[rule]\n", "not valid TOML"),
    ],
)
def test_read_rules_names_the_file_the_rule_and_the_fix(text: str, says: str) -> None:
    with pytest.raises(PrecisionError) as err:
        read_rules(text, "mine.toml")
    assert says in str(err.value) and "mine.toml" in str(err.value)


def test_read_rules_reads_a_former_group_name() -> None:
    from hf_precision.rules.groups.registry import register_group_rule

    (rule,) = read_rules(
        '[[rule]]\nname = "x"\npaths.projector = "p"\npaths.language_model = "l"\n'
        'renamed.resampler = "projector"\n'
    )
    assert rule.renamed == {"resampler": "projector"}
    qwen = next(r for r in group_rules() if r.name == "qwen2_vl")
    assert qwen.renamed == {"resampler": "projector"}
    (bad,) = read_rules(
        '[[rule]]\nname = "y"\npaths.language_model = "l"\nrenamed.resampler = "projektor"\n'
    )
    with pytest.raises(PrecisionError, match=r"unknown group\(s\) \['projektor'\]"):
        register_group_rule(bad)
    with pytest.raises(PrecisionError, match="renamed must be a table"):
        read_rules('[[rule]]\nname = "z"\nrenamed = "projector"\n')


def test_the_built_in_rules_load_on_first_use_whatever_came_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No import fills the registry: the first question does, and a rule registered first
    (``first=True``) before anyone asked still goes ahead of the built-in ones."""
    from hf_precision.rules.groups import registry as registry
    from hf_precision.rules.groups.group_rule import GroupRule
    from hf_precision.rules.groups.registry import register_group_rule
    from hf_precision.tiny import tiny_llava

    monkeypatch.setattr(registry, "_RULES", [])
    monkeypatch.setattr(registry, "_loaded", False)  # as in a process that asked nothing yet
    mine = GroupRule(
        "my_llava", model_types=("llava",), paths={"language_model": "model.language_model"}
    )
    register_group_rule(mine, first=True)
    rules = group_rules()
    assert rules[0] is mine and rules[1].name == "llava"
    assert [r.name for r in rules[1:]] == [r.name for r in read_rules(_toml(), RULES_FILE)]
    assert find_module_groups(tiny_llava()).rule == "my_llava"


def _toml() -> str:
    package = "hf_precision.rules.groups"
    return resources.files(package).joinpath(RULES_FILE).read_text(encoding="utf-8")
