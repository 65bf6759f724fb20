"""Who made the NaN (``hf_precision.watch.blame``): a real fp16 overflow in a named module of
a tiny LLaMA, trained by a real ``Trainer`` with the one-line callback, named in the log, the event
JSON and an offline W&B run read back from its files; idle ``auto`` installs no hook."""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision.errors import PrecisionError
from hf_precision.tiny import tiny_text_llama
from hf_precision.watch.blame import FP16_MAX, NonFiniteBlame, blame_batch, check_mode

OVERFLOWING = "model.layers.1.mlp.down_proj"


def _overflowing_llama() -> nn.Module:
    """A tiny LLaMA in float16 whose layer-1 MLP output passes 65504: up_proj x1000 and
    down_proj x1e5 (every weight still finite in float16); only the LM head is trained, so the
    NaN the first step writes does not reach the module that made it."""
    model = tiny_text_llama(torch.float16)
    model.requires_grad_(False)
    model.lm_head.requires_grad_(True)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(1000)
        model.model.layers[1].mlp.down_proj.weight.mul_(1e5)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return model


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(4, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _forward_hooks(model: nn.Module) -> int:
    """The model's forward and backward hooks, less the one-shot hooks that record what ran at
    the next forward (``watch/what_ran``: every event puts them, the forward takes them)."""
    hooks = [
        h
        for m in model.modules()
        for h in (*m._forward_hooks.values(), *m._backward_hooks.values())
    ]
    return sum(not getattr(h, "__qualname__", "").startswith("ComputeWatch.") for h in hooks)


def test_fp16_overflow_named_by_the_one_line_callback(
    make_trainer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    from hf_precision import PrecisionGuardCallback

    model = _overflowing_llama()
    cb = PrecisionGuardCallback()  # blame="auto" by default
    trainer = make_trainer(model, _batch(), callbacks=[cb], max_steps=3, report_to=["wandb"])
    assert _forward_hooks(model) == 0, "auto and idle: no hook at all"
    try:
        with caplog.at_level(logging.WARNING, logger="hf_precision"), warnings.catch_warnings():
            warnings.filterwarnings("ignore")  # the finding goes through logging all the same
            trainer.train()
        summary = dict(wandb.run.summary)
        run_dir = Path(wandb.run.dir)
    finally:
        wandb.finish()
    # Trainer filters the NaN loss out of its log (logging_nan_inf_filter); the gradient norm
    # is what turns non-finite and arms the blame
    assert not torch.isfinite(torch.tensor(trainer.state.log_history[0]["grad_norm"]))
    [finding] = cb.blame.findings
    assert (finding.module, finding.role, finding.kind) == (OVERFLOWING, "producer", "overflow")
    assert finding.phase == "forward" and finding.module_type == "Linear"
    assert finding.input_dtypes == ("float16",) and finding.weight_dtypes == ("float16",)
    assert finding.output_dtype == "float16" and finding.weights_finite
    assert finding.max_abs is not None and finding.max_abs > FP16_MAX
    assert finding.step == 2 and "armed by grad_norm=nan logged at step 1" in finding.trigger
    assert "gone" in finding.note  # the step that made it cannot be re-run by a callback
    assert "bf16=True" in finding.fix
    assert f"keep_fp32=[{'^' + re.escape(OVERFLOWING) + '$'!r}]" in finding.fix
    assert _forward_hooks(model) == 0, "disarmed after the finding"
    # the console line
    lines = [r.getMessage() for r in caplog.records if "hf-precision blame" in r.getMessage()]
    assert len(lines) == 1 and OVERFLOWING in lines[0] and "producer" in lines[0]
    assert "inputs float16, weights float16, output float16" in lines[0]
    assert lines[0] in (Path(trainer.args.output_dir) / "precision" / "precision.log").read_text()
    # the event JSON: its own file, and the section in every later event
    out = Path(trainer.args.output_dir) / "precision"
    record = json.loads((out / "000002-nonfinite.json").read_text())["nonfinite"][0]
    assert record["module"] == OVERFLOWING and record["kind"] == "overflow"
    assert record["max_abs"] == finding.max_abs
    end = json.loads((out / "000003-on_train_end.json").read_text())
    assert [r["module"] for r in end["nonfinite"]] == [OVERFLOWING]
    # W&B: the summary keys, and the table read back from the run's files
    assert summary["precision/nonfinite/module"] == OVERFLOWING
    assert summary["precision/nonfinite/kind"] == "overflow"
    [table] = (run_dir / "media" / "table" / "precision").glob("nonfinite_*.table.json")
    data = json.loads(table.read_text())
    rows = [dict(zip(data["columns"], r)) for r in data["data"]]
    assert [(r["module"], r["role"], r["output_dtype"]) for r in rows] == [
        (OVERFLOWING, "producer", "float16")
    ]


def test_blame_off_and_idle_auto_install_nothing(make_trainer: Any) -> None:
    from hf_precision import PrecisionGuardCallback

    model = tiny_text_llama(torch.float32)
    counts: list[int] = []
    from transformers import TrainerCallback

    class Count(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            counts.append(_forward_hooks(model))

    before = _forward_hooks(model)
    cb = PrecisionGuardCallback()
    make_trainer(model, _batch(), callbacks=[cb, Count()], max_steps=2).train()
    assert counts == [before, before] and cb.blame is not None and not cb.blame.armed
    assert cb.blame.findings == []
    off = PrecisionGuardCallback(blame="off")
    make_trainer(model, _batch(), callbacks=[off, Count()], max_steps=1).train()
    assert off.blame is not None and off.blame.mode == "off"
    off.blame.arm("on request")
    assert off.blame.hooks_installed() == 0, "off never installs hooks"


def test_always_inspects_each_step_and_disarm_removes_every_hook() -> None:
    model = _overflowing_llama()
    blame = NonFiniteBlame(model, "always")
    n = sum(1 for _ in model.modules())
    assert _forward_hooks(model) == blame.hooks_installed() > n  # forward + backward hooks
    model(**_batch()).loss.backward()
    finding = blame.collect(step=0)
    assert finding is not None and finding.module == OVERFLOWING
    assert "this step's batch" in finding.note
    blame.disarm()
    assert _forward_hooks(model) == 0


def test_a_propagator_and_weights_already_poisoned() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    blame = NonFiniteBlame(model, "always")
    model(torch.full((1, 4), float("nan")))
    finding = blame.collect(step=3)
    assert finding is not None and (finding.module, finding.role) == ("0", "propagator")
    assert finding.kind == "nan" and "batch" in finding.fix
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    model(torch.ones(1, 4))
    finding = blame.collect(step=4)
    assert finding is not None and finding.module == "1" and not finding.weights_finite
    assert "earlier step" in finding.fix


def test_backward_only_names_the_module_whose_input_gradient_turned_non_finite() -> None:
    class Blowup(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * float("inf")

    class Bad(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Blowup.apply(super().forward(x))

    model = nn.Sequential(nn.Linear(4, 4), Bad(4, 4), nn.Linear(4, 1))
    blame = NonFiniteBlame(model, "off")
    blame.mode = "auto"
    assert blame.observe({"loss": 1.0, "grad_norm": float("inf")}, step=5)
    model(torch.ones(2, 4)).sum().backward()
    finding = blame.collect(step=6)
    assert finding is not None and (finding.module, finding.phase) == ("1", "backward")
    assert finding.role == "producer" and blame.hooks_installed() == 0


def test_doctor_reruns_the_same_batch() -> None:
    model = _overflowing_llama()
    finding = blame_batch(model, _batch())
    assert finding is not None and finding.module == OVERFLOWING
    assert finding.note == "the same batch, re-run" and _forward_hooks(model) == 0


def test_a_bad_mode_is_refused_with_the_modes() -> None:
    with pytest.raises(PrecisionError, match="'auto'.*'always'.*'off'"):
        check_mode("sometimes", call="PrecisionGuardCallback")
    from hf_precision import PrecisionGuardCallback

    with pytest.raises(PrecisionError, match="blame='on'"):
        PrecisionGuardCallback(blame="on")  # type: ignore[arg-type]


def test_doctor_blame_reruns_the_batch_of_a_checkpoint(tmp_path: Path, capsys: Any) -> None:
    from hf_precision.tools.cli import main

    _overflowing_llama().save_pretrained(tmp_path / "ckpt")
    argv = ["doctor", str(tmp_path / "ckpt"), "--policy", "fp16-true", "--no-generate"]
    assert main([*argv, "--blame", "off"]) == 0  # nothing looks: the step "runs"
    assert "hf-precision blame" not in capsys.readouterr().out
    assert main([*argv, "--json"]) == 1  # auto: the loss is NaN, the same batch re-run armed
    found = json.loads(capsys.readouterr().out)["nonfinite"]
    assert (found["module"], found["role"], found["kind"]) == (OVERFLOWING, "producer", "overflow")
    assert found["note"] == "the same batch, re-run" and found["max_abs"] > FP16_MAX
    assert main([*argv, "--blame", "always"]) == 1
    out = capsys.readouterr().out
    assert f"(doctor, blame='always'; the same batch, re-run): {OVERFLOWING}" in out
    assert f"FAILED: train ok; {OVERFLOWING} made overflow values (producer)" in out


def test_the_launcher_variable_sets_the_blame(launched: Any, make_trainer: Any) -> None:
    from hf_precision import PrecisionGuardCallback
    from hf_precision.integrations.launch_cli import command_env
    from hf_precision.integrations.launch_config import LaunchConfig

    def guard(trainer: Any) -> Any:
        [cb] = [
            c for c in trainer.callback_handler.callbacks if isinstance(c, PrecisionGuardCallback)
        ]
        return cb

    model = tiny_text_llama()
    assert guard(make_trainer(model, _batch())).blame_mode == "auto"
    launched.setenv("HF_PRECISION_BLAME", "off")
    launched.setenv("HF_PRECISION_TRACE", "1")
    cb = guard(make_trainer(model, _batch()))
    assert cb.blame_mode == "off" and cb.trace is True
    launched.setenv("HF_PRECISION_BLAME", "alwys")
    with pytest.raises(PrecisionError, match="HF_PRECISION_BLAME='alwys'.*'always'"):
        make_trainer(model, _batch())
    env = command_env(["python", "t.py"], blame="always", trace=True, environ={})
    assert env["HF_PRECISION_BLAME"] == "always" and env["HF_PRECISION_TRACE"] == "1"
    config = LaunchConfig.from_env(env)
    assert (config.blame, config.trace) == ("always", True)


def test_the_accelerate_plugin_is_armed_by_the_loss_it_sees(tmp_path: Path) -> None:
    from accelerate import Accelerator

    from hf_precision import PrecisionGuardPlugin

    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    guard = PrecisionGuardPlugin()
    model = _overflowing_llama()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optimizer = guard.prepare(accelerator, model, optimizer)
    [blame] = guard.blames
    for _ in range(2):
        assert _forward_hooks(model) == 0 or blame.armed
        loss = model(**_batch()).loss
        guard.observe(loss=loss)  # step 1: NaN -> armed; step 2: inspected
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    [finding] = blame.findings
    assert (finding.module, finding.kind, finding.step) == (OVERFLOWING, "overflow", 2)
    assert "armed by loss=" in finding.trigger and _forward_hooks(model) == 0
    record = json.loads((tmp_path / "precision" / "000002-nonfinite.json").read_text())
    assert record["nonfinite"][0]["module"] == OVERFLOWING
    guard.remove()


def test_the_plugin_blames_on_request_and_never_when_off(tmp_path: Path) -> None:
    from accelerate import Accelerator

    from hf_precision import PrecisionGuardPlugin

    model = _overflowing_llama()
    off = PrecisionGuardPlugin(blame="off", report=False)
    model = off.prepare(Accelerator(cpu=True), model)
    assert not off.observe(loss=float("nan"))
    off.blame_next_step()
    assert _forward_hooks(model) == 0
    off.remove()
    on = PrecisionGuardPlugin(report=False)
    model = on.prepare(Accelerator(cpu=True), model)
    on.blame_next_step(backward=False)
    model(**_batch())
    [finding] = on._blame_step()
    assert finding.module == OVERFLOWING and "on request" in finding.trigger
    assert _forward_hooks(model) == 0


DOC = Path(__file__).resolve().parents[2] / "docs" / "silent_losses.md"


def _doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(_doc_blocks())))
def test_the_silent_losses_page_runs(index: int, tmp_path: Path, monkeypatch: Any) -> None:
    """docs/silent_losses.md's Python blocks run, and print what the page shows."""
    monkeypatch.chdir(tmp_path)
    exec(compile(_doc_blocks()[index], f"docs/silent_losses.md block {index}", "exec"), {})


def test_the_silent_losses_page_shows_both() -> None:
    text = DOC.read_text()
    assert "## Who made the NaN" in text and "## Where the activation dtype changed" in text
    assert len(_doc_blocks()) >= 2  # and the headroom probe's
