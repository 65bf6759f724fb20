"""The W&B tracker (``hf_precision/report/wandb_tracker.py``): offline runs of a real Trainer
read back from their run files, and W&B disabled, missing, failing or without a run: a warning
once, files still written."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision import PrecisionWarning, dtype_map
from hf_precision.report.plot import PICTURE_SIZE, png_size
from hf_precision.report.reporter import PrecisionReporter
from hf_precision.tiny import tiny_batch, tiny_llava

EVENTS = ("on_init_end", "on_train_begin", "before_evaluate", "on_evaluate")


def _precision_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, PrecisionWarning)]


def _callbacks(guard: Any) -> tuple[Any, Any, dict[str, Any]]:
    """A callback that plants drift before evaluation and one that records the maps the guard
    logs (it runs after the guard, so it sees the model as the guard left it)."""
    from transformers import TrainerCallback

    seen: dict[str, Any] = {}

    class Drift(TrainerCallback):
        def on_step_end(
            self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            if control.should_evaluate:
                model.model.multi_modal_projector.to(torch.float16)

    class Record(TrainerCallback):
        def on_init_end(
            self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            seen["on_init_end"] = dtype_map(model, policy=guard.policy)

        def on_train_begin(
            self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            seen["on_train_begin"] = dtype_map(model, policy=guard.policy)

        def on_step_end(
            self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            if control.should_evaluate:
                seen["before_evaluate"] = dtype_map(model, policy=guard.policy)

        def on_evaluate(
            self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            seen["on_evaluate"] = dtype_map(model, policy=guard.policy)

    return Drift(), Record(), seen


def _table(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    return [dict(zip(data["columns"], row)) for row in data["data"]]


def _logged_numbers(run_dir: Path, key: str) -> list[int]:
    """The values logged under ``key``, read back from the offline run's ``.wandb`` file (each
    history/summary item is the key, then its JSON value after the field tag ``\\x82\\x01``)."""
    import re

    data = next(run_dir.parent.glob("*.wandb")).read_bytes()
    pattern = re.escape(key.encode()) + rb"\x82\x01(.)"
    values = []
    for m in re.finditer(pattern, data, flags=re.DOTALL):
        start = m.end()
        values.append(int(data[start : start + m.group(1)[0]]))
    return values


def test_wandb_disabled_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with pytest.warns(PrecisionWarning, match="W&B is disabled") as record:
        reporter = PrecisionReporter(tmp_path, console=False, wandb=True)
        reporter.log_event("on_train_begin", tiny_llava(), step=0)
        reporter.log_event("on_evaluate", tiny_llava(), step=1)
    assert len([w for w in record if issubclass(w.category, PrecisionWarning)]) == 1
    assert len(list(tmp_path.glob("*.json"))) == 2


def _wandb_trainer(make_trainer: Any, callbacks: list[Any], **kw: Any) -> Any:
    """A Trainer of the tiny LLaVA that reports to W&B and evaluates after step 2."""
    model = tiny_llava()
    return make_trainer(
        model,
        tiny_batch(model),
        report_to=["wandb"],
        eval_strategy="steps",
        eval_steps=2,
        callbacks=callbacks,
        **kw,
    )


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The real ``wandb`` module, its runs offline under ``tmp_path`` (skipped if missing)."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    return wandb


def test_trainer_wandb_offline_tables_match_dtype_map(
    make_trainer: Any, offline_wandb: Any
) -> None:
    wandb = offline_wandb
    from hf_precision import PrecisionGuardCallback

    guard = PrecisionGuardCallback()
    drift, record, seen = _callbacks(guard)
    trainer = _wandb_trainer(make_trainer, [drift, guard, record], run_name="precision-test")
    try:
        with pytest.warns(PrecisionWarning, match="drift repaired"):
            trainer.train()
        run = wandb.run
        assert run is not None, "the reporter must not finish the run WandbCallback owns"
        run_dir = Path(run.dir)
        summary = dict(run.summary)
        assert summary["precision/policy"].startswith("fp32")
        assert summary["precision/bytes/float32"] == seen["on_evaluate"].bytes_by_dtype["float32"]
        for kind in ("found", "repaired", "open"):  # the last event: nothing off the policy
            assert summary[f"precision/mismatches/{kind}"] == 0, kind
        assert "precision/mismatches" not in summary
    finally:
        wandb.finish()

    tables = run_dir / "media" / "table" / "precision"
    pictures: dict[str, bytes] = {}
    for event in EVENTS:
        files = sorted((tables / event).glob("modules_*.table.json"))
        assert len(files) == 1, (event, files)
        want = [{**r, "modules": 1} for r in seen[event].module_rows()]
        assert _table(files[0]) == want, event
        groups = _table(next((tables / event).glob("groups_*.table.json")))
        assert [g["group"] for g in groups] == list(seen[event].groups)
        images = list((run_dir / "media" / "images" / "precision" / event).glob("picture_*.png"))
        assert len(images) == 1 and png_size(images[0].read_bytes()) == PICTURE_SIZE
        pictures[event] = images[0].read_bytes()
    # found / repaired / open, per event: the planted drift found and repaired, none left open
    found = _logged_numbers(run_dir, "precision/mismatches/found")
    assert 4 in found and set(found) == {0, 4}
    assert set(_logged_numbers(run_dir, "precision/mismatches/repaired")) == {0, 4}
    assert set(_logged_numbers(run_dir, "precision/mismatches/open")) == {0}
    # each event's own picture (its title), the one written to the report folder
    assert len(set(pictures.values())) == len(EVENTS)
    out = Path(trainer.args.output_dir) / "precision"
    for event in EVENTS:
        assert pictures[event] == next(out.glob(f"*-{event}.png")).read_bytes(), event
    drift_files = list(tables.glob("drift_*.table.json"))
    assert len(drift_files) == 1, "drift is logged once, after the planted cast"
    rows = _table(drift_files[0])
    assert {r["event"] for r in rows} == {"before_evaluate"}
    assert {r["name"] for r in rows} == {
        f"model.multi_modal_projector.linear_{i}.{k}" for i in (1, 2) for k in ("weight", "bias")
    }
    assert all(r["before"] == "float16" and r["after"] == "float32" and r["repaired"] for r in rows)
    assert {p.name for p in out.glob("*.json")} == {
        "000000-on_init_end.json",
        "000000-on_train_begin.json",
        "000002-before_evaluate.json",
        "000002-on_evaluate.json",
        "000002-on_train_end.json",
    }


def test_wandb_log_failure_warns_once_and_training_goes_on(
    make_trainer: Any, offline_wandb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = offline_wandb
    from hf_precision import PrecisionGuardCallback

    def broken_table(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("W&B is down")

    monkeypatch.setattr(wandb, "Table", broken_table)  # only the reporter builds tables
    trainer = _wandb_trainer(make_trainer, [PrecisionGuardCallback()])
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.train()
        assert wandb.run is not None
    finally:
        wandb.finish()
    msgs = _precision_warnings(record)
    assert len(msgs) == 1 and "W&B is down" in msgs[0] and "files" in msgs[0], msgs
    assert trainer.state.global_step == 2
    assert len(list((Path(trainer.args.output_dir) / "precision").glob("*.json"))) == 5


def test_wandb_missing_warns_once_files_still_written(
    make_trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_precision import PrecisionGuardCallback

    monkeypatch.setitem(sys.modules, "wandb", None)  # simulates wandb not installed
    model = tiny_llava()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = make_trainer(
            model, tiny_batch(model), callbacks=[PrecisionGuardCallback(report_to=["wandb"])]
        )
        trainer.train()
    msgs = _precision_warnings(record)
    assert len(msgs) == 1 and "not installed" in msgs[0], msgs
    assert trainer.state.global_step == 2
    names = {p.name for p in (Path(trainer.args.output_dir) / "precision").iterdir()}
    assert {"000000-on_init_end.json", "000000-on_train_begin.png", "precision.log"} <= names


def test_wandb_asked_without_a_run_warns_once(
    make_trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    from hf_precision import PrecisionGuardCallback

    monkeypatch.setattr(wandb, "run", None)
    model = tiny_llava()
    cb = PrecisionGuardCallback(report_to="wandb")  # but TrainingArguments.report_to is []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = make_trainer(
            model, tiny_batch(model), eval_strategy="steps", eval_steps=1, callbacks=[cb]
        )
        trainer.train()
    msgs = _precision_warnings(record)
    assert len(msgs) == 1 and "no W&B run is active" in msgs[0], msgs
    assert [p.event for p in cb._reporter.wandb.pending][:2] == ["on_init_end", "on_train_begin"]


def test_wandb_goes_offline_only_without_a_login(tmp_path, capsys):
    from hf_precision.report.wandb_tracker import wandb_offline_unless_logged_in

    env = {"HOME": str(tmp_path), "NETRC": str(tmp_path / "netrc")}
    assert wandb_offline_unless_logged_in(env) is True
    assert env["WANDB_MODE"] == "offline"
    assert "wandb sync" in capsys.readouterr().out
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    logged_in = {"HOME": str(tmp_path), "NETRC": str(tmp_path / "netrc")}
    assert wandb_offline_unless_logged_in(logged_in) is False and "WANDB_MODE" not in logged_in
    for env in ({"WANDB_API_KEY": "k"}, {"WANDB_MODE": "disabled"}, {"WANDB_MODE": "offline"}):
        assert wandb_offline_unless_logged_in(dict(env, HOME=str(tmp_path / "x"))) is False


def test_the_sink_asks_its_run_source_at_each_event(tmp_path: Path, offline_wandb: Any) -> None:
    """accelerate's tracker run (or any source) is looked up when an event is logged: payloads
    wait while it gives no run and are logged once it does."""
    wandb = offline_wandb
    runs: list[Any] = [None]
    reporter = PrecisionReporter(
        tmp_path / "p", console=False, wandb=True, wandb_run=lambda: runs[0]
    )
    reporter.log_event("setup", tiny_llava(), step=0)
    assert [p.event for p in reporter.wandb.pending] == ["setup"] and reporter.wandb.logged == []
    run = wandb.init(project="hf-precision-test")
    try:
        runs[0] = run
        reporter.log_event("after_prepare", tiny_llava(), step=1)
        assert reporter.wandb.logged == [("setup", 0), ("after_prepare", 1)]
        assert reporter.wandb.pending == []
    finally:
        wandb.finish()
