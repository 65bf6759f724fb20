"""fp8 storage (layerwise casting): no trainable fp8 tensor, and the storage dtype never decides
what a layer receives. Real diffusers, accelerate, PEFT and transformers models."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from hf_precision import PrecisionError, PrecisionPolicy
from hf_precision.engine.fp8.storage import (
    check_trainable_fp8,
    fp8_first_layers,
    fp8_model_dtype_note,
    trainable_fp8,
)
from hf_precision.engine.guard import PrecisionGuard
from hf_precision.errors import PrecisionWarning
from hf_precision.model.view import ModelView

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from diffusers.hooks import apply_layerwise_casting
from peft import LoraConfig

from hf_precision.frontends.diffusion import guard_diffusion
from hf_precision.tiny import tiny_batch, tiny_idefics3
from hf_precision.tiny.diffusion import tiny_unet

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
LORA = LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])


def _unet_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(1, 4, 8, 8, generator=g),
        torch.tensor([3]),
        torch.randn(1, 4, 16, generator=g),
    )


def _step(model: torch.nn.Module, run: object) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = run()  # type: ignore[operator]
    loss.float().pow(2).mean().backward()
    opt.step()
    return opt


def _unet_loss(unet: torch.nn.Module) -> object:
    sample, t, text = _unet_inputs()
    return lambda: unet(sample, t, encoder_hidden_states=text).sample


# ------------------------------------------------------------------ no trainable fp8 tensor


def test_lora_added_after_layerwise_casting_is_refused_before_the_first_step() -> None:
    unet = tiny_unet()
    unet.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=BF16)
    unet.add_adapter(LORA)  # the wrong order: PEFT makes the adapters in fp8
    lora = {n: p for n, p in unet.named_parameters() if p.requires_grad}
    assert lora and {p.dtype for p in lora.values()} == {FP8}
    with pytest.raises(RuntimeError):  # unguarded, the run fails anyway
        _step(unet, _unet_loss(unet))
    unet = tiny_unet()
    unet.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=BF16)
    unet.add_adapter(LORA)
    with pytest.raises(PrecisionError) as err:
        guard_diffusion(unet, "bf16")
    msg = str(err.value)
    assert f"{len(lora)} trainable tensor(s) are stored in float8_e4m3fn" in msg
    first = next(iter(lora))
    assert first in msg and first.split(".lora_A")[0] in msg  # the tensor and its module
    assert "add the adapter, then cast" in msg
    assert "model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn" in msg
    assert "diffusers layerwise casting" in msg
    assert {p.dtype for p in lora.values()} == {FP8}  # nothing written


def test_lora_added_before_layerwise_casting_trains_guarded() -> None:
    unet = tiny_unet()
    unet.add_adapter(LORA)  # the right order: diffusers skips PEFT layers
    unet.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=BF16)
    stored = {n: p for n, p in unet.named_parameters() if p.dtype == FP8}
    assert stored and not any(p.requires_grad for p in stored.values())
    guard = guard_diffusion(unet, "bf16")
    lora = {n: p for n, p in unet.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in lora.items()}
    _step(unet, _unet_loss(unet))
    assert {p.dtype for p in lora.values()} == {torch.float32}
    assert any(not torch.equal(before[n], p) for n, p in lora.items())
    assert all(p.dtype == FP8 for p in stored.values())  # the storage is the hook's
    guard.remove()


def test_trainable_fp8_audit_mode_warns_and_records_the_tensors() -> None:
    unet = tiny_unet()
    unet.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=BF16)
    unet.add_adapter(LORA)
    view = ModelView.of(unet)
    found = trainable_fp8(view)
    assert found and all(f.adapter is not None and f.cast is not None for f in found)
    assert found[0].cast == (FP8, BF16, "diffusers")
    with pytest.warns(PrecisionWarning, match="add the adapter, then cast"):
        check_trainable_fp8(view, "audit", "audit")
    said: list = []
    check_trainable_fp8(view, "audit", "audit", said.append)  # the findings channel
    assert said[0].source == "fp8_storage" and said[0].numbers["trainable_fp8"] == len(found)


def test_no_trainable_fp8_says_nothing() -> None:
    model = tiny_idefics3()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_trainable_fp8(ModelView.of(model), "setup", "fix")


# ------------------------------------------------------------------ storage is not compute


def _idefics3_accelerate_cast(trainable: bool) -> torch.nn.Module:
    from accelerate.big_modeling import attach_layerwise_casting_hooks

    model = tiny_idefics3(dtype=BF16)
    model.requires_grad_(trainable)
    attach_layerwise_casting_hooks(model, storage_dtype=FP8, compute_dtype=BF16)
    return model


def test_model_dtype_reading_fp8_storage_is_bridged() -> None:
    """accelerate's hooks (no skip patterns) store the patch embedding in fp8: Idefics3's
    ``pixel_values.to(self.dtype)`` makes fp8 pixels and its first conv fails."""
    model = _idefics3_accelerate_cast(trainable=False)
    batch = tiny_batch(model)
    assert model.dtype == FP8
    with pytest.raises(NotImplementedError, match="Float8_e4m3fn"):
        model(**batch)
    model = _idefics3_accelerate_cast(trainable=False)  # the failed call left it in bf16
    view = ModelView.of(model)
    first = fp8_first_layers(view)
    assert [f.path for f in first] == ["model.vision_model.embeddings.patch_embedding"]
    note = fp8_model_dtype_note(view)
    assert note is not None and "Idefics3ForConditionalGeneration.dtype reads float8_e4m3fn" in note
    assert "skip_modules_pattern=(..., 'patch_embedding')" in note
    with pytest.warns(PrecisionWarning, match=r"dtype reads float8_e4m3fn"):
        guard = PrecisionGuard(model, PrecisionPolicy.from_preset("bf16"))
        guard.verify("setup")
    out = model(**batch)
    assert torch.isfinite(out.loss)
    assert model.model.vision_model.embeddings.patch_embedding.weight.dtype == FP8
    guard.teardown()


def test_layerwise_storage_reads_as_its_compute_dtype() -> None:
    model = _idefics3_accelerate_cast(trainable=False)
    view = ModelView.of(model)
    weight = model.model.text_model.layers[0].self_attn.q_proj.weight
    assert view.layerwise[id(weight)] == BF16
    assert view.receiving_of(model.model.text_model)[0] == BF16


def _idefics3_trained_rest() -> torch.nn.Module:
    """diffusers' layerwise casting (default patterns keep patch_embed and norms out) on a
    bf16 Idefics3 whose fp8-stored layers are frozen and the rest trained."""
    model = tiny_idefics3(dtype=BF16)
    apply_layerwise_casting(model, storage_dtype=FP8, compute_dtype=BF16)
    for p in model.parameters():
        p.requires_grad_(p.dtype != FP8)
    return model


def test_upcast_trainables_beside_fp8_storage_still_run() -> None:
    """The bf16 preset upcasts the trainable patch embedding and norms to fp32 (model.dtype
    reads fp32): the layers stored in fp8 still receive bf16, as unguarded."""
    model = _idefics3_trained_rest()
    _step(model, lambda: model(**tiny_batch(model)).loss)  # unguarded: a full step runs
    model = _idefics3_trained_rest()
    guard = PrecisionGuard(model, PrecisionPolicy.from_preset("bf16"))
    guard.verify("setup")
    assert model.dtype == torch.float32
    trained = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trained]
    _step(model, lambda: model(**tiny_batch(model)).loss)
    assert all(p.dtype == torch.float32 for p in trained)
    assert any(not torch.equal(a, p) for a, p in zip(before, trained, strict=True))
    assert model.model.text_model.layers[0].mlp.up_proj.weight.dtype == FP8
    guard.teardown()


def test_fully_trainable_layerwise_cast_model_is_refused() -> None:
    """Every weight trainable: the fp8-stored ones cannot step (unguarded, AdamW fails on fp8
    at the first step); the guard says so before it, with the fix."""
    model = tiny_idefics3(dtype=BF16)
    apply_layerwise_casting(model, storage_dtype=FP8, compute_dtype=BF16)
    with pytest.raises(NotImplementedError, match="Float8_e4m3fn"):
        _step(model, lambda: model(**tiny_batch(model)).loss)
    model = tiny_idefics3(dtype=BF16)
    apply_layerwise_casting(model, storage_dtype=FP8, compute_dtype=BF16)
    with pytest.raises(PrecisionError, match=r"freeze them \(requires_grad_\(False\)\)"):
        PrecisionGuard(model, PrecisionPolicy.from_preset("bf16")).verify("setup")


def test_the_trainer_callback_trains_beside_fp8_storage(make_trainer: Any) -> None:
    """The callback reaches it with no edit: under ``bf16=True`` the frozen fp8-stored layers
    and the trained rest run Trainer steps (as unguarded: autocast covers the linears); a
    trainable fp8 tensor is refused at ``on_init_end``, before the optimizer exists."""
    from hf_precision import PrecisionGuardCallback

    model = _idefics3_trained_rest()
    callbacks = [PrecisionGuardCallback()]
    make_trainer(model, tiny_batch(model), callbacks=callbacks, bf16=True).train()
    assert model.model.text_model.layers[0].mlp.up_proj.weight.dtype == FP8
    wrong = tiny_idefics3(dtype=BF16)
    apply_layerwise_casting(wrong, storage_dtype=FP8, compute_dtype=BF16)
    with pytest.raises(PrecisionError, match="trainable tensor"):
        make_trainer(wrong, tiny_batch(wrong), callbacks=[PrecisionGuardCallback()])
