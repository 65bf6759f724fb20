"""Class A — input from outside: the collator builds fp32 ``pixel_values`` and nothing casts them
(``Trainer`` casts inputs only under DeepSpeed). The remote-code InternVL-Chat layout reads the
patch embedding's dtype but never casts the pixels with it."""

from __future__ import annotations

import pytest
import torch
from transformers import default_data_collator

from hf_precision import PrecisionCollator, PrecisionGuardCallback
from hf_precision.tiny import InternVLTiny, tiny_batch, tiny_llava

FP32_PIXELS_INTO_BF16_CONV = (
    r"Input type \(float\) and bias type \(c10::BFloat16\) should be the same"
)


def _internvl() -> InternVLTiny:
    model = InternVLTiny(torch.bfloat16)  # loaded in bf16, as from_pretrained(dtype=bf16)
    model.train()
    return model


def test_without_guard_the_collators_fp32_pixels_break_training(trainer_for):
    model = _internvl()
    batch = model.batch(4)
    assert batch["pixel_values"].dtype == torch.float32
    trainer = trainer_for(model, batch)
    with pytest.raises(RuntimeError, match=FP32_PIXELS_INTO_BF16_CONV):
        trainer.train()


def test_guard_casts_the_batch_in_training_and_evaluation(trainer_for, record_inputs):
    model = _internvl()
    trainer = trainer_for(
        model,
        model.batch(4),
        callbacks=[PrecisionGuardCallback()],
        eval_strategy="steps",
        eval_steps=1,
    )
    pixels_seen = record_inputs(model.vision_model.patch_embed)
    batches_seen: list[dict[str, torch.dtype]] = []
    model.register_forward_pre_hook(
        lambda m, a, kw: batches_seen.append({k: v.dtype for k, v in kw.items()}), with_kwargs=True
    )

    out = trainer.train()

    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert pixels_seen and set(pixels_seen) == {torch.bfloat16}  # train and eval forwards
    for seen in batches_seen:  # key-aware: ids, masks and labels keep their integer dtypes
        assert seen["pixel_values"] == torch.bfloat16
        assert seen["input_ids"] == seen["labels"] == seen["attention_mask"] == torch.int64
    # no flag, model loaded in bf16 -> the bf16 policy applied coherently; rotary stays fp32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.language_model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_precision_collator_alone_fixes_training(trainer_for):
    model = _internvl()
    collate = PrecisionCollator(default_data_collator, "bf16-true", model=model)
    trainer = trainer_for(model, model.batch(4), collator=collate)
    assert trainer.train().global_step == 2
    batch = collate([{k: v[0] for k, v in model.batch(1).items()}])
    assert batch["pixel_values"].dtype == torch.bfloat16
    assert batch["labels"].dtype == batch["input_ids"].dtype == torch.int64


def test_pixel_values_follow_the_vision_encoder_not_the_compute_dtype():
    # A deliberate split (fp32 vision tower, bf16 LM): pixel_values go to the tower's dtype.
    model = tiny_llava(torch.bfloat16)
    model.model.vision_tower.float()
    collate = PrecisionCollator(default_data_collator, "bf16-true", model=model)
    batch = tiny_batch(model, batch_size=1)
    batch["attention_mask"] = batch["attention_mask"].float()  # a float mask from the collator
    out = collate([{k: v[0] for k, v in batch.items()}])
    assert out["pixel_values"].dtype == torch.float32  # vision_encoder receives fp32
    assert out["attention_mask"].dtype == torch.bfloat16  # float mask -> compute dtype
    assert out["labels"].dtype == torch.int64
