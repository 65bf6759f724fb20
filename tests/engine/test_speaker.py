"""What an engine says at its events (``hf_precision.engine.speaker``): each warning once, the
setup's cast line, drift at later events."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision import PrecisionPolicy, PrecisionWarning
from hf_precision.engine.guard import PrecisionGuard
from hf_precision.engine.speaker import Speaker, report_dir_of
from hf_precision.report.reporter import PrecisionReporter
from hf_precision.tiny import tiny_llava


def test_a_warning_is_said_once() -> None:
    speaker = Speaker()
    with pytest.warns(PrecisionWarning, match="^once$") as said:
        for _ in range(3):
            speaker.once("once")
        speaker.once("other")
    assert [str(w.message) for w in said] == ["once", "other"]


def test_the_report_dir_is_printed_as_a_folder(tmp_path: Path) -> None:
    assert report_dir_of(None) is None
    assert report_dir_of(PrecisionReporter(tmp_path)) == f"{tmp_path}/"


def test_setup_says_the_cast_and_a_later_event_the_drift(tmp_path: Path, caplog: Any) -> None:
    model = tiny_llava(torch.bfloat16)
    model.model.vision_tower.float()
    guard = PrecisionGuard(
        model, PrecisionPolicy.from_preset("bf16-true"), reporter=PrecisionReporter(tmp_path)
    )
    with caplog.at_level(logging.WARNING, logger="hf_precision"):
        guard.verify("setup")
    cast = [r.getMessage() for r in caplog.records if "→ bfloat16" in r.getMessage()]
    assert len(cast) == 1 and cast[0].endswith(f"report: {tmp_path}/")
    model.model.multi_modal_projector.float()
    with pytest.warns(PrecisionWarning, match=r"PrecisionGuard\.check: dtype drift repaired: 4 "):
        guard.verify("check")
    guard.teardown()
