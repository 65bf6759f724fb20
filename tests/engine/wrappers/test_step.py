"""The wrapper and apply steps (``hf_precision.engine.wrappers.step``): a holding wrapper is
explained, never cast; under DDP only a return to the wrap-time dtypes is cast."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionError, PrecisionPolicy
from hf_precision.base.wrapper_kinds import HOLDING_WRAPPERS
from hf_precision.engine.enforce import apply_plan
from hf_precision.engine.guard import PrecisionGuard
from hf_precision.engine.plan import plan_policy
from hf_precision.engine.speaker import Speaker
from hf_precision.engine.wrappers.step import WrapperStep
from hf_precision.model.view import ModelView
from hf_precision.tiny import tiny_llava


def _drifted() -> tuple[PrecisionGuard, ModelView]:
    model = tiny_llava(torch.bfloat16)
    guard = PrecisionGuard(model, PrecisionPolicy.from_preset("bf16-true"), claim=False)
    guard.verify("setup")
    model.model.multi_modal_projector.float()  # drift after setup
    return guard, ModelView.of(model)


def test_a_plain_model_gets_the_audits_own_plan_applied() -> None:
    guard, view = _drifted()
    plan = plan_policy(view, guard.policy)
    audit = apply_plan(plan, "audit")
    step = WrapperStep("PrecisionGuard", Speaker())
    report, found = step.run(plan, audit, None, guard, False, None, "x.check")
    assert found == len(audit.changes) == 4 and report.applied
    assert {p.dtype for p in view.root.parameters()} == {torch.bfloat16}


def test_under_ddp_only_a_return_to_the_wrap_time_dtypes_is_cast() -> None:
    guard, view = _drifted()
    step = WrapperStep("PrecisionGuard", Speaker())
    step.wrap_dtypes = {id(p): torch.float32 for p in view.parameters()}  # DDP wrapped fp32
    plan = plan_policy(view, guard.policy)
    audit = apply_plan(plan, "audit")
    with pytest.raises(PrecisionError, match="DDP"):
        step.run(plan, audit, "DDP", guard, False, None, "x.check")
    assert view.root.model.multi_modal_projector.linear_1.weight.dtype == torch.float32


def test_holding_wrappers_are_read_from_the_wrapper_table() -> None:
    assert set(HOLDING_WRAPPERS) == {"FSDP", "FSDP2", "DeepSpeed"}
    assert "DDP" not in HOLDING_WRAPPERS  # DDP replicates: the guard casts (a return only)
