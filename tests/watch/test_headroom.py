"""The headroom probe (``hf_precision.watch.headroom``): an activation overflow whose weights
pass the range check, and the fp8 layers' error against bf16."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import PrecisionWarning, enforce_policy
from hf_precision.watch.headroom import headroom_event, probe_headroom


class Pooler(nn.Module):
    """The Gemma vision pooler before transformers 46277's fix: average the patches, then scale
    by sqrt(hidden size of the real model, 1152), in the working dtype."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.mean(dim=1) * math.sqrt(1152)


class PooledVision(nn.Module):
    """A tiny real SigLIP vision tower, the pooler above and a projector."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        torch.manual_seed(0)
        config = SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            image_size=16,
            patch_size=8,
            vision_use_head=False,
        )
        self.vision_tower = SiglipVisionModel(config)
        self.pooler = Pooler()
        self.projector = nn.Linear(32, 16)
        with torch.no_grad():  # a checkpoint's norm scale: large, well inside float16
            self.vision_tower.post_layernorm.weight.fill_(3000.0)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.vision_tower(pixel_values=pixel_values).last_hidden_state
        return self.projector(self.pooler(hidden))


def _pixels() -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def test_an_activation_overflow_the_weight_check_passes_is_named():
    model = PooledVision()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)  # the weights pass the range check
        warnings.filterwarnings("ignore", message=".*(tensors →|memory).*")
        enforce_policy(model, "fp16-true")
    assert model.projector.weight.dtype == torch.float16
    assert not torch.isfinite(model(_pixels().half())).all()  # at run time: inf, then NaN
    result = probe_headroom(model, {"pixel_values": _pixels()})
    assert result.copied  # half weights: a float32 copy ran; the model is untouched
    assert model.projector.weight.dtype == torch.float16 and model.training
    worst = result.worst()[0]
    assert worst.path == "pooler" and worst.amax > 65504
    assert "float16" in worst.beyond() and "float8_e4m3fn" in worst.beyond()
    assert result.beyond("float16")[0].path == "pooler"
    assert "pooler" in result.line() and "beyond float16" in result.line()
    assert result.to_dict()["beyond_float16"][0] == "pooler"


def test_a_float32_model_runs_in_place_and_keeps_its_mode():
    model = PooledVision().train()
    result = probe_headroom(model, {"pixel_values": _pixels()})
    assert not result.copied and model.training
    assert all(not m._forward_hooks for m in model.modules())  # the probe's hooks are off
    inner = {m.path: m.amax for m in result.modules}
    assert inner["vision_tower.post_layernorm"] < inner["pooler"]


def test_fp8_layers_report_their_error_against_bf16():
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    assert type(model[0]).__name__ == "Float8Linear"
    x = torch.randn(16, 32)
    result = probe_headroom(model, (x,))
    errors = {m.path: m.fp8_error for m in result.fp8()}
    assert set(errors) == {"0", "2"}
    assert all(e is not None and 0 < e < 0.2 for e in errors.values())
    # the float32 forward went on with the float32 layer's output, not the fp8 one
    with torch.no_grad():
        ref = nn.functional.linear(x, model[0].weight, model[0].bias)
    by_path = {m.path: m.amax for m in result.modules}
    assert by_path["0"] == pytest.approx(ref.abs().max().item(), rel=1e-6)
    assert "fp8 vs bf16 error" in result.line()


def test_the_event_writes_a_headroom_section(tmp_path: Any, said: Any):
    import json

    from hf_precision import PrecisionPolicy
    from hf_precision.engine.guard import PrecisionGuard
    from hf_precision.report.reporter import PrecisionReporter

    model = PooledVision()
    reporter = PrecisionReporter(report_dir=str(tmp_path))
    guard = PrecisionGuard(model, PrecisionPolicy.from_preset("fp32"), reporter=reporter)
    guard.verify("setup")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")  # the finding goes through logging all the same
        headroom_event(guard, {"pixel_values": _pixels()}, step=3)
    assert said.about("beyond float16")
    written = sorted(tmp_path.glob("*headroom*.json"))
    assert written, sorted(p.name for p in tmp_path.iterdir())
    section = json.loads(written[-1].read_text())["headroom"]
    assert section["beyond_float16"][0] == "pooler"
    guard.teardown()
