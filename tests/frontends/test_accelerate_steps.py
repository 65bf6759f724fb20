"""The optimizer step of a PrecisionGuardPlugin loop
(:mod:`hf_precision.frontends.accelerate_steps`): the lost-update check on a real Accelerator
loop, as the Trainer path runs it (#30 item 3: trainable half weights under bf16 mixed
precision become fp32, or are warned about with the measured share)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import PrecisionGuardPlugin


@pytest.fixture(autouse=True)
def fresh_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Lora(nn.Module):
    """A frozen base and a trainable adapter, all loaded in bf16 (diffusers' LoRA script under
    ``--mixed_precision bf16`` upcasts its LoRA weights only under fp16)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
        self.lora_A = nn.Linear(8, 2, bias=False).to(torch.bfloat16)
        self.lora_B = nn.Linear(2, 8, bias=False).to(torch.bfloat16)
        nn.init.normal_(self.lora_B.weight, std=0.1)  # peft starts it at zero: no lora_A grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


def _loop(
    said: Any, tmp_path: Path, plugin: PrecisionGuardPlugin, *models: nn.Module, trained: int = 0
):
    """Three real steps of AdamW at lr 1e-5 on ``models[trained]`` under bf16 mixed precision;
    returns the warnings the loop raised."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
    model = models[trained]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")  # the finding goes through logging all the same
        *prepared, optimizer = plugin.prepare(accelerator, *models, optimizer)
        for _ in range(3):
            with accelerator.autocast():
                loss = prepared[trained](torch.randn(4, 8)).float().pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return said.about("updates lost")


def _section(tmp_path: Path) -> dict[str, Any]:
    [path] = sorted((tmp_path / "precision").glob("*-lost_updates.json"))
    return json.loads(path.read_text())["lost_updates"]


def test_trainable_bf16_weights_become_fp32_and_lose_no_update(said, tmp_path):
    model = Lora()
    lost = _loop(said, tmp_path, PrecisionGuardPlugin(), model)
    assert model.lora_A.weight.dtype == model.lora_B.weight.dtype == torch.float32
    assert model.base.weight.dtype == torch.bfloat16  # frozen: as loaded
    section = _section(tmp_path)
    assert section["steps"] == 3 and section["counted"] > 0
    assert {w["name"]: w["dtype"] for w in section["weights"]} == {
        "lora_A.weight": "float32",
        "lora_B.weight": "float32",
    }
    assert section["half_share"] == 0.0 and lost == []


@pytest.mark.parametrize("policy, mode", [("bf16-true", None), (None, "audit")])
def test_trainable_bf16_weights_kept_are_warned_with_the_measured_share(
    said, tmp_path, policy, mode
):
    """The user's policy keeps them bf16 (or audit casts nothing): the plugin measures the first
    three steps, as the Trainer path does, and says the fix in its own words."""
    model = Lora()
    plugin = PrecisionGuardPlugin(policy, mode=mode)
    [line] = _loop(said, tmp_path, plugin, model)
    assert model.lora_A.weight.dtype == torch.bfloat16
    section = _section(tmp_path)
    assert plugin.guards[0].sections["lost_updates"] == section
    assert section["half_share"] > 0.5 and section["unchanged"] <= section["counted"]
    share = re.search(r"(\d+)% of the sampled bfloat16 elements", line)
    assert share and int(share.group(1)) == round(100 * section["half_share"])
    assert "lora_A.weight" in line and "lora_B.weight" in line
    assert "PrecisionGuardPlugin('bf16') in mode 'fix'" in line
    assert "PrecisionGuardCallback" not in line  # not the Trainer's front end
    assert plugin._lost is not None and not plugin._lost.active  # hooks off after step 3


def test_the_model_the_optimizer_trains_is_the_one_watched(said, tmp_path):
    frozen, trained = nn.Linear(8, 8).requires_grad_(False), Lora()
    plugin = PrecisionGuardPlugin("bf16-true")
    _loop(said, tmp_path, plugin, frozen, trained, trained=1)
    assert "lost_updates" not in plugin.guards[0].sections
    names = [w["name"] for w in plugin.guards[1].sections["lost_updates"]["weights"]]
    assert names == ["lora_A.weight", "lora_B.weight"]


def test_off_watches_nothing(said, tmp_path):
    plugin = PrecisionGuardPlugin("bf16-true", lost_updates="off")
    assert _loop(said, tmp_path, plugin, Lora()) == []
    assert plugin._lost is None and not list((tmp_path / "precision").glob("*lost_updates*"))


def test_under_fp16_trainable_half_weights_become_fp32_or_are_refused_before_casting():
    """#30 item 3, fp16 as for the Trainer: the inferred policy holds the LoRA weights in fp32;
    a policy that trains them in fp16 is refused before anything is cast (the GradScaler
    would raise 'Attempting to unscale FP16 gradients')."""
    from accelerate import Accelerator

    from hf_precision import PrecisionError

    model = Lora().to(torch.float16)
    optimizer = torch.optim.AdamW([model.lora_A.weight, model.lora_B.weight], lr=1e-5)
    plugin = PrecisionGuardPlugin(report=False)
    plugin.prepare(Accelerator(cpu=True, mixed_precision="fp16"), model, optimizer)
    assert model.lora_A.weight.dtype == model.lora_B.weight.dtype == torch.float32
    assert model.base.weight.dtype == torch.float16
    assert optimizer.param_groups[0]["params"][0] is model.lora_A.weight
    kept = Lora().to(torch.float16)
    with pytest.raises(PrecisionError, match="Attempting to unscale FP16 gradients"):
        PrecisionGuardPlugin("fp16-true", report=False).prepare(
            Accelerator(cpu=True, mixed_precision="fp16"), kept
        )
    assert kept.lora_A.weight.dtype == torch.float16  # nothing cast
