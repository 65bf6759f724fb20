"""Reporting: files per event (JSON, picture, log), the module table, other ranks, and a
Trainer whose report folder cannot be written. W&B: tests/report/test_wandb_tracker.py."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision import PrecisionError, PrecisionWarning, dtype_map
from hf_precision.report.plot import PICTURE_SIZE, png_size
from hf_precision.report.reporter import PrecisionReporter
from hf_precision.report.rows import module_table_rows
from hf_precision.report.trackers import wants_wandb
from hf_precision.tiny import tiny_batch, tiny_llava


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


def test_each_model_is_compared_with_itself(tmp_path: Path) -> None:
    """One reporter, several guarded models (kohya prepares its UNet, text encoder and LoRA
    network one by one): an event's drift is against the same model's last event, never
    another model's modules shown as gone."""
    unet, text = torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4))
    reporter = PrecisionReporter(tmp_path, console=False, picture=False)
    reporter.log_event("setup", unet, step=0)
    reporter.log_event("setup", text, step=0)
    text.to(torch.bfloat16)
    reporter.log_event("after_prepare", text, step=0)
    reporter.log_event("after_prepare", unet, step=0)

    def drift(name: str) -> list[dict[str, Any]]:
        return json.loads((tmp_path / name).read_text())["drift"]

    assert drift("000000-setup-2.json") == []  # the text encoder's first event
    assert {(r["name"], r["after"]) for r in drift("000000-after_prepare.json")} == {
        ("0", "bfloat16")
    }
    assert drift("000000-after_prepare-2.json") == []  # the UNet, against its own setup


def test_mismatch_counts_say_found_repaired_and_open(tmp_path: Path) -> None:
    """45 tensors found at init and all cast back are 45 repaired, 0 open; an audit leaves them
    open (the JSON and the log say which)."""
    from hf_precision import PrecisionPolicy, enforce_policy

    for mode, repaired in (("fix", True), ("audit", False)):
        model = tiny_llava()
        model.model.vision_tower.requires_grad_(False)
        policy = PrecisionPolicy.from_preset("bf16", mode=mode)
        report = enforce_policy(model, policy)
        n = len(report.changes)
        assert n == len(list(model.model.vision_tower.parameters())) > 0
        reporter = PrecisionReporter(tmp_path / mode, console=False, picture=False)
        reporter.log_event("on_init_end", model, step=0, policy=policy, report=report)
        data = json.loads((tmp_path / mode / "000000-on_init_end.json").read_text())
        want = {"found": n, "repaired": n if repaired else 0, "open": 0 if repaired else n}
        assert data["mismatches"] == want, mode
        log = (tmp_path / mode / "precision.log").read_text()
        assert (
            f"{n} tensor(s) off the policy: {want['repaired']} repaired, {want['open']} open"
            in (log)
        )


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


# ---------------------------------------------------------------------------- with a Trainer


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
    assert data["mismatches"] == {"found": 4, "repaired": 4, "open": 0} and data["changes"]
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("name", ["report.reporter"])
def test_module_doctests(name: str) -> None:
    import doctest
    import importlib

    module = importlib.import_module(f"hf_precision.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_every_event_has_its_own_files_picture_and_log_line(make_trainer: Any) -> None:
    """train() with an evaluation at its last step, then evaluate(): two on_evaluate events at
    step 2, two sets of files; each picture drawn for its own event (its title), the table
    logged once and later events as "unchanged since"."""
    from hf_precision import PrecisionGuardCallback
    from hf_precision.report.plot import picture_rows, plot_precision

    model = tiny_llava()
    cb = PrecisionGuardCallback()
    trainer = make_trainer(
        model, tiny_batch(model), callbacks=[cb], eval_strategy="steps", eval_steps=2
    )
    trainer.train()
    trainer.evaluate()
    out = Path(trainer.args.output_dir) / "precision"
    stems = [
        "000000-on_init_end",
        "000000-on_train_begin",
        "000002-before_evaluate",
        "000002-on_evaluate",
        "000002-on_train_end",
        "000002-on_evaluate-2",
    ]
    assert sorted(p.name for p in out.glob("*.json")) == sorted(f"{s}.json" for s in stems)
    assert [e for e, _ in cb.events] == [s.split("-", 1)[1].split("-")[0] for s in stems]
    policy = cb.policy
    assert policy is not None
    rows = picture_rows(dtype_map(model, policy=policy), policy=policy, checked=True)
    for stem in stems:
        data = json.loads((out / f"{stem}.json").read_text())
        assert data["picture"] == f"{stem}.png"
        want = plot_precision(
            rows,
            title=f"llava: {data['event']}, step {data['step']}",
            subtitle=f"policy {policy.describe()}",
        )
        assert (out / f"{stem}.png").read_bytes() == want, stem  # not the first event's
    log = (out / "precision.log").read_text()
    assert log.count("┃ group") + log.count("\ngroup ") == 1  # one table, at on_init_end
    for stem in stems[1:]:
        event, step = stem.split("-", 1)[1].split("-")[0], int(stem[:6])
        line = f"hf-precision {event} (step {step}): dtypes/devices unchanged since on_init_end"
        assert f"{line} (step 0); {stem}.json" in log, stem


def test_a_changed_map_logs_the_table_again(tmp_path: Path) -> None:
    model = tiny_llava()
    reporter = PrecisionReporter(tmp_path, console=False, picture=False)
    reporter.log_event("a", model, step=0)
    reporter.log_event("b", model, step=1)
    model.model.multi_modal_projector.to(torch.bfloat16)
    reporter.log_event("c", model, step=2)
    reporter.log_event("d", model, step=3)
    log = (tmp_path / "precision.log").read_text()
    assert "hf-precision b (step 1): dtypes/devices unchanged since a (step 0)" in log
    assert "hf-precision c (step 2)\n" in log  # its own table
    assert "hf-precision d (step 3): dtypes/devices unchanged since c (step 2)" in log
    assert json.loads((tmp_path / "000003-d.json").read_text())["unchanged_since"] == {
        "event": "c",
        "step": 2,
    }


def test_files_of_an_earlier_run_are_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "000000-setup.json").write_text("{}")  # an earlier run in the same folder
    reporter = PrecisionReporter(tmp_path, console=False, picture=False)
    reporter.log_event("setup", tiny_llava(), step=0)
    reporter.log_event("setup", tiny_llava(), step=0)
    assert (tmp_path / "000000-setup.json").read_text() == "{}"
    assert json.loads((tmp_path / "000000-setup-2.json").read_text())["event"] == "setup"
    assert (tmp_path / "000000-setup-3.json").is_file()


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


def test_a_reporter_from_an_accelerator_writes_under_its_project_dir(tmp_path: Path) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    try:
        reporter = PrecisionReporter.from_accelerator(
            Accelerator(cpu=True, project_dir=str(tmp_path))
        )
        assert reporter.report_dir == tmp_path / "precision" and reporter.is_main_process
        assert reporter.wandb is None  # log_with names no wandb
        reporter.log_event("setup", tiny_llava(), step=0)
        assert (tmp_path / "precision" / "000000-setup.json").is_file()
        elsewhere = PrecisionReporter.from_accelerator(
            Accelerator(cpu=True), report_dir=tmp_path / "mine"
        )
        assert elsewhere.report_dir == tmp_path / "mine"
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_a_clean_event_is_drawn_as_the_guard_found_it(tmp_path: Path) -> None:
    """No report: the event's audit found nothing off. Trainable weights a wrapper holds in
    bf16 (DeepSpeed keeps fp32 masters) are not drawn as off the bf16 policy."""
    from hf_precision import PrecisionPolicy
    from hf_precision.report.plot import picture_rows, plot_precision

    model = tiny_llava().to(torch.bfloat16)  # as DeepSpeed bf16 holds every parameter
    policy = PrecisionPolicy.from_preset("bf16")
    reporter = PrecisionReporter(tmp_path, console=False)
    dmap = reporter.log_event("on_train_begin", model, step=0, policy=policy)
    checked = picture_rows(dmap, policy=policy, checked=True)
    assert all(r.verdict == "✓" for r in checked)
    assert any(r.verdict.startswith("✗") for r in picture_rows(dmap, policy=policy))
    want = plot_precision(
        checked, title="llava: on_train_begin, step 0", subtitle=f"policy {policy.describe()}"
    )
    assert (tmp_path / "000000-on_train_begin.png").read_bytes() == want
