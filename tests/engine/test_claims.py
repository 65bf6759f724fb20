"""hf_precision.engine.claims: one guard per model."""

from __future__ import annotations

import gc

import pytest
from torch import nn

from hf_precision import PrecisionError, PrecisionPolicy
from hf_precision.engine.claims import claim_model, claimed_by, release_model


class Owner:
    pass


def test_a_second_guard_with_another_policy_is_refused() -> None:
    root, first, second = nn.Linear(2, 2), Owner(), Owner()
    bf16, fp16 = PrecisionPolicy.from_preset("bf16"), PrecisionPolicy.from_preset("fp16")
    claim_model(root, first, bf16, "First()")
    assert claimed_by(root) is first
    claim_model(root, second, bf16, "Second()")  # the same policy: allowed, the last holds it
    assert claimed_by(root) is second
    with pytest.raises(PrecisionError, match=r"^Third\(\): Linear is already guarded by Second"):
        claim_model(root, Owner(), fp16, "Third()")
    release_model(root, first)  # not the holder: nothing released
    assert claimed_by(root) is second
    release_model(root, second)
    assert claimed_by(root) is None


def test_the_claim_is_weak() -> None:
    root, owner = nn.Linear(2, 2), Owner()
    claim_model(root, owner, PrecisionPolicy.from_preset("bf16"), "G()")
    del owner
    gc.collect()
    assert claimed_by(root) is None
