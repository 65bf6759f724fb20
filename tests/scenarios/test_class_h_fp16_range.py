"""Class H — fp16 range: a weight beyond ±65504 becomes ``inf`` in ``model.half()`` and the loss
turns NaN; a float mask holding ``finfo(float32).min`` becomes ``-inf`` in fp16; batch values
beyond the range overflow silently."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import default_data_collator

from hf_precision import (
    PrecisionCollator,
    PrecisionError,
    PrecisionGuardCallback,
    PrecisionWarning,
    enforce_policy,
    install_guards,
)
from hf_precision.tiny import tiny_batch, tiny_llava, tower_body

PLANTED = "model.multi_modal_projector.linear_1.weight"
FP16 = torch.finfo(torch.float16)


def _llava_with_planted_weight():
    model = tiny_llava()
    with torch.no_grad():
        model.model.multi_modal_projector.linear_1.weight[0, 0] = 70000.0
    model.train()
    for name, p in model.named_parameters():  # train one LM layer, the rest is frozen
        p.requires_grad = "language_model.layers.1." in name
    return model


def test_without_guard_half_turns_the_weight_into_inf_and_the_loss_into_nan():
    model = _llava_with_planted_weight().half()
    assert torch.isinf(model.get_parameter(PLANTED)).any()
    assert torch.isnan(model(**tiny_batch(model)).loss)


def test_guard_keeps_the_out_of_range_weight_in_fp32_with_a_warning(trainer_for):
    model = _llava_with_planted_weight()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = trainer_for(
            model, tiny_batch(model, 4), fp16=True, callbacks=[PrecisionGuardCallback()]
        )
    found = [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]
    assert any(PLANTED in m and "70000" in m and "kept in float32" in m for m in found), found
    projector = model.model.multi_modal_projector
    assert projector.linear_1.weight.dtype == torch.float32
    assert projector.linear_1.weight[0, 0].item() == 70000.0
    # the module computes in one dtype: its bias stays with the kept weight
    assert projector.linear_1.bias.dtype == torch.float32
    assert projector.linear_2.weight.dtype == torch.float16
    assert (
        tower_body(model.model.vision_tower).embeddings.patch_embedding.weight.dtype
        == torch.float16
    )

    with warnings.catch_warnings():
        # activations of the 70000 weight exceed fp16 at linear_2's input: clamped, with a warning
        warnings.simplefilter("ignore", PrecisionWarning)
        out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_raise_mode_names_the_tensor(trainer_for):
    model = _llava_with_planted_weight()
    with pytest.raises(PrecisionError) as err:
        trainer_for(
            model, tiny_batch(model, 4), fp16=True, callbacks=[PrecisionGuardCallback(mode="raise")]
        )
    text = str(err.value)
    assert f"{PLANTED}: max |value| 70000 exceeds fp16 range" in text
    assert "Fix:" in text
    assert model.get_parameter(PLANTED).dtype == torch.float32  # raise mode changed nothing


def test_float_mask_sentinels_are_remapped_not_overflowed():
    # an additive float mask with a fully masked row (a padding query), built in fp32
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., 0, :] = torch.finfo(torch.float32).min
    scores = torch.zeros(4, dtype=torch.float16)
    naive = mask.to(torch.float16)
    assert torch.isneginf(naive).any()  # without the guard: -inf ...
    assert torch.isnan(torch.softmax(scores + naive[0, 0, 0], -1)).all()  # ... and NaN

    collate = PrecisionCollator(default_data_collator, "fp16")
    out = collate([{"attention_mask": mask[0], "input_ids": torch.arange(4)}])
    cast = out["attention_mask"]
    assert cast.dtype == torch.float16 and torch.isfinite(cast).all()
    assert torch.equal(cast == FP16.min, mask == torch.finfo(torch.float32).min)
    assert torch.isfinite(torch.softmax(scores + cast[0, 0, 0], -1)).all()
    assert out["input_ids"].dtype == torch.int64


def test_batch_values_beyond_fp16_are_clamped_with_a_warning():
    pixels = torch.rand(3, 30, 30)
    pixels[0, 0, 0] = 1e6
    collate = PrecisionCollator(default_data_collator, "fp16")
    with pytest.warns(PrecisionWarning, match=r"pixel_values has values up to 1e\+06"):
        out = collate([{"pixel_values": pixels}])
    assert out["pixel_values"].dtype == torch.float16
    assert torch.isfinite(out["pixel_values"]).all()
    assert out["pixel_values"].max().item() == FP16.max

    # the model-level batch hook does the same for Trainer users with no collator change
    model = tiny_llava(torch.float16)
    install_guards(model, "fp16-true", enforce_policy(model, "fp16-true"))
    batch = tiny_batch(model)
    batch["pixel_values"][0, 0, 0, 0] = 1e6
    with pytest.warns(PrecisionWarning, match="beyond the float16 range"):
        loss = model(**batch).loss
    assert torch.isfinite(loss)
