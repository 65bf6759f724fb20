"""Class D — paths outside the wrapper. With ``bf16=True`` accelerate wraps only the top-level
``forward`` in autocast, so training steps hide the mismatch; a callback that generates samples
after evaluation (``PeftModel.generate`` -> the remote ``generate`` encoding images first) runs
outside it and fails. ``bf16_full_eval`` casts the model in place and never casts back."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_precision import PrecisionGuardCallback
from hf_precision.tiny import XComposerTiny, tiny_batch, tiny_llava

FP32_INTO_BF16 = r"expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"


def _lora_xcomposer():
    base = XComposerTiny(torch.bfloat16)
    base.train()
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    # peft 0.17 also marks every parameter whose name contains "lora_" trainable (XComposer's
    # own plora_glb_GN, Plora_A/B); newer peft trains the adapters only, as here
    for name, p in model.named_parameters():
        p.requires_grad = ".lora_A." in name or ".lora_B." in name
    return model


def test_without_guard_generation_after_evaluation_fails(trainer_for, generate_on_evaluate):
    model = _lora_xcomposer()
    samples = generate_on_evaluate(XComposerTiny().batch(2))
    trainer = trainer_for(
        model,
        XComposerTiny().batch(4),
        callbacks=[samples],
        bf16=True,
        eval_strategy="steps",
        eval_steps=1,
    )
    with pytest.raises(RuntimeError, match=FP32_INTO_BF16):
        trainer.train()
    # the training step and the eval loss ran under autocast; generate() did not
    assert trainer.state.global_step == 1
    assert any("eval_loss" in row for row in trainer.state.log_history)
    assert samples.samples == []


def test_guard_covers_peft_generate_during_evaluation(
    trainer_for, generate_on_evaluate, record_inputs
):
    model = _lora_xcomposer()
    prompt = XComposerTiny().batch(2)
    samples = generate_on_evaluate(prompt)
    trainer = trainer_for(
        model,
        XComposerTiny().batch(4),
        bf16=True,
        eval_strategy="steps",
        eval_steps=1,
        callbacks=[PrecisionGuardCallback(), samples],
    )
    base = model.base_model.model
    patch_in = record_inputs(base.vit.vision_tower.patch_embed)

    out = trainer.train()

    assert out.global_step == 2
    assert len(samples.samples) == 2 and samples.samples[0].shape == (
        2,
        prompt["input_ids"].shape[1] + 2,
    )
    assert set(patch_in) == {torch.bfloat16}  # training, eval and generate paths alike
    for name, p in model.named_parameters():
        want = torch.float32 if p.requires_grad else torch.bfloat16
        assert p.dtype == want, name
    assert any("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


def _lora_llava():
    base = tiny_llava()
    base.train()
    return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def _trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_without_guard_bf16_full_eval_leaves_a_pure_bf16_model(trainer_for):
    model = _lora_llava()
    trainer = trainer_for(model, tiny_batch(tiny_llava(), 4), bf16=True, bf16_full_eval=True)
    before = {n: p.detach().clone() for n, p in _trainable(model).items()}
    trainer.evaluate()
    after = _trainable(model)
    assert {p.dtype for p in after.values()} == {torch.bfloat16}  # fp32 adapters rounded
    assert not all(torch.equal(before[n], after[n].float()) for n in before)
    trainer.train()  # ...and trained in pure bf16 from here on
    assert {p.dtype for p in _trainable(model).values()} == {torch.bfloat16}


def test_guard_restores_trainable_fp32_weights_bit_exactly(trainer_for):
    model = _lora_llava()
    guard = PrecisionGuardCallback()
    trainer = trainer_for(
        model, tiny_batch(tiny_llava(), 4), bf16=True, bf16_full_eval=True, callbacks=[guard]
    )
    before = {n: p.detach().clone() for n, p in _trainable(model).items()}
    assert {p.dtype for p in before.values()} == {torch.float32}
    base = model.base_model.model

    metrics = trainer.evaluate()  # Trainer casts the whole model to bf16 in place here

    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    after = _trainable(model)
    assert all(after[n].dtype == torch.float32 and torch.equal(before[n], after[n]) for n in before)
    assert base.model.language_model.rotary_emb.inv_freq.dtype == torch.float32
    trainer.train()
    assert {p.dtype for p in _trainable(model).values()} == {torch.float32}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert [e for e, _ in guard.events][:3] == ["on_init_end", "on_evaluate", "on_train_begin"]
