"""Class C — fp32 upcast leak: the LM's RMSNorms are trained in fp32 next to frozen bf16 weights.
``LlamaRMSNorm`` returns ``weight * x.to(input_dtype)``, so an fp32 weight turns the bf16
activations into fp32 and the next bf16 linear (``q_proj``, ``lm_head``) fails."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionGuardCallback
from hf_precision.hooks import guard_targets
from hf_precision.tiny import tiny_batch, tiny_llava

FP32_INTO_BF16 = r"expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"


def _norms_trained_in_fp32():
    model = tiny_llava(torch.bfloat16)
    model.train()
    for name, p in model.named_parameters():
        p.requires_grad = "language_model" in name and "norm" in name
        if p.requires_grad:
            p.data = p.data.float()
    return model


def test_without_guard_fp32_norm_output_reaches_bf16_linears(trainer_for):
    model = _norms_trained_in_fp32()
    trainer = trainer_for(model, tiny_batch(model, batch_size=4))
    with pytest.raises(RuntimeError, match=FP32_INTO_BF16):
        trainer.train()


def test_guard_casts_leaf_inputs_to_each_weight_dtype(trainer_for, record_inputs):
    model = _norms_trained_in_fp32()
    # "bf16": frozen bf16, trainable fp32 (no Trainer flag, so no autocast hides the leak)
    guard = PrecisionGuardCallback("bf16")
    trainer = trainer_for(
        model,
        tiny_batch(model, batch_size=4),
        callbacks=[guard],
        eval_strategy="steps",
        eval_steps=2,
    )
    assert guard.last_report is not None
    assert "language_model" in guard.last_report.mixed_groups
    targets = guard_targets(model)
    lm = "model.language_model.layers.1"
    assert targets[f"{lm}.input_layernorm"] == ("leaf", "float32")
    assert targets[f"{lm}.self_attn.q_proj"] == ("leaf", "bfloat16")
    q_in = record_inputs(model.model.language_model.layers[1].self_attn.q_proj)
    head_in = record_inputs(model.lm_head)

    out = trainer.train()

    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert set(q_in) == set(head_in) == {torch.bfloat16}
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    assert sum(p.requires_grad for p in model.parameters()) == 5  # 2 layers x 2 norms + final
