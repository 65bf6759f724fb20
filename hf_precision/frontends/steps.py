"""``StepWatch``: the per-step work the front ends share, one object that the Trainer callback
and the accelerate plugin each hold. It observes the training steps and changes nothing:

* the dtype trace of the first step (:mod:`hf_precision.watch.trace`): started when a step
  begins, finished (and its finding said) when it ends;
* the non-finite blame (:mod:`hf_precision.watch.blame`), one per watched model: armed by a
  logged non-finite loss or gradient norm (:meth:`StepWatch.observe`), on request
  (:meth:`StepWatch.arm`) or by a step the GradScaler skipped; an armed blame reports what it
  saw when the step ends;
* the lost-update check on the first optimizer steps (:mod:`hf_precision.watch.lost_updates`),
  warning with the fix in the front end's words.

A finding goes out through :func:`hf_precision.watch.finding.emit`, with the speaker of the
front end's engine and its reporter. A new per-step check (the RL and fp8 checks) is one more
field here, started in :meth:`StepWatch.begin_step` or :meth:`StepWatch.watch_updates` and read
in :meth:`StepWatch.end_step`; the front ends already call those at their step events.

>>> from torch import nn
>>> watch = StepWatch(blame="auto", speaker=lambda: None, reporter=lambda: None)
>>> blame = watch.add_model(nn.Linear(2, 2))
>>> watch.observe({"loss": float("nan")}, step=3), blame.armed
(True, True)
>>> watch.stop()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..engine.guard import PrecisionGuard
from ..watch.blame import BlameMode, NonFinite, NonFiniteBlame
from ..watch.finding import Finding, Says, emit
from ..watch.lost_updates import LostUpdateCheck, LostUpdates, watch

__all__ = ["StepWatch"]


class StepWatch:
    """What a front end watches during the training steps (the first-step trace, the blame of
    each model, the lost-update check) and says through its engine's speaker and reporter.

    Args:
        blame: the blame mode, checked by the front end
            (:func:`~hf_precision.watch.blame.check_mode`).
        trace: record the first step's forward, module by module.
        lost_updates: ``"auto"`` or ``"off"`` (checked by the front end).
        speaker: the front end's speaker now (its engine's), or ``None``: read at each finding.
        reporter: the front end's reporter now, or ``None``: read at each finding.
    """

    def __init__(
        self,
        *,
        blame: BlameMode,
        trace: bool = False,
        lost_updates: LostUpdates = "auto",
        speaker: Callable[[], Says | None],
        reporter: Callable[[], Any],
    ) -> None:
        self.blame_mode: BlameMode = blame
        self.trace = trace
        self.lost_updates: LostUpdates = lost_updates
        #: one blame per watched model (:meth:`add_model`)
        self.blames: list[NonFiniteBlame] = []
        #: the first step's trace while it records, then its result
        self.tracer: Any = None
        self.trace_result: Any = None
        #: the lost-update check started last (None before an optimizer is seen, or ``off``)
        self.lost: LostUpdateCheck | None = None
        self._speaker, self._reporter = speaker, reporter

    # ------------------------------------------------------------------ models
    def add_model(self, model: nn.Module, *, args: Any = None) -> NonFiniteBlame:
        """Watch ``model`` too: its own blame (``args``: the Trainer's, for the fix's words)."""
        blame = NonFiniteBlame(model, self.blame_mode, args=args)
        self.blames.append(blame)
        return blame

    def forget_models(self) -> None:
        """Disarm every blame and watch no model (a front end whose model changed)."""
        for b in self.blames:
            b.disarm()
        self.blames = []

    def stop(self, *, updates: bool = False) -> None:
        """The end of training: blames disarmed, a trace still recording taken off (and the
        lost-update check's hooks with ``updates``)."""
        for b in self.blames:
            b.disarm()
        if self.tracer is not None:
            self.tracer.remove()
            self.tracer = None
        if updates and self.lost is not None:
            self.lost.detach()

    # ------------------------------------------------------------------ steps
    def begin_step(self, model: nn.Module | None) -> None:
        """A training step begins: the first one's forward is traced (``trace``)."""
        if self.trace and self.tracer is None and self.trace_result is None and model is not None:
            from ..watch.trace import DtypeTrace

            self.tracer = DtypeTrace(model)

    def end_step(self, step: int, *, skipped: bool = False) -> list[NonFinite]:
        """A training step ends (or its optimizer step begins): the first step's trace is
        said; a step the GradScaler ``skipped`` (inf gradients) arms an ``auto`` blame that
        has found nothing yet; an armed blame says what it saw. Returns the blames' findings."""
        if self.tracer is not None:
            self.trace_result, self.tracer = self.tracer.result(), None
            self.emit(self.trace_result.finding(), step)
        found = []
        for b in self.blames:
            if skipped and b.mode == "auto" and not b.armed and not b.findings:
                b.arm(f"armed by a step the GradScaler skipped before step {step}", backward=True)
            elif b.armed:
                finding = b.collect(step=step)
                if finding is not None:
                    found.append(finding)
                    self.emit(finding.finding(), step)
        return found

    # ------------------------------------------------------------------ blame
    def observe(self, logs: dict[str, Any] | None, *, step: int) -> bool:
        """What the loop logs: a non-finite ``loss`` or ``grad_norm`` arms an ``auto`` blame;
        the next step is inspected. Returns whether one armed now."""
        return any([b.observe(logs, step=step) for b in self.blames])

    def arm(self, trigger: str, *, backward: bool = True) -> None:
        """Arm every blame that is not ``off``: the next step's forward (and backward) is
        inspected, ``trigger`` saying why."""
        for b in self.blames:
            if b.mode != "off":
                b.arm(trigger, backward=backward)

    # ------------------------------------------------------------------ lost updates
    def watch_updates(
        self,
        guard: PrecisionGuard | None,
        optimizer: Any,
        *,
        args: Any = None,
        tool: Any = None,
        fix: str | None = None,
    ) -> None:
        """Start the lost-update check on ``optimizer`` for ``guard``'s model, once per model
        (:func:`~hf_precision.watch.lost_updates.watch`: the ``lost_updates`` section and
        finding), the fix in the front end's words (``fix``, else said for ``args``/``tool``)."""
        if self.lost_updates == "off" or guard is None or optimizer is None:
            return
        if self.lost is None or self.lost.root is not guard.root:
            self.lost = watch(guard, optimizer, args=args, tool=tool, fix=fix)

    # ------------------------------------------------------------------ findings
    def emit(self, finding: Finding, step: int) -> None:
        """A watcher's finding through the front end's speaker and reporter."""
        emit(finding, speaker=self._speaker(), reporter=self._reporter(), step=step)
