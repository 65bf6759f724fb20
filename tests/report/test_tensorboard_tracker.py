"""TensorBoard: the dtype maps go into the event files of the tracker the script set up (the
accelerator's TensorBoard tracker, transformers' TensorBoardCallback), read back with
TensorBoard's own EventAccumulator; a missing tensorboard is said once, only when asked for."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision import PrecisionGuardCallback, PrecisionGuardPlugin, PrecisionWarning
from hf_precision.frontends.diffusion import guard_diffusion
from hf_precision.report import tensorboard_tracker
from hf_precision.report.reporter import PrecisionReporter
from hf_precision.tiny import OneTrainerTiny, tiny_batch, tiny_llava

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)

#: AcceleratorState is a process-wide singleton: each test gets its own (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def _events(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return acc


def _text(acc: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    """(step, text) of a text tag (torch's add_text stores ``<tag>/text_summary``)."""
    return [
        (e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")
    ]


def _scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _json(folder: Path, stem: str) -> dict[str, Any]:
    return json.loads((folder / f"{stem}.json").read_text())


def test_the_plugin_logs_into_the_accelerators_own_tensorboard_writer(tmp_path: Path) -> None:
    """diffusers' order: prepare before init_trackers. The events wait for the tracker's writer
    and go into the event file the script logs its loss to: one file, no second writer."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16).requires_grad_(False)  # off the fp32 policy
    batch = tiny_batch(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    guard = PrecisionGuardPlugin("fp32")
    model, optimizer = guard.prepare(accelerator, model, optimizer)
    sink = guard._reporter.trackers["tensorboard"]
    assert [p.event for p in sink.pending] == ["setup", "after_prepare"]  # no writer yet
    accelerator.init_trackers("run")
    loss = model(**batch).loss
    accelerator.backward(loss)
    optimizer.step()  # the plugin's step hook: the waiting events go now
    accelerator.log({"loss": loss.item()}, step=1)
    assert sink.logged == [("setup", 0), ("after_prepare", 0)] and sink.pending == []
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    accelerator.end_training()

    run_dir = Path(writer.log_dir)
    assert run_dir == tmp_path / "run"
    files = list(run_dir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # the script's own event file, not a second one
    acc = _events(files[0])
    setup = _json(tmp_path / "precision", "000000-setup")
    assert setup["mismatches"]["repaired"] > 0  # the fp16 tower cast back to fp32
    for kind in ("found", "repaired", "open"):
        assert _scalars(acc, f"precision/mismatches/{kind}")[0] == (0, setup["mismatches"][kind])
    assert _scalars(acc, "precision/mismatches/repaired")[1] == (0, 0)  # after_prepare: clean
    assert _scalars(acc, "precision/bytes/float32")[0] == (
        0,
        pytest.approx(setup["bytes_by_dtype"]["float32"], rel=1e-6),
    )
    assert _scalars(acc, "loss") == [(1, pytest.approx(loss.item()))]  # the script's, same file
    (step, table), *_ = _text(acc, "precision/setup/modules")
    assert step == 0 and table.startswith("| path | group | type | dtypes |")
    assert "| model.vision_tower" in table and "float16" not in table  # the map after the cast
    drift = _text(acc, "precision/drift")[0][1]
    assert "float16 | float32" in drift  # before -> after of the repaired tower
    assert _text(acc, "precision/policy")[0][1].startswith("fp32")


def test_guard_diffusion_writes_into_the_accelerators_writer(tmp_path: Path) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("sd")
    reporter = PrecisionReporter.from_accelerator(accelerator)
    unet = OneTrainerTiny().requires_grad_(False)
    guard = guard_diffusion({"unet": unet}, "bf16-vae32", reporter=reporter, step=3)
    guard.remove()
    accelerator.end_training()
    acc = _events(tmp_path / "sd")
    data = _json(tmp_path / "precision", "000003-setup")
    assert data["mismatches"]["repaired"] == len(guard.reports["unet"].changes) > 0
    assert _scalars(acc, "precision/mismatches/repaired") == [(3, data["mismatches"]["repaired"])]
    assert _scalars(acc, "precision/bytes/bfloat16") == [
        (3, pytest.approx(data["bytes_by_dtype"]["bfloat16"], rel=1e-6))
    ]
    assert "bfloat16" in _text(acc, "precision/setup/groups")[0][1]
    assert len(acc.Images("precision/setup/picture")) == int(reporter.picture)


def test_the_callback_logs_into_the_trainers_tensorboard_callback(make_trainer: Any) -> None:
    """report_to=["tensorboard"]: the dtype maps go into the writer of transformers'
    TensorBoardCallback (its folder, its event file), beside the Trainer's train/loss."""
    from transformers.integrations import TensorBoardCallback

    model = tiny_llava()
    model.model.vision_tower.to(torch.float16).requires_grad_(False)
    cb = PrecisionGuardCallback("fp32")
    trainer = make_trainer(model, tiny_batch(model), callbacks=[cb], report_to=["tensorboard"])
    trainer.train()
    (tb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, TensorBoardCallback)]
    folder = Path(tb.logging_dir)
    assert folder.parent.parent == Path(trainer.args.output_dir)  # <output_dir>/runs/<date_host>
    files = sorted(folder.glob("events.out.tfevents.*"))
    acc = _events(files[0])  # the TensorBoardCallback's file
    assert [s for s, _ in _scalars(acc, "train/loss")] == [1, 2]
    init = _json(Path(trainer.args.output_dir) / "precision", "000000-on_init_end")
    assert init["mismatches"]["repaired"] > 0
    # on_init_end waited for the callback's writer (made at on_train_begin), then both went
    assert _scalars(acc, "precision/mismatches/repaired") == [
        (0, init["mismatches"]["repaired"]),
        (0, 0),
    ]
    assert [s for s, _ in _text(acc, "precision/on_train_begin/modules")] == [0]
    # on_train_end: the TensorBoardCallback closed its writer first; a writer of our own in
    # the same folder (TensorBoard reads it as the same run)
    assert cb.reporter.trackers["tensorboard"].logged[-1] == ("on_train_end", 2)
    rest = _events(folder)
    assert [s for s, _ in _text(rest, "precision/on_train_end/modules")] == [2]


def test_a_missing_tensorboard_is_said_once_and_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("tensorboard", "tensorboardX"):
        monkeypatch.setitem(sys.modules, name, None)  # simulates tensorboard not installed
    monkeypatch.setattr(tensorboard_tracker, "_said_missing", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        quiet = PrecisionReporter(tmp_path / "q", console=False, picture=False)
        quiet.log_event("setup", tiny_llava(), step=0)
        assert not [w for w in record if issubclass(w.category, PrecisionWarning)]
        for folder in ("a", "b"):
            reporter = PrecisionReporter(
                tmp_path / folder, console=False, picture=False, trackers={"tensorboard": None}
            )
            reporter.log_event("setup", tiny_llava(), step=0)
            assert (tmp_path / folder / "000000-setup.json").is_file()  # the files still go
    msgs = [str(w.message) for w in record if issubclass(w.category, PrecisionWarning)]
    assert len(msgs) == 1 and "tensorboard is not installed" in msgs[0], msgs
    assert "pip install tensorboard" in msgs[0]


def test_a_failing_writer_warns_once_and_the_files_go_on(tmp_path: Path) -> None:
    class Broken:
        def add_scalar(self, *args: Any, **kwargs: Any) -> None:
            raise OSError("disk full")

    reporter = PrecisionReporter(
        tmp_path, console=False, picture=False, trackers={"tensorboard": Broken}
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in (0, 1):
            reporter.log_event("on_evaluate", tiny_llava(), step=step)
    msgs = [str(w.message) for w in record if issubclass(w.category, PrecisionWarning)]
    assert len(msgs) == 1 and "to TensorBoard (OSError: disk full)" in msgs[0], msgs
    assert "report_to without 'tensorboard'" in msgs[0]
    assert {p.name for p in tmp_path.glob("*.json")} == {
        "000000-on_evaluate.json",
        "000001-on_evaluate.json",
    }


def test_markdown_table_escapes_cells() -> None:
    table = tensorboard_tracker.markdown_table(["a"], [["x|y\nz"]])
    assert table.splitlines() == ["| a |", "|---|", "| x\\|y z |"]
