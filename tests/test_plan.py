"""The plan: pure (nothing in the model changes), complete (every change has its record), and
what apply_plan carries out without planning again."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionPolicy
from hf_precision.enforce import apply_plan
from hf_precision.plan import plan_policy
from hf_precision.tiny import tiny_llava
from hf_precision.view import ModelView


def _state(model: torch.nn.Module) -> list[tuple[int, torch.dtype, int, torch.device]]:
    tensors = [*model.parameters(), *model.buffers()]
    return [(id(t), t.dtype, t.data_ptr(), t.device) for t in tensors]


def test_planning_changes_nothing_and_records_every_change() -> None:
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)
    before = _state(model)
    report = plan_policy(model, PrecisionPolicy.from_preset("bf16-true"), ModelView.of(model))
    assert _state(model) == before
    assert not report.applied and report.changes
    assert [p.change for p in report.planned] == report.changes
    params = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    for cast in report.planned:
        assert id(cast.tensor) in params
        assert cast.module._parameters.get(cast.key, cast.module._buffers.get(cast.key)) is (
            cast.tensor
        )
        assert cast.dtype == torch.bfloat16 and cast.change.after == "bfloat16"


def test_apply_carries_out_the_plan_it_is_given() -> None:
    model = tiny_llava()
    model.model.multi_modal_projector.to(torch.float16)
    policy = PrecisionPolicy.from_preset("fp32")
    report = plan_policy(model, policy, ModelView.of(model))
    planned = {id(p.tensor) for p in report.planned}
    assert planned == {id(p) for p in model.model.multi_modal_projector.parameters()}
    ids = [id(p) for p in model.parameters()]
    assert apply_plan(model, report) is report and report.applied
    assert [id(p) for p in model.parameters()] == ids  # the same Parameter objects
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert apply_plan(model, report).applied  # applied once: a second call casts nothing


def test_an_fp16_overflow_is_planned_as_kept_not_cast() -> None:
    model = tiny_llava()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = 1e6  # beyond fp16's 65504
    policy = PrecisionPolicy.from_preset("fp16-true")
    with pytest.warns(UserWarning, match="exceeds the float16 range"):
        report = apply_plan(model, plan_policy(model, policy, ModelView.of(model)))
    assert report.overflow == [("lm_head.weight", 1e6)]
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.isfinite(model.lm_head.weight).all()
    assert model.model.language_model.embed_tokens.weight.dtype == torch.float16


def test_a_renamed_group_says_its_name_now() -> None:
    from hf_precision.tiny import tiny_qwen2_vl

    model = tiny_qwen2_vl()
    policy = PrecisionPolicy.from_preset("fp32", group_dtypes={"resampler": "bf16"})
    report = plan_policy(model, policy, ModelView.of(model))
    (said,) = [w for w in report.warnings if "group_dtypes['resampler']" in w]
    assert "Fix: name 'projector': rule 'qwen2_vl' calls that group 'projector' now." in said
