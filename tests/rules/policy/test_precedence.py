"""hf_precision.rules.policy.precedence: the dtype a policy wants for one tensor and the rule that
decided; ``PrecisionPolicy`` decides through it."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionPolicy
from hf_precision.rules.policy import precedence
from hf_precision.rules.policy.precedence import decide, keep_fp32_reason, match_pattern


def test_the_policy_decides_through_precedence() -> None:
    assert PrecisionPolicy.decide is decide
    assert PrecisionPolicy.keep_fp32_reason is keep_fp32_reason


def test_match_pattern_precedence():
    assert match_pattern("model.vision_tower", "model.vision_tower.encoder.weight")
    assert not match_pattern("model.vision", "model.vision_tower.encoder.weight")
    assert match_pattern("wo", "a.wo.weight")
    assert not match_pattern("norm", "x.post_norm.weight")
    # re: is a full match of the name or of a module path holding it (PEFT's convention)
    assert match_pattern("re:.*norm\\.weight", "x.post_norm.weight")
    assert match_pattern("re:.*post_norm", "x.post_norm.weight")  # the module's tensors
    assert not match_pattern("re:norm", "layernorm_proj.weight")  # no substring search
    assert not match_pattern("re:x", "x_proj.weight") and match_pattern("re:x", "x.weight")


def test_rotary_tables_of_every_name_stay_fp32() -> None:
    bf16 = PrecisionPolicy.from_preset("bf16")
    for name in (
        "model.language_model.rotary_emb.inv_freq",
        "model.language_model.rotary_emb.original_inv_freq",
        "model.language_model.rotary_emb.sliding_attention_inv_freq",
        "model.language_model.rotary_emb.sliding_attention_original_inv_freq",
        "model.language_model.rotary_emb.full_attention_inv_freq",
    ):
        d = bf16.decide(name, "language_model", trainable=False, is_buffer=True)
        assert (d.dtype, d.rule) == (torch.float32, "rotary"), name
    d = bf16.decide(
        "model.rotary.cos_cached", "language_model", trainable=False, is_buffer=True, role="rotary"
    )
    assert (d.dtype, d.rule) == (torch.float32, "rotary")
    assert bf16.decide("x.inv_freq_proj.weight", "language_model", trainable=False).rule == (
        "frozen"  # a parameter is never a rotary table by name
    )


@pytest.mark.parametrize(
    ("trainable", "current", "group", "rule", "dtype"),
    [
        (True, torch.float32, "projector", "keep_trainable_fp32", torch.float32),
        (True, torch.bfloat16, "projector", "trainable", torch.bfloat16),
        (False, torch.float32, "vision_encoder", "group_dtypes", torch.float32),
        (False, torch.float32, "projector", "frozen", torch.bfloat16),
    ],
)
def test_rules_3_to_6_in_order(trainable, current, group, rule, dtype) -> None:
    """Below the keep rules: a kept fp32 trainable, then the trainable dtype, then the group
    override, then the frozen dtype (the module docstring's order)."""
    p = PrecisionPolicy.from_preset(
        "bf16-true", keep_trainable_fp32=True, group_dtypes={"vision_encoder": "fp32"}
    )
    d = decide(p, "x.weight", group, trainable=trainable, current=current)
    assert (d.rule, d.dtype) == (rule, dtype)
    assert d.kept is (rule in precedence.KEPT_RULES)


@pytest.mark.parametrize("preset", ["bf16", "fp16", "bf16-true", "fp16-true", "fp32"])
@pytest.mark.parametrize("current", [torch.float32, torch.bfloat16, torch.float16])
def test_a_frozen_scalar_keeps_its_dtype_under_every_preset(preset, current) -> None:
    """A 0-D floating tensor (a LoRA alpha, a scale, a temperature) is one number the model
    computes with as it is: no preset casts it; said as rule ``scalar`` where it mattered."""
    p = PrecisionPolicy.from_preset(preset)
    for is_buffer in (True, False):
        d = decide(
            p,
            "lora.alpha",
            "other",
            trainable=False,
            is_buffer=is_buffer,
            current=current,
            role="scalar",
        )
        assert d.dtype == current
        assert d.rule == ("frozen" if p.frozen_dtype == current else "scalar")
    # the same name without the role (a 1-D tensor) follows the policy
    assert decide(p, "lora.alpha", "other", trainable=False, current=current).dtype == (
        p.frozen_dtype
    )


def test_a_trainable_half_scalar_becomes_float32_for_the_optimizer() -> None:
    p = PrecisionPolicy.from_preset("bf16")
    d = decide(p, "logit_scale", "other", trainable=True, current=torch.bfloat16, role="scalar")
    assert (d.dtype, d.rule) == (torch.float32, "trainable")  # widened: the value is the same
    d = decide(p, "logit_scale", "other", trainable=True, current=torch.float32, role="scalar")
    assert (d.dtype, d.rule) == (torch.float32, "trainable")
    true = PrecisionPolicy.from_preset("bf16-true")
    d = decide(true, "logit_scale", "other", trainable=True, current=torch.float32, role="scalar")
    assert (d.dtype, d.rule) == (torch.float32, "scalar")  # bf16-true would round it
