"""The findings channel (:mod:`hf_precision.watch.finding`): one :class:`Finding` goes to the
console through ``logging`` (a warning filter does not silence it), in words to
``precision.log``, to its JSON (and the ``findings`` of every later event), as a picture of the
finding, and to TensorBoard; the provenance finding of a real Trainer takes the same way."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision import PrecisionError, PrecisionPolicy
from hf_precision.engine.guard import PrecisionGuard
from hf_precision.engine.speaker import Speaker
from hf_precision.report.reporter import PrecisionReporter
from hf_precision.tiny import tiny_llava
from hf_precision.watch.finding import Finding, emit

FOUND = Finding(
    "demo_watch",
    "warning",
    "hf-precision demo: 2 of 4 weights odd. Fix: PrecisionGuardCallback('bf16')",
    numbers={"odd": 2, "of": 4, "per": {"share": 0.5}},
    groups={"language_model": 0.5, "vision_encoder": 0.0},
    measure="odd share",
)


def test_a_finding_is_checked_when_made() -> None:
    with pytest.raises(PrecisionError, match="lowercase"):
        Finding("Lost Updates", "warning", "x")
    with pytest.raises(PrecisionError, match="not one of info, warning, error"):
        Finding("x", "loud", "x")  # type: ignore[arg-type]
    with pytest.raises(PrecisionError, match="one non-empty line"):
        Finding("x", "info", "two\nlines")


def test_a_finding_reaches_every_channel_under_a_warning_filter(tmp_path: Path, said: Any) -> None:
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    reporter = PrecisionReporter(tmp_path / "precision", trackers={"tensorboard": lambda: writer})
    speaker = Speaker()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        for _ in range(2):  # the speaker says it once; the reporter logs each
            emit(FOUND, speaker=speaker, reporter=reporter, step=7)
        reporter.log_event("after", tiny_llava(), step=8)
    writer.close()
    assert said.about("2 of 4 weights odd") == [FOUND.message]  # logging, once
    folder = tmp_path / "precision"
    assert FOUND.words(7) in (folder / "precision.log").read_text()
    body = json.loads((folder / "000007-demo_watch.json").read_text())
    assert body["demo_watch"] == {"odd": 2, "of": 4, "per": {"share": 0.5}}
    assert body["finding"]["severity"] == "warning" and body["finding"]["message"] == FOUND.message
    later = json.loads((folder / "000008-after.json").read_text())
    assert [f["source"] for f in later["findings"]] == ["demo_watch", "demo_watch"]
    from hf_precision.report.plot import plot_finding

    png = (folder / "000007-demo_watch.png").read_bytes()
    assert png == plot_finding(FOUND, title="demo_watch, step 7")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0}).Reload()
    assert events.Scalars("precision/demo_watch/per/share")[0].value == 0.5
    assert events.Scalars("precision/demo_watch/odd")[0].step == 7
    assert "precision/demo_watch/picture" in events.Tags()["images"]


def test_without_a_speaker_or_reporter_logging_still_says_it(said: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        emit(Finding("x", "error", "hf-precision: lost"))
        emit(Finding("x", "info", "hf-precision: measured"), reporter=object())
    assert said.lines[-2:] == ["hf-precision: lost", "hf-precision: measured"]


def test_a_failing_reporter_is_said_and_training_goes_on(said: Any) -> None:
    class Broken:
        def log_finding(self, finding: Finding, *, step: int) -> None:
            raise OSError("disk full")

    emit(FOUND, reporter=Broken())
    assert said.about("could not report the demo_watch finding (OSError: disk full)")


def test_the_guard_emits_through_its_speaker_and_reporter(tmp_path: Path, said: Any) -> None:
    model = tiny_llava()
    reporter = PrecisionReporter(tmp_path, console=False)
    guard = PrecisionGuard(model, PrecisionPolicy.from_preset("fp32"), reporter=reporter)
    guard.emit(FOUND, step=3)
    guard.emit(FOUND, step=4)
    assert said.about("weights odd") == [FOUND.message]
    assert sorted(p.name for p in tmp_path.glob("*demo_watch.json")) == [
        "000003-demo_watch.json",
        "000004-demo_watch.json",
    ]
    guard.teardown()


def test_the_provenance_finding_is_in_words_in_the_log(
    tiny_args: Any, monkeypatch: pytest.MonkeyPatch, make_trainer: Any, said: Any
) -> None:
    """Something beside the script chose the precision: said through logging (a warning
    filter on), in precision.log in words, and in ``<step>-provenance.json``."""
    from hf_precision import PrecisionGuardCallback

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    model = tiny_llava(seed=0)
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        trainer = make_trainer(model, batch, callbacks=[PrecisionGuardCallback()], bf16=True)
    [line] = said.about("overrode ACCELERATE_MIXED_PRECISION=fp16")
    folder = Path(trainer.args.output_dir) / "precision"
    assert line in (folder / "precision.log").read_text()
    [path] = folder.glob("*-provenance.json")
    assert json.loads(path.read_text())["provenance"]["chosen_by"] == "script"
