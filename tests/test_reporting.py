"""Reporting: files per event, the picture, W&B offline runs read back, W&B missing/failing."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision import PrecisionError, PrecisionWarning, dtype_map
from hf_precision.plot import PICTURE_SIZE, png_size
from hf_precision.reporting import PrecisionReporter, module_table_rows, wants_wandb
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


# ---------------------------------------------------------------------------- units
def test_wants_wandb_follows_report_to_and_rejects_typos() -> None:
    assert wants_wandb(["wandb"]) and wants_wandb("all") and wants_wandb(["tensorboard", "wandb"])
    assert not wants_wandb([]) and not wants_wandb("none") and not wants_wandb(["tensorboard"])
    with pytest.raises(PrecisionError, match=r"(?s)unknown integration 'wandbb'.*'wandb'.*Allowed"):
        wants_wandb(["wandbb"], call="PrecisionGuardCallback(report_to)")


def test_module_table_aggregates_without_dropping_anything() -> None:
    dmap = dtype_map(tiny_llava())
    full, folded = module_table_rows(dmap)
    assert folded == 0 and [{k: v for k, v in r.items() if k != "modules"} for r in full] == (
        dmap.module_rows()
    )
    rows, folded = module_table_rows(dmap, max_rows=10)
    assert folded == len(dmap) - len(rows) > 0
    assert any("*" in r["path"] for r in rows)
    for key in ("numel", "bytes", "trainable", "modules"):
        assert sum(r[key] for r in rows) == sum(r[key] for r in full), key


def test_files_picture_and_drift_per_event(tmp_path: Path) -> None:
    model = tiny_llava()
    reporter = PrecisionReporter(tmp_path / "precision")
    first = reporter.log_event("on_train_begin", model, step=0)
    model.model.vision_tower.to(torch.bfloat16)
    reporter.log_event("on_evaluate", model, step=3)

    data = json.loads((tmp_path / "precision" / "000000-on_train_begin.json").read_text())
    assert data["dtype_map"] == first.to_dict() and data["drift"] == []
    later = json.loads((tmp_path / "precision" / "000003-on_evaluate.json").read_text())
    drifted = {r["name"] for r in later["drift"]}
    assert "model.vision_tower.embeddings.patch_embedding" in drifted
    assert all(r["before"] == "float32" and r["after"] == "bfloat16" for r in later["drift"])
    assert later["bytes_by_dtype"]["bfloat16"] > 0

    from PIL import Image

    for name in ("000000-on_train_begin.png", "000003-on_evaluate.png"):
        png = (tmp_path / "precision" / name).read_bytes()
        assert png_size(png) == PICTURE_SIZE
        with Image.open(tmp_path / "precision" / name) as img:
            img.verify()
            assert img.size == PICTURE_SIZE
    log = (tmp_path / "precision" / "precision.log").read_text()
    assert "vision_encoder" in log and "drift (" in log


def test_plain_table_when_rich_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    dmap = dtype_map(tiny_llava())
    for name in ("rich", "rich.console", "rich.table"):  # simulates rich not installed
        monkeypatch.setitem(sys.modules, name, None)
    text = dmap.table(title="t", use_rich=None)
    assert text.startswith("t\ngroup") and "language_model" in text
    with pytest.raises(ImportError):
        dmap.table(use_rich=True)
    # the plain table: one aligned row per group, the numbers right-aligned under their heads
    lines = text.splitlines()
    assert lines[1].split() == [
        "group",
        "dtypes",
        "(params)",
        "devices",
        "params",
        "bytes",
        "trainable",
    ]
    vision = next(line for line in lines if line.startswith("vision_encoder"))
    total = sum(dmap.groups["vision_encoder"].numel.values())
    assert vision.rstrip().endswith(f"{dmap.groups['vision_encoder'].trainable:,}")
    assert f"{total:,}" in vision


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    reporter = PrecisionReporter(tmp_path / "p", is_main_process=False, wandb=True)
    reporter.log_event("on_train_begin", tiny_llava(), step=0)
    assert reporter.wandb is None and not (tmp_path / "p").exists()


def test_wandb_disabled_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with pytest.warns(PrecisionWarning, match="W&B is disabled") as record:
        reporter = PrecisionReporter(tmp_path, console=False, wandb=True)
        reporter.log_event("on_train_begin", tiny_llava(), step=0)
        reporter.log_event("on_evaluate", tiny_llava(), step=1)
    assert len([w for w in record if issubclass(w.category, PrecisionWarning)]) == 1
    assert len(list(tmp_path.glob("*.json"))) == 2


# ---------------------------------------------------------------------------- Trainer + W&B
def test_trainer_wandb_offline_tables_match_dtype_map(
    make_trainer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    from hf_precision import PrecisionGuardCallback

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    guard = PrecisionGuardCallback()
    drift, record, seen = _callbacks(guard)
    model = tiny_llava()
    trainer = make_trainer(
        model,
        tiny_batch(model),
        report_to=["wandb"],
        eval_strategy="steps",
        eval_steps=2,
        run_name="precision-test",
        callbacks=[drift, guard, record],
    )
    try:
        with pytest.warns(PrecisionWarning, match="drift repaired"):
            trainer.train()
        run = wandb.run
        assert run is not None, "the reporter must not finish the run WandbCallback owns"
        run_dir = Path(run.dir)
        summary = dict(run.summary)
        assert summary["precision/policy"].startswith("fp32")
        assert summary["precision/bytes/float32"] == seen["on_evaluate"].bytes_by_dtype["float32"]
        assert summary["precision/mismatches"] == 0  # the last event (after the repair)
    finally:
        wandb.finish()

    tables = run_dir / "media" / "table" / "precision"
    for event in EVENTS:
        files = sorted((tables / event).glob("modules_*.table.json"))
        assert len(files) == 1, (event, files)
        want = [{**r, "modules": 1} for r in seen[event].module_rows()]
        assert _table(files[0]) == want, event
        groups = _table(next((tables / event).glob("groups_*.table.json")))
        assert [g["group"] for g in groups] == list(seen[event].groups)
        images = list((run_dir / "media" / "images" / "precision" / event).glob("bytes_*.png"))
        assert len(images) == 1 and png_size(images[0].read_bytes()) == PICTURE_SIZE
    drift_files = list(tables.glob("drift_*.table.json"))
    assert len(drift_files) == 1, "drift is logged once, after the planted cast"
    rows = _table(drift_files[0])
    assert {r["event"] for r in rows} == {"before_evaluate"}
    assert {r["name"] for r in rows} == {
        f"model.multi_modal_projector.linear_{i}.{k}" for i in (1, 2) for k in ("weight", "bias")
    }
    assert all(r["before"] == "float16" and r["after"] == "float32" and r["repaired"] for r in rows)
    out = Path(trainer.args.output_dir) / "precision"
    assert {p.name for p in out.glob("*.json")} == {
        "000000-on_init_end.json",
        "000000-on_train_begin.json",
        "000002-before_evaluate.json",
        "000002-on_evaluate.json",
        "000002-on_train_end.json",
    }


def test_wandb_log_failure_warns_once_and_training_goes_on(
    make_trainer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    from hf_precision import PrecisionGuardCallback

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))

    def broken_table(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("W&B is down")

    monkeypatch.setattr(wandb, "Table", broken_table)  # only the reporter builds tables
    model = tiny_llava()
    trainer = make_trainer(
        model,
        tiny_batch(model),
        report_to=["wandb"],
        eval_strategy="steps",
        eval_steps=2,
        callbacks=[PrecisionGuardCallback()],
    )
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


def test_drift_found_after_a_standalone_evaluate_is_in_the_files(make_trainer: Any) -> None:
    """A callback casts the projector during evaluate(); the guard's on_evaluate (which runs
    after it) repairs it and the event's JSON lists every tensor it found off-policy."""
    from transformers import TrainerCallback

    from hf_precision import PrecisionGuardCallback

    class CastProjector(TrainerCallback):
        def on_evaluate(
            self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            model.model.multi_modal_projector.to(torch.bfloat16)

    model = tiny_llava()
    trainer = make_trainer(
        model, tiny_batch(model), callbacks=[CastProjector(), PrecisionGuardCallback()]
    )
    with pytest.warns(PrecisionWarning, match="drift repaired"):
        trainer.evaluate()
    data = json.loads(
        (Path(trainer.args.output_dir) / "precision" / "000000-on_evaluate.json").read_text()
    )
    rows = data["drift"]
    assert {r["name"] for r in rows} == {
        f"model.multi_modal_projector.linear_{i}.{k}" for i in (1, 2) for k in ("weight", "bias")
    }
    assert all(
        r["before"] == "bfloat16" and r["after"] == "float32" and r["repaired"] for r in rows
    )
    assert data["mismatches"] == 4 and data["changes"]
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("name", ["reporting", "plot"])
def test_module_doctests(name: str) -> None:
    import doctest
    import importlib

    module = importlib.import_module(f"hf_precision.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_wandb_goes_offline_only_without_a_login(tmp_path, capsys):
    from hf_precision.report_wandb import wandb_offline_unless_logged_in

    env = {"HOME": str(tmp_path), "NETRC": str(tmp_path / "netrc")}
    assert wandb_offline_unless_logged_in(env) is True
    assert env["WANDB_MODE"] == "offline"
    assert "wandb sync" in capsys.readouterr().out
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    logged_in = {"HOME": str(tmp_path), "NETRC": str(tmp_path / "netrc")}
    assert wandb_offline_unless_logged_in(logged_in) is False and "WANDB_MODE" not in logged_in
    for env in ({"WANDB_API_KEY": "k"}, {"WANDB_MODE": "disabled"}, {"WANDB_MODE": "offline"}):
        assert wandb_offline_unless_logged_in(dict(env, HOME=str(tmp_path / "x"))) is False


def _train_with_report_dir(make_trainer: Any, report_dir: Path) -> tuple[Any, list[str]]:
    from hf_precision import PrecisionGuardCallback

    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)  # something to cast and report
    cb = PrecisionGuardCallback("bf16", report_dir=report_dir)  # a Path, as users pass it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", PrecisionWarning)
        trainer = make_trainer(
            model, tiny_batch(model), callbacks=[cb], eval_strategy="steps", eval_steps=1
        )
        out = trainer.train()
        trainer.evaluate()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    msgs = [str(w.message) for w in seen if "hf-precision report:" in str(w.message)]
    return cb, msgs


def test_an_unwritable_report_dir_warns_once_and_training_goes_on(
    make_trainer: Any, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cb, msgs = _train_with_report_dir(make_trainer, blocker / "precision")
    assert len(msgs) == 1, msgs  # once, although every event failed to write
    assert "could not write the dtype map of on_init_end" in msgs[0]
    assert "NotADirectoryError" in msgs[0] and "report_dir=<a writable folder>" in msgs[0]
    assert len(cb.events) >= 5  # every event still ran


def test_a_full_disk_warns_once_and_training_goes_on(make_trainer: Any, tmp_path: Path) -> None:
    full = Path("/dev/full")
    if not full.exists():
        pytest.skip("needs /dev/full (Linux) to make writes fail with ENOSPC")
    report_dir = tmp_path / "precision"
    report_dir.mkdir()
    (report_dir / "precision.log").symlink_to(full)  # every append fails: no space left
    (report_dir / "000000-on_init_end.json").symlink_to(full)
    _, msgs = _train_with_report_dir(make_trainer, report_dir)
    assert len(msgs) == 1, msgs
    assert "No space left on device" in msgs[0] or "ENOSPC" in msgs[0] or "Errno 28" in msgs[0]
    # events that could be written still were
    assert (report_dir / "000000-on_train_begin.json").is_file()
