"""What a diagnosis found, said in words: the root-cause class of a mismatch, the majority
weights of a module, the fix per class, the mismatches a pass hid."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionPolicy, find_module_groups
from hf_precision.tiny import tiny_llava
from hf_precision.watch.diagnosis import (
    CLASS_NAMES,
    Diagnosis,
    Mismatch,
    classify,
    fix_text,
    module_weights,
)

PROJ = "model.multi_modal_projector"


def _mismatch(**kw: object) -> Mismatch:
    base: dict[str, object] = dict(
        module=f"{PROJ}.linear_1",
        module_type="Linear",
        group="projector",
        input="input",
        input_dtype="float16",
        input_device="cpu",
        weight_dtype="float32",
        weight_device="cpu",
        producer="output",
        producer_module="model.vision_tower",
        producer_group="vision_encoder",
        producer_dtype="float16",
    )
    base.update(kw)
    return Mismatch(**base)  # type: ignore[arg-type]


def test_module_weights_prefer_frozen_majority_and_own_parameters() -> None:
    model = tiny_llava()
    proj = model.model.multi_modal_projector
    proj.linear_1.to(torch.bfloat16).requires_grad_(False)
    assert module_weights(proj.linear_1, own=True) == (torch.bfloat16, torch.device("cpu"))
    # the whole projector: its frozen weights (linear_1) decide, not the trainable majority
    assert module_weights(proj, own=False)[0] == torch.bfloat16
    assert module_weights(proj, own=True) == (None, None)  # no parameters of its own


@pytest.mark.parametrize(
    ("kw", "cls"),
    [
        ({"producer": "batch[pixel_values]", "producer_module": None}, "A"),
        ({}, "B"),  # the output of another group
        ({"producer": "a tensor made in forward", "producer_module": None}, "F"),
        ({"kind": "device", "input_device": "meta"}, "G"),
    ],
)
def test_classify_by_where_the_input_came_from(kw: dict[str, object], cls: str) -> None:
    model = tiny_llava()
    groups = find_module_groups(model)
    assert classify(model, groups, _mismatch(**kw)) == cls
    assert cls in CLASS_NAMES


def test_an_fp32_leaf_inside_a_half_group_is_class_c() -> None:
    model = tiny_llava(torch.bfloat16)
    norm = "model.vision_tower.post_layernorm"
    model.get_submodule(norm).float()  # an fp32 norm leaks fp32 activations
    m = _mismatch(producer_module=norm, producer_dtype="float32", group="vision_encoder")
    assert classify(model, find_module_groups(model), m) == "C"


def test_each_class_gets_its_own_fix_naming_the_policy() -> None:
    policy = PrecisionPolicy.from_preset("bf16")
    fixes = {
        "A": fix_text("A", _mismatch(producer="batch[pixel_values]"), policy),
        "B": fix_text("B", _mismatch(), policy),
        "C": fix_text("C", _mismatch(), policy),
        "G": fix_text("G", _mismatch(kind="device"), policy),
    }
    assert "PrecisionCollator(collator, policy='bf16')" in fixes["A"]
    assert "batch[pixel_values].to(torch.float32)" in fixes["A"]
    assert "enforce_policy(model, 'bf16') casts vision_encoder to bfloat16" in fixes["B"]
    assert "leaf_guards='on'" in fixes["C"]
    assert "move_devices=True" in fixes["G"]
    assert len(set(fixes.values())) == 4
    assert "boundary guard casts the input" in fix_text("B", _mismatch(), policy, intended=True)


def test_silent_mismatches_are_those_off_the_failing_stack() -> None:
    failing = _mismatch()
    hidden = _mismatch(module="model.language_model.layers.0.mlp.up_proj", autocast=True)
    diag = Diagnosis(
        model="LlavaForConditionalGeneration",
        mismatches=[failing, hidden],
        error="RuntimeError: mat1 and mat2 must have the same dtype",
        phase="forward",
        culprit=failing,
        failing_stack=[PROJ, f"{PROJ}.linear_1"],
        root_cause="B",
    )
    assert not diag.ok
    assert diag.silent == [hidden]
    data = diag.to_dict()
    assert data["root_cause_name"] == CLASS_NAMES["B"]
    assert data["culprit"]["module"] == f"{PROJ}.linear_1" and len(data["mismatches"]) == 2
