"""The optimizer step of a :class:`~hf_precision.PrecisionGuardPlugin` loop: a cheap dtype check
before every N-th step (``register_step_pre_hook``; the full verify runs only on a change), the
non-finite blame (:mod:`hf_precision.watch.blame`: armed by :meth:`PluginSteps.observe`, on
request, or by a step the GradScaler skipped) and the lost-update check on the first steps
(:mod:`hf_precision.watch.lost_updates`: its result is the ``lost_updates`` section and event).
"""

from __future__ import annotations

import logging
from typing import Any

from ..engine.guard import PrecisionGuard
from ..watch.blame import BlameMode, NonFinite, NonFiniteBlame
from ..watch.finding import emit
from ..watch.lost_updates import LostUpdateCheck, LostUpdates, watch

logger = logging.getLogger("hf_precision")

__all__ = ["PluginSteps"]


class PluginSteps:
    """The step half of :class:`~hf_precision.PrecisionGuardPlugin` (a mixin: the plugin holds
    the fields below and :meth:`verify`)."""

    steps: int
    check_every: int
    blame_mode: BlameMode
    blames: list[NonFiniteBlame]
    lost_updates: LostUpdates
    _lost: LostUpdateCheck | None
    _guarded: list[PrecisionGuard]
    _optimizers: list[Any]
    _handles: list[Any]
    _accelerator: Any
    _reporter: Any

    #: the fix the lost-update warning gives (the launcher says it in its own flags)
    lost_updates_fix = (
        "Accelerator(mixed_precision='bf16') with PrecisionGuardPlugin('bf16') in mode 'fix' (its "
        "bf16 policy holds trainable weights in float32 and computes in bf16)"
    )

    def verify(self, model: Any = None, event: str = "verify", *, check_ranks: bool = True) -> Any:
        raise NotImplementedError  # the plugin's

    def _hook_optimizer(self, optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        if not hasattr(inner, "register_step_pre_hook"):  # DeepSpeed's own optimizers
            logger.info(
                "hf-precision: %s has no step pre-hook; dtypes are checked at evaluations only",
                type(inner).__name__,
            )
            return
        self._optimizers.append(inner)
        if self.lost_updates == "auto" and self._guarded and self._lost is None:
            self._lost = self._watch_updates(self._trained_by(inner), inner)
        if self.check_every or self.blame_mode != "off":
            self._handles.append(inner.register_step_pre_hook(self._step_pre_hook))

    def _watch_updates(self, guard: PrecisionGuard, optimizer: Any) -> LostUpdateCheck:
        """:func:`~hf_precision.watch.lost_updates.watch` (the ``lost_updates`` section and
        event), warning with the fix in this loop's words (:attr:`lost_updates_fix`)."""
        return watch(guard, optimizer, tool="accelerate", fix=self.lost_updates_fix)

    def _trained_by(self, optimizer: Any) -> PrecisionGuard:
        """The guarded model whose weights ``optimizer`` updates (the first one otherwise)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for g in self._guarded:
            if any(id(p) in held for p in g.root.parameters()):
                return g
        return self._guarded[0]

    def _step_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        # events that waited for init_trackers' writer/run
        flush = getattr(self._reporter, "flush_trackers", None)
        if flush is not None:
            flush()
        self._blame_step()
        if not self.check_every or self.steps % self.check_every:
            return
        for g in self._guarded:
            # Cheap: one dtype read per parameter tensor; the full check runs only on a change.
            if g.drifted():
                self.verify(g.model, "before_optimizer_step", check_ranks=False)

    # ------------------------------------------------------------------ blame
    def observe(self, loss: Any = None, grad_norm: Any = None) -> bool:
        """What the loop logs: a non-finite ``loss`` or ``grad_norm`` arms the blame
        (``auto``); the next step is inspected. A tensor is read (a device sync: pass the value
        you log anyway). Returns whether it armed now."""
        logs = {k: v for k, v in (("loss", loss), ("grad_norm", grad_norm)) if v is not None}
        return any([b.observe(logs, step=self.steps) for b in self.blames])

    def blame_next_step(self, *, backward: bool = True) -> None:
        """Arm the blame on request: the next step's forward (and backward) is inspected."""
        for b in self.blames:
            if b.mode != "off":
                b.arm(f"on request at step {self.steps}", backward=backward)

    def _blame_step(self) -> list[NonFinite]:
        """At the optimizer step: a step the GradScaler skipped (inf gradients) arms ``auto``;
        an armed blame reports what it saw in this step's forward and backward."""
        found = []
        skipped = bool(getattr(self._accelerator, "optimizer_step_was_skipped", False))
        for b in self.blames:
            if skipped and b.mode == "auto" and not b.armed and not b.findings:
                b.arm(
                    f"armed by a step the GradScaler skipped before step {self.steps}",
                    backward=True,
                )
            elif b.armed:
                finding = b.collect(step=self.steps)
                if finding is not None:
                    found.append(finding)
                    speaker = self._guarded[0].speaker if self._guarded else None
                    emit(
                        finding.finding(), speaker=speaker, reporter=self._reporter, step=self.steps
                    )
        return found
