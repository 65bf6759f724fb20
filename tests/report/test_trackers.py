"""The tracker interface: which trackers a report_to asks for, and a new tracker is one module
and one table entry (here a recording tracker registered as a module of the package)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hf_precision import PrecisionError
from hf_precision.report import trackers
from hf_precision.report.reporter import PrecisionReporter
from hf_precision.report.trackers import Tracker, wanted_trackers
from hf_precision.tiny import tiny_llava


def test_wanted_trackers_follow_report_to() -> None:
    assert wanted_trackers(["TensorBoard", "wandb"]) == ("wandb", "tensorboard")
    assert wanted_trackers(["tensorboard", "none"]) == () and wanted_trackers(None) == ()
    assert wanted_trackers(["mlflow"]) == ()  # known to transformers, not adapted here
    assert wanted_trackers("all") == ("wandb", "tensorboard")  # tensorboard is installed here
    with pytest.raises(PrecisionError, match=r"(?s)unknown integration 'tensorbord'.*tensorboard"):
        wanted_trackers(["tensorbord"])
    with pytest.raises(PrecisionError, match=r"no tracker 'tensorbord'.*'tensorboard'"):
        PrecisionReporter(None, trackers={"tensorbord": None})


class Recorder:
    label = "Recorder"
    enabled = True

    def __init__(self, source: Any) -> None:
        self.source, self.payloads, self.flushed = source, [], 0

    def submit(self, payload: Any, *, may_warn_no_run: bool) -> None:
        self.payloads.append((payload, may_warn_no_run))

    def flush(self) -> None:
        self.flushed += 1


def test_a_new_tracker_is_one_module_and_one_table_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = types.ModuleType("hf_precision.report.report_recorder")
    module.Sink = Recorder  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(trackers.TRACKERS, "recorder", "report_recorder")
    reporter = PrecisionReporter(tmp_path, console=False, picture=False, trackers={"recorder": 1})
    sink = reporter.trackers["recorder"]
    assert isinstance(sink, Tracker) and sink.source == 1
    dmap = reporter.log_event("setup", tiny_llava(), step=5)
    reporter.flush_trackers()
    ((payload, may_warn_no_run),) = sink.payloads
    assert not may_warn_no_run and payload.event == "setup" and payload.step == 5
    assert payload.scalars["precision/bytes/float32"] == dmap.bytes_by_dtype["float32"]
    assert payload.scalars["precision/kept"] == 0 and sink.flushed == 1
    assert len(payload.module_rows) == len(dmap) and payload.module_columns[0] == "path"


@pytest.mark.parametrize("name", sorted(trackers.TRACKERS))
def test_every_tracker_of_the_table_is_a_module_of_report(name: str) -> None:
    """Each entry of ``TRACKERS`` names a module of ``report/`` that has the tracker's three
    names: a renamed module that the table still spells the old way fails here."""
    module = trackers.tracker_module(name)
    assert module.__name__ == f"hf_precision.report.{name}_tracker"
    assert callable(module.Sink) and callable(module.trainer_source) and callable(module.in_all)
