"""Class I — quantized storage: int8 weights (``nn.Parameter`` of dtype int8, frozen) run through
an int8 kernel that demands int8 storage. A blanket per-parameter cast — the usual hand-made
"make everything bf16" fix for a dtype split — destroys them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_precision import PrecisionGuardCallback, dtype_map, enforce_policy
from hf_precision.tiny import tiny_batch, tiny_llava, tower_body

NOT_INT8 = "expect B to be int8 tensor"


class Int8Linear(nn.Module):
    """Weight-only int8 linear (per-row scales), computed by torch's int8 CPU kernel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        q = (w / scale[:, None]).round().to(torch.int8)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.scales = nn.Parameter(scale.to(linear.weight.dtype), requires_grad=False)
        self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch._weight_int8pack_mm(flat, self.weight, self.scales) + self.bias
        return out.reshape(*x.shape[:-1], -1)


def _quantized_llava():
    """bf16 LLaVA whose frozen vision MLPs are int8, and an fp32 projector (a dtype split)."""
    model = tiny_llava(torch.bfloat16)
    for layer in tower_body(model.model.vision_tower).encoder.layers:
        layer.mlp.fc1 = Int8Linear(layer.mlp.fc1)
    model.model.multi_modal_projector.float()
    model.train()
    for name, p in model.named_parameters():
        p.requires_grad = "language_model.layers.1." in name
    return model


def _int8(model):
    return {n: p for n, p in model.named_parameters() if p.dtype == torch.int8}


def test_without_guard_a_blanket_cast_destroys_the_int8_storage():
    model = _quantized_llava()
    with pytest.raises(RuntimeError, match="expected scalar type Float but found BFloat16"):
        model(**tiny_batch(model))
    for p in model.parameters():  # the hand-made fix
        p.data = p.data.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=NOT_INT8):
        model(**tiny_batch(model))


def test_guard_never_casts_quantized_weights_and_counts_them(trainer_for):
    model = _quantized_llava()
    before = {n: p.detach().clone() for n, p in _int8(model).items()}
    assert len(before) == 2
    guard = PrecisionGuardCallback()
    trainer = trainer_for(model, tiny_batch(model, 4), callbacks=[guard])

    report = guard.last_report
    assert report is not None
    skipped = dict(report.skipped)
    assert all(skipped[n] == "quantized storage (int8)" for n in before)
    assert not [c for c in report.changes if c.name in before]
    vision = dtype_map(model).groups["vision_encoder"]
    assert vision.quantized == sum(p.numel() for p in before.values())
    assert "int8" in vision.numel

    out = trainer.train()

    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    after = _int8(model)
    assert set(after) == set(before)
    assert all(torch.equal(before[n], after[n]) for n in before)  # bit-identical storage
    fc1 = tower_body(model.model.vision_tower).encoder.layers[0].mlp.fc1
    assert fc1.scales.dtype == fc1.bias.dtype == torch.bfloat16  # floating parts follow policy
    assert model.model.multi_modal_projector.linear_1.weight.dtype == torch.bfloat16
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not in_optimizer & {id(p) for p in after.values()}


def test_raise_mode_does_not_count_quantized_storage_as_a_violation():
    model = _quantized_llava()
    enforce_policy(model, "bf16-true")  # fix the split first
    report = enforce_policy(model, "bf16-true", mode="raise")  # nothing left to complain about
    assert not report.changes and len([s for s in report.skipped if "int8" in s[1]]) == 2
