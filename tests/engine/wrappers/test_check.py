"""The wrapper check reads the plan and the wrapper's record: a registered kind no library has
(``HalfKeeper``, holding every weight in its config's dtype like DeepSpeed) is classified,
explained and left uncast by the guard with no line of the engine naming it. The real wrappers
(FSDP2, FSDP1, DDP on gloo, DeepSpeed on CPU) run in tests/engine/wrappers/test_ranks.py and the
torchrun scenarios."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from hf_precision import PrecisionPolicy, PrecisionWarning
from hf_precision.base.wrapper_kinds import WRAPPERS, WrapperKind, register_wrapper
from hf_precision.engine.guard import PrecisionGuard
from hf_precision.engine.plan import plan_policy
from hf_precision.engine.wrappers import check as wrapped_module
from hf_precision.engine.wrappers.check import check_wrapped, classify, explain_wrapped
from hf_precision.model.view import ModelView
from hf_precision.tiny import tiny_llava


class HalfKeeper(nn.Module):
    """A stand-in for a wrapper kind that exists nowhere (it tests the table's wiring only)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.held = model


FIX = "Fix: set HalfKeeper(keep=...) for these parameters"


@pytest.fixture
def keeper() -> Iterator[WrapperKind]:
    saved = dict(WRAPPERS)
    yield register_wrapper(
        WrapperKind(
            "HalfKeeper",
            classes=("HalfKeeper",),
            inner="held",
            owns_params=True,
            holds_config_dtype=True,
            cast_fix=FIX,
        )
    )
    WRAPPERS.clear()
    WRAPPERS.update(saved)


def _wrapped() -> tuple[nn.Module, HalfKeeper, PrecisionPolicy]:
    model = tiny_llava().to(torch.bfloat16)  # the kind holds every weight in bf16
    return model, HalfKeeper(model), PrecisionPolicy.from_preset("bf16", keep_fp32=("lm_head",))


def test_a_registered_kind_is_classified_from_the_plan(keeper) -> None:
    model, wrapper, policy = _wrapped()
    plan = plan_policy(ModelView.of(wrapper), policy)
    assert len(plan.decided) == len(list(model.parameters()))
    check = classify(plan, "HalfKeeper", deepspeed_dtype=torch.bfloat16)
    assert check.wrapper == "HalfKeeper" and not check.violations and not check.notes
    # the trainable weights the policy wants in fp32: held in bf16 on purpose (master weights)
    assert check.expected == {
        "held in bfloat16 by HalfKeeper (fp32 master weights: optimizer)": len(plan.decided) - 1
    }
    assert check.casts == [
        ("lm_head.weight", "lm_head", torch.bfloat16, torch.float32, "keep_fp32 'lm_head'")
    ]
    assert check.cast_message("where").endswith(
        f"{FIX}; mode='raise' stops here instead of warning."
    )
    # the public shell detects the kind from the table and plans itself: the same answer
    assert check_wrapped(wrapper, policy, deepspeed_dtype=torch.bfloat16) == check
    audit = plan.report()
    kept = explain_wrapped(wrapper, policy, audit.groups, audit, where="w")
    assert kept.changes == [] and [c.name for c in kept.wrapper_casts] == ["lm_head.weight"]


def test_the_guard_explains_a_registered_kind_from_its_one_plan(keeper, monkeypatch) -> None:
    model, wrapper, policy = _wrapped()

    def second_plan(*args, **kwargs):
        raise AssertionError("the wrapper check planned again")

    monkeypatch.setattr(wrapped_module, "plan_policy", second_plan)
    guard = PrecisionGuard(model, policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = guard.verify("setup", model=wrapper, wrapper="auto")
    assert model.lm_head.weight.dtype == torch.bfloat16  # owned by the wrapper: never cast
    assert not report.applied and report.changes == []
    assert [c.name for c in report.wrapper_casts] == ["lm_head.weight"]
    assert FIX in (report.wrapper_note or "")
    assert any(FIX in str(w.message) for w in caught if w.category is PrecisionWarning)
    guard.teardown()


def test_an_unregistered_kind_would_have_been_cast(keeper) -> None:
    WRAPPERS.pop("HalfKeeper")
    model, wrapper, policy = _wrapped()
    guard = PrecisionGuard(wrapper, policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard.verify("setup", wrapper="auto")
    assert model.lm_head.weight.dtype == torch.float32  # nobody owns it: the guard casts
    guard.teardown()
