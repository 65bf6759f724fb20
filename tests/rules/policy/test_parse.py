"""hf_precision.rules.policy.parse: the one policy parser and the one GradScaler refusal."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionError, PrecisionPolicy
from hf_precision.rules.policy.parse import parse_policy, refuse_fp16_trainables


def test_every_spelling_gives_the_same_policy(tmp_path) -> None:
    policy = PrecisionPolicy.from_preset("bf16", keep_fp32=("re:.*norm",))
    file = tmp_path / "policy.json"
    file.write_text(policy.to_json())
    for spec in (policy, policy.to_json(), str(file), file, policy.to_dict()):
        assert parse_policy(spec) == policy, spec
    assert parse_policy(policy) is policy  # a policy is a value: returned as is
    assert parse_policy("bf16") == PrecisionPolicy.from_preset("bf16")
    assert parse_policy(None) == PrecisionPolicy.from_preset("fp32")


def test_overrides_make_a_new_policy_and_leave_the_callers() -> None:
    given = PrecisionPolicy.from_preset("bf16")
    out = parse_policy(given, mode="raise", leaf_guards=None)
    assert out.mode == "raise" and given.mode == "fix"


def test_errors_repeat_the_users_call() -> None:
    with pytest.raises(PrecisionError, match=r"^MyTool\('bf61'\): .*'bf16'"):
        parse_policy("bf61", call="MyTool('bf61')")
    with pytest.raises(PrecisionError, match=r"^MyTool\(\): unknown mode 'rasie'"):
        parse_policy("bf16", call="MyTool()", mode="rasie")
    with pytest.raises(PrecisionError, match="not valid JSON"):
        parse_policy("{bad", call="X()")


def test_the_gradscaler_refusal() -> None:
    true16 = PrecisionPolicy.from_preset("fp16-true")
    refuse_fp16_trainables(true16, "bf16", True, call="C()", said="bf16=True", fix="f")
    refuse_fp16_trainables(true16, "fp16", False, call="C()", said="fp16=True", fix="f")
    with pytest.raises(PrecisionError, match="unscale FP16 gradients'. Nothing was cast.\nFix: f"):
        refuse_fp16_trainables(true16, "fp16", True, call="C()", said="fp16=True", fix="f")
    assert true16.trainable_dtype == torch.float16
