"""Class E — fp16 trainables + GradScaler: a model loaded in fp16 and fine-tuned with
``fp16=True`` has fp16 trainable weights, and the GradScaler refuses to unscale fp16 gradients.

On CPU ``Trainer(fp16=True)`` creates no scaler (asserted below), so the real CUDA error is
reproduced with ``torch.amp.GradScaler("cpu")`` over the Trainer's own optimizer, and for real
under the ``gpu`` marker."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_precision import PrecisionError, PrecisionGuardCallback
from hf_precision.tiny import tiny_batch, tiny_llava

UNSCALE_FP16 = "Attempting to unscale FP16 gradients"


def _fp16_projector_finetune(device: str = "cpu"):
    model: Any = tiny_llava(torch.float16)
    model.to(device)
    model.train()
    for name, p in model.named_parameters():
        p.requires_grad = "multi_modal_projector" in name
    return model


def _scaler_step(trainer, model, device: str = "cpu") -> None:
    """One AMP step as Trainer(fp16=True) takes it on CUDA: scale, backward, unscale, step."""
    scaler = torch.amp.GradScaler(device)
    batch = {k: v.to(device) for k, v in tiny_batch(model).items()}
    loss = model(**batch).loss.float()
    scaler.scale(loss).backward()
    scaler.unscale_(trainer.optimizer)
    scaler.step(trainer.optimizer)
    scaler.update()


def test_without_guard_fp16_trainables_cannot_be_unscaled(trainer_for):
    model = _fp16_projector_finetune()
    trainer = trainer_for(model, tiny_batch(model, 4), fp16=True)
    assert trainer.accelerator.scaler is None  # CPU: fp16=True runs no scaler, no autocast
    trainer.create_optimizer()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and {p.dtype for p in trainable} == {torch.float16}  # the violated invariant
    with pytest.raises(ValueError, match=UNSCALE_FP16):
        _scaler_step(trainer, model)


def test_guard_keeps_trainables_fp32_and_the_scaler_works(trainer_for):
    model = _fp16_projector_finetune()
    trainer = trainer_for(
        model,
        tiny_batch(model, 4),
        fp16=True,
        lr_scheduler_type="constant",
        callbacks=[PrecisionGuardCallback()],
    )
    out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.float16), name
    before = model.model.multi_modal_projector.linear_1.weight.detach().clone()
    _scaler_step(trainer, model)  # unscale_ accepts fp32 gradients
    after = model.model.multi_modal_projector.linear_1.weight
    assert after.dtype == torch.float32 and not torch.equal(before, after)


def test_fp16_true_preset_with_fp16_training_is_refused(trainer_for):
    model = _fp16_projector_finetune()
    with pytest.raises(PrecisionError, match=UNSCALE_FP16) as err:
        trainer_for(
            model, tiny_batch(model, 4), fp16=True, callbacks=[PrecisionGuardCallback("fp16-true")]
        )
    assert "Fix:" in str(err.value) and "'fp16'" in str(err.value)


@pytest.mark.gpu
def test_on_cuda_the_real_trainer_scaler(trainer_for):
    data = tiny_batch(tiny_llava(), 4)
    trainer = trainer_for(_fp16_projector_finetune("cuda"), data, fp16=True, use_cpu=False)
    with pytest.raises(ValueError, match=UNSCALE_FP16):
        trainer.train()
    model = _fp16_projector_finetune("cuda")
    trainer = trainer_for(
        model, data, fp16=True, use_cpu=False, callbacks=[PrecisionGuardCallback()]
    )
    assert trainer.accelerator.scaler is not None
    assert trainer.train().global_step == 2
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.device.type for p in model.parameters()} == {"cuda"}
