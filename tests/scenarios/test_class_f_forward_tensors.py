"""Class F — tensors made at construction and in forward. The MiniCPM-V 2.x resampler makes its
``pos_embed`` parameter from a numpy sin-cos table with ``.float()``: a model built in bf16 (as
``from_pretrained(torch_dtype=bf16)`` builds it) keeps that one parameter fp32, and
``query + pos_embed`` hands fp32 queries to the bf16 ``resampler.attn``. And a bf16 build
rounds the rotary ``inv_freq`` buffers, which must stay fp32."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionGuardCallback, check_policy
from hf_precision.engine.hooks import guard_targets
from hf_precision.tiny import MiniCPMV2Tiny

TABLE_INTO_BF16_ATTN = r"mat1 and mat2 must have the same dtype, but got Float and BFloat16"


def _minicpmv2():
    model = MiniCPMV2Tiny(torch.bfloat16)
    model.train()
    for name, p in model.named_parameters():  # fine-tune the LM, keep the vision side frozen
        p.requires_grad = name.startswith("llm.")
    return model


def test_without_guard_the_numpy_position_table_reaches_bf16_attention(record_inputs):
    model = _minicpmv2()
    attn_in = record_inputs(model.resampler.attn)
    with pytest.raises(RuntimeError, match=TABLE_INTO_BF16_ATTN):
        model(**model.batch())
    # query = bf16 queries + the fp32 pos_embed -> fp32; key and value bf16
    assert model.resampler.pos_embed.dtype == torch.float32
    assert attn_in == [torch.float32, torch.bfloat16, torch.bfloat16]
    # model.to(bf16) also rounded the rotary frequencies (the invariant the guard restores)
    assert model.llm.model.rotary_emb.inv_freq.dtype == torch.bfloat16


def test_guard_leaf_casts_the_table_and_keeps_inv_freq_fp32(
    trainer_for, record_inputs, generate_on_evaluate
):
    model = _minicpmv2()
    samples = generate_on_evaluate(MiniCPMV2Tiny().batch(2))
    trainer = trainer_for(
        model,
        model.batch(4),
        eval_strategy="steps",
        eval_steps=2,
        callbacks=[PrecisionGuardCallback(), samples],
    )
    assert guard_targets(model)["resampler.attn"] == ("leaf", "bfloat16")
    attn_in = record_inputs(model.resampler.attn)

    out = trainer.train()

    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert attn_in and set(attn_in) == {torch.bfloat16}  # train, eval and generate
    assert len(samples.samples) == 1
    assert model.llm.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model.resampler.pos_embed.dtype == torch.bfloat16  # a parameter, cast with its group
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    assert floats == {torch.bfloat16}  # no flag: the loaded bf16 applied coherently
    assert not check_policy(model, "bf16-true").changes
