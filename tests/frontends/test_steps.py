"""The per-step work the front ends share (:mod:`hf_precision.frontends.steps`): one
``StepWatch`` that the Trainer callback and the accelerate plugin each hold, with the same blame
and lost-update behaviour through it (the real Trainer and accelerate loops are in
test_callback.py and test_accelerate_plugin.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import PrecisionGuardCallback, PrecisionGuardPlugin
from hf_precision.frontends.steps import StepWatch

#: AcceleratorState is a process-wide singleton: each test gets its own (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def _blowup() -> nn.Module:
    """A real inf: finite float32 weights of 1e38 times an input of 10 pass float32's range."""
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1e38)
    return model


def _through_the_callback(model: nn.Module, folder: Path, tiny_args: Any) -> Any:
    """The callback's own events: a NaN loss logged at step 1 arms the blame, step 2's forward
    is inspected when the step ends."""
    from transformers import TrainerControl, TrainerState

    callback = PrecisionGuardCallback("fp32", report_dir=folder)
    args, state, control = tiny_args(), TrainerState(), TrainerControl()
    callback.on_init_end(args, state, control, model=model)
    state.global_step = 1
    callback.on_log(args, state, control, logs={"loss": float("nan")})
    model(torch.full((2, 4), 10.0))
    state.global_step = 2
    callback.on_step_end(args, state, control, model=model)
    assert callback.blame is callback.step_watch.blames[0]
    return callback


def _through_the_plugin(model: nn.Module, folder: Path, tiny_args: Any) -> Any:
    """The plugin's own calls in a real accelerate loop: ``observe`` arms the blame, the next
    optimizer step (step 2) reads what the forward saw."""
    from accelerate import Accelerator

    plugin = PrecisionGuardPlugin("fp32", report_dir=folder)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = plugin.prepare(Accelerator(cpu=True), model, optimizer)
    optimizer.step()  # step 1
    plugin.observe(loss=float("nan"))
    model(torch.full((2, 4), 10.0))
    optimizer.step()  # step 2
    assert plugin.blames is plugin.step_watch.blames
    return plugin


@pytest.mark.parametrize("front", [_through_the_callback, _through_the_plugin])
def test_both_front_ends_blame_through_their_step_watch(front, tmp_path, tiny_args, said):
    model = _blowup()
    held = front(model, tmp_path / "precision", tiny_args)
    watch = held.step_watch
    assert isinstance(watch, StepWatch)
    [blame] = watch.blames
    [finding] = blame.findings
    assert (finding.module, finding.kind, finding.role, finding.step) == ("0", "inf", "producer", 2)
    assert "armed by loss=nan logged at step 1" in finding.trigger
    assert not blame.armed  # auto: disarmed after its finding
    # said once, through the engine's speaker, and written by the front end's reporter
    assert len(said.about("made inf in the forward pass at step 2")) == 1
    record = json.loads((tmp_path / "precision" / "000002-nonfinite.json").read_text())
    assert record["nonfinite"][0]["module"] == "0"


def test_a_skipped_step_arms_auto_and_a_request_arms_all_but_off():
    watch = StepWatch(blame="auto", speaker=lambda: None, reporter=lambda: None)
    auto = watch.add_model(nn.Linear(2, 2))
    assert watch.end_step(3) == [] and not auto.armed
    assert watch.end_step(4, skipped=True) == [] and auto.armed
    assert auto.trigger == "armed by a step the GradScaler skipped before step 4"
    watch.stop()
    assert not auto.armed
    off = StepWatch(blame="off", speaker=lambda: None, reporter=lambda: None)
    quiet = off.add_model(nn.Linear(2, 2))
    off.arm("on request")
    assert not off.observe({"loss": float("nan")}, step=1) and not quiet.armed


def test_the_lost_update_check_starts_once_per_model_and_never_when_off(said):
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    plugin = PrecisionGuardPlugin("fp32", report=False)
    plugin.setup(first)
    plugin.setup(second)
    a, b = plugin.guards
    optimizer = torch.optim.SGD(first.parameters(), lr=1e-3)
    watch = StepWatch(blame="off", speaker=lambda: a.speaker, reporter=lambda: None)
    watch.watch_updates(a, optimizer, fix="the fix, in the front end's words")
    check = watch.lost
    watch.watch_updates(a, optimizer)
    assert check is not None and watch.lost is check  # once per model
    for _ in range(3):
        first(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    assert not check.active and a.sections["lost_updates"]["steps"] == 3
    assert said.about("update check passed")  # float32: what was measured
    watch.watch_updates(b, torch.optim.SGD(second.parameters(), lr=1e-3))
    assert watch.lost is not check and watch.lost.root is second  # another model: its own
    watch.stop(updates=True)
    assert not watch.lost.active
    off = StepWatch(blame="off", lost_updates="off", speaker=lambda: None, reporter=lambda: None)
    off.watch_updates(a, optimizer)
    assert off.lost is None
