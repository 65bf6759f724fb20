"""The reporter's files: unique names per event, the JSON's keys, a failure said, not raised."""

from __future__ import annotations

import json
from pathlib import Path

from hf_precision.report.event_files import EventFiles
from hf_precision.report.reporter import PrecisionReporter
from hf_precision.tiny import tiny_llava


def test_stems_never_reuse_a_name_taken_now_or_by_an_earlier_run(tmp_path: Path) -> None:
    (tmp_path / "000002-on_evaluate.json").write_text("{}")  # an earlier run's file
    files = EventFiles(tmp_path, console=False, failed=lambda kind, detail: None)
    assert [files.stem("on_evaluate", 2) for _ in range(2)] == [
        "000002-on_evaluate-2",
        "000002-on_evaluate-3",
    ]
    assert files.stem("setup", 0) == "000000-setup"


def test_the_event_json_and_a_failed_write(tmp_path: Path) -> None:
    reporter = PrecisionReporter(tmp_path / "p", console=False, picture=False)
    dmap = reporter.log_event("setup", tiny_llava(), step=0)
    data = json.loads((tmp_path / "p" / "000000-setup.json").read_text())
    assert data["dtype_map"] == dmap.to_dict() and data["picture"] is None
    assert reporter.written == [tmp_path / "p" / "000000-setup.json"]
    said: list[tuple[str, str]] = []
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    files = EventFiles(blocked, console=False, failed=lambda k, d: said.append((k, d)))
    assert files.write_extra("trace", 1, {"trace": {}}) is None
    files.append_log("line")
    assert [k for k, _ in said] == ["files", "files"] and str(blocked) in said[0][1]
