"""The plan's records (``hf_precision/engine/records.py``): the plan is a value (frozen, its report
new at each call), and every old import path gives the same classes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_precision import PrecisionPolicy
from hf_precision.engine import plan
from hf_precision.model.view import ModelView
from hf_precision.tiny import tiny_llava


def test_a_plan_is_frozen_and_each_report_is_new() -> None:
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)
    planned = plan.plan_policy(ModelView.of(model), PrecisionPolicy.from_preset("bf16-true"))
    assert isinstance(planned.changes, tuple) and planned.changes and planned
    with pytest.raises(dataclasses.FrozenInstanceError):
        planned.warnings = ()  # type: ignore[misc]
    first, second = planned.report(), planned.report()
    assert first is not second and first.changes == second.changes == list(planned.changes)
    first.warnings.append("said")
    assert "said" not in planned.warnings and "said" not in second.warnings
    assert first.groups is planned.groups and not first.applied
