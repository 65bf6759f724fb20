"""``Reporter``: the engine's typed contract with its reporter; ``PrecisionReporter`` meets it."""

from __future__ import annotations

from pathlib import Path

from hf_precision.engine.guard import PrecisionGuard
from hf_precision.model.reporter import Reporter
from hf_precision.report.reporter import PrecisionReporter
from hf_precision.rules.policy.precision_policy import PrecisionPolicy
from hf_precision.tiny import tiny_llava


def test_precision_reporter_is_a_reporter(tmp_path: Path) -> None:
    reporter: Reporter = PrecisionReporter(report_dir=tmp_path, console=False, picture=False)
    assert isinstance(reporter, Reporter)
    assert not isinstance(object(), Reporter)


def test_the_engine_writes_through_any_reporter(tmp_path: Path) -> None:
    """A recorder that only meets the protocol receives the engine's events."""

    class Recorder:
        report_dir = None

        def __init__(self) -> None:
            self.events: list[str] = []
            self.inner = PrecisionReporter(report_dir=None, console=False, picture=False)

        def log_event(self, event, model, **kwargs):  # type: ignore[no-untyped-def]
            self.events.append(event)
            return self.inner.log_event(event, model, **kwargs)

    recorder = Recorder()
    assert isinstance(recorder, Reporter)
    guard = PrecisionGuard(
        tiny_llava(seed=0), PrecisionPolicy.from_preset("fp32"), reporter=recorder
    )
    guard.verify("setup", log_clean=True)
    assert recorder.events == ["setup"]
