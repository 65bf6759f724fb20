"""What ran: the report names the dtype each part computed in at the first forward after an
event, not the one the policy means (a OneTrainer-style loop with no autocast; a real Trainer
with fp16=True on a CPU, where transformers runs no autocast)."""

from __future__ import annotations

import doctest
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision import PrecisionGuardCallback
from hf_precision.report.reporter import PrecisionReporter
from hf_precision.tiny import tiny_batch, tiny_llava
from hf_precision.watch import what_ran


def test_module_doctests() -> None:
    assert doctest.testmod(what_ran).failed == 0


def test_a_onetrainer_style_unet_reports_the_float32_it_ran_not_float16(
    tmp_path: Path, said: Any
) -> None:
    pytest.importorskip("diffusers")
    from hf_precision.frontends.diffusion import guard_diffusion
    from hf_precision.tiny.diffusion import tiny_unet

    unet = tiny_unet().requires_grad_(True)  # trained: float32 under the fp16 preset
    reporter = PrecisionReporter(tmp_path, console=False, picture=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = guard_diffusion({"unet": unet}, "fp16", reporter=reporter)
        engine = guard.guards["unet"]
        # no autocast (OneTrainer's fp16 weights): the guards cast the fp16 latents in, the
        # float32 weights take them back to float32
        latents = torch.randn(2, 4, 8, 8, dtype=torch.float16)
        text = torch.randn(2, 3, 16, dtype=torch.float16)
        out = unet(latents, torch.tensor([1, 2]), encoder_hidden_states=text).sample
    assert out.dtype == torch.float32
    assert engine.policy.compute_dtype == torch.float16  # what the policy means
    found = json.loads((tmp_path / "000000-compute.json").read_text())
    assert found["compute"]["groups"]["unet"] == {
        "compute": "float32",
        "inputs": "float16",
        "output": "float32",
        "autocast": None,
        "meant": "float16",
    }
    [line] = said.about("what ran at the first forward after setup")
    assert "unet float32 (no autocast, inputs float16)" in line
    assert "unet float32 where float16 is meant" in line and "torch.autocast" in line
    # the hooks came off when they fired: nothing stays on the model
    assert not any(
        h for m in unet.modules() for h in m._forward_hooks.values() if "ComputeWatch" in repr(h)
    )
    assert not engine.ran.watch.armed
    # the next event's JSON and group table say what ran
    engine.verify("check", step=1)
    event = json.loads((tmp_path / "000001-check.json").read_text())
    assert event["compute"]["groups"]["unet"]["compute"] == "float32"
    assert event["dtype_map"]["groups"]["unet"]["compute"] == "float32"
    assert [f["source"] for f in event["findings"]] == ["compute"]
    head, _, row = reporter.last_map.table().splitlines()[:3]
    assert head.split()[-2:] == ["compute", "(ran)"] and row.split()[-1] == "float32"
    guard.remove()


def test_a_trainer_with_fp16_on_a_cpu_reports_float32_compute(
    make_trainer: Any, tmp_path: Path
) -> None:
    model = tiny_llava()  # every weight trained: the fp16 preset keeps them float32
    cb = PrecisionGuardCallback(report_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(model, tiny_batch(model), callbacks=[cb], fp16=True)
        trainer.train()
    assert cb.policy is not None and cb.policy.compute_dtype == torch.float16
    end = json.loads(next(tmp_path.glob("*-on_train_end.json")).read_text())
    groups = end["compute"]["groups"]
    assert groups["language_model"]["compute"] == "float32"
    assert groups["language_model"]["meant"] == "float16"
    assert groups["language_model"]["autocast"] is None  # transformers: no autocast on a CPU
    assert end["dtype_map"]["groups"]["language_model"]["compute"] == "float32"
    found = json.loads(next(tmp_path.glob("*-compute.json")).read_text())
    assert "language_model float32 where float16 is meant" in found["finding"]["message"]
