"""What a :class:`~hf_precision.PrecisionGuardCallback` does during training steps: the dtype trace
of the first step (:mod:`hf_precision.watch.trace`), the non-finite blame
(:mod:`hf_precision.watch.blame`, armed by a logged non-finite loss or gradient norm), the
lost-update check on the Trainer's optimizer (:mod:`hf_precision.watch.lost_updates`) and the
verify before an in-training evaluation."""

from __future__ import annotations

import logging
from typing import Any

from ..engine.guard import PrecisionGuard
from ..engine.range_check import read_deferred
from ..watch.blame import NonFiniteBlame
from ..watch.finding import Finding, emit
from ..watch.lost_updates import LostUpdateCheck, LostUpdates, watch

logger = logging.getLogger("hf_precision")

__all__ = ["CallbackSteps"]


class CallbackSteps:
    """The step events of :class:`~hf_precision.PrecisionGuardCallback` (a part of it, which
    holds the fields below and :meth:`_verify`)."""

    guard: PrecisionGuard | None
    reporter: Any
    blame: NonFiniteBlame | None
    trace: bool
    trace_result: Any
    _tracer: Any
    lost_updates: LostUpdates
    _lost: LostUpdateCheck | None

    def _verify(self, event: str, args: Any, state: Any, kwargs: dict[str, Any]) -> None:
        raise NotImplementedError  # the callback's

    def _emit(self, finding: Finding, step: int) -> None:
        """A watcher's finding through the engine's speaker and this callback's reporter."""
        speaker = self.guard.speaker if self.guard is not None else None
        emit(finding, speaker=speaker, reporter=self.reporter, step=step)

    def _watch_updates(self, args: Any, kwargs: dict[str, Any]) -> None:
        """Start the lost-update check on the Trainer's optimizer, once per model."""
        optimizer = kwargs.get("optimizer")
        if self.lost_updates == "off" or self.guard is None or optimizer is None:
            return
        if self._lost is None or self._lost.root is not self.guard.root:
            self._lost = watch(self.guard, optimizer, args=args)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trace and self._tracer is None and self.trace_result is None:
            from ..watch.trace import DtypeTrace

            model = kwargs.get("model")
            if model is not None:
                self._tracer = DtypeTrace(model)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = int(getattr(state, "global_step", 0) or 0)
        if self._tracer is not None:
            self.trace_result, self._tracer = self._tracer.result(), None
            self._emit(self.trace_result.finding(), step)
        if self.blame is not None and self.blame.armed:
            finding = self.blame.collect(step=step)
            if finding is not None:
                self._emit(finding.finding(), step)
        if getattr(control, "should_evaluate", False):
            self._verify("before_evaluate", args, state, kwargs)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if self.blame is not None:  # auto: a non-finite loss/grad_norm arms the next step
            self.blame.observe(logs, step=int(getattr(state, "global_step", 0) or 0))
        read_deferred()  # the guards' clamped overflows, read where the Trainer reads the loss
        # events that waited for a tracker's writer (TensorBoard)
        flush = getattr(self.reporter, "flush_trackers", None)
        if flush is not None:
            flush()
