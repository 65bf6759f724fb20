"""What one engine (:class:`~hf_precision.engine.guard.PrecisionGuard`) says at its events: the
setup's cast line (or the audit's findings), drift warnings at later events, the plan's and a
wrapper's notes, the first input a guard bridges at run time, a fused LM head read outside its
module, and every watcher's :class:`~hf_precision.watch.finding.Finding`. Each warning once
per engine. The lines themselves are :mod:`.lines`' pure functions; this module says them
(``logging`` for what happened and for every finding, which no warning filter silences;
``warnings`` for what the user should act on at setup).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Protocol

import torch

from ..errors import PrecisionWarning
from ..rules.policy.precision_policy import PrecisionPolicy
from ..watch.finding import Finding
from .lines import bridged_line, cast_line, kept_as_is, kept_words, memory_line
from .records import EnforceReport

logger = logging.getLogger("hf_precision")

__all__ = ["Engine", "Speaker", "report_dir_of"]


def report_dir_of(reporter: Any) -> str | None:
    """The reporter's folder, as the console lines print it (``None`` without one)."""
    path = getattr(reporter, "report_dir", None)
    return f"{os.fspath(path).rstrip(os.sep)}{os.sep}" if path is not None else None


class Engine(Protocol):
    """What :meth:`Speaker.event` reads of its engine (the front ends may change these fields
    between events)."""

    policy: PrecisionPolicy
    #: where the policy came from, in the user's words
    origin: str | None
    reporter: Any


class Speaker:
    """The console of one engine: what it said already (:attr:`said`), so that each warning is
    said once however many events repeat it."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def once(self, message: str, *, stacklevel: int = 4) -> None:
        """``message`` as a :class:`PrecisionWarning`, the first time only."""
        if message not in self.said:
            self.said.add(message)
            warnings.warn(message, PrecisionWarning, stacklevel=stacklevel)

    def event(
        self,
        engine: Engine,
        where: str,
        audit: EnforceReport,
        report: EnforceReport,
        found: int,
        *,
        first: bool,
        held: bool,
    ) -> None:
        """The event's lines: at the first event what was cast (or, in audit mode, would be);
        at later ones the drift found or repaired; the plan's warnings when nothing applied
        them."""
        policy, origin, report_dir = engine.policy, engine.origin, report_dir_of(engine.reporter)
        said = first and self._first(
            policy, audit, report, found, held=held, origin=origin, at=report_dir
        )
        if found and not said:  # the model drifted from the policy (or a wrapper holds it so)
            verb = "repaired" if policy.mode == "fix" and not held else "found"
            example = f", e.g. {audit.changes[0].describe()}" if audit.changes else ""
            warnings.warn(
                f"{where}: dtype drift {verb}: {found} tensor(s) did not match "
                f"{policy.describe()}{example}; report: {report_dir or 'off'}",
                PrecisionWarning,
                stacklevel=4,
            )
        if not report.applied:  # apply_plan said the warnings of what it applied
            for w in report.warnings:
                self.once(w)

    def _first(
        self,
        policy: PrecisionPolicy,
        audit: EnforceReport,
        report: EnforceReport,
        found: int,
        *,
        held: bool,
        origin: str | None,
        at: str | None,
    ) -> bool:
        """The first event's line, if it has one to say."""
        if report.applied and report.changes:
            logger.warning(cast_line(report, origin=origin, report_dir=at))
            grown = memory_line(report)
            if grown:
                logger.warning(grown)
        elif policy.mode == "audit" and audit.changes and not held:
            # audit mode: the same line, said as findings (nothing was cast), on the console
            line = cast_line(audit, origin=origin, report_dir=at)
            logger.warning(
                f"hf-precision: audit found {len(audit.changes)} tensor(s) off the policy, "
                f"nothing cast (mode 'audit'); the policy would cast "
                + line.removeprefix("hf-precision: ")
            )
        elif not found and kept_as_is(report):
            # nothing to cast, but a wrapper's choice was kept: said once, at setup
            logger.warning(
                f"hf-precision: nothing cast; {kept_words(report)}; policy {policy.describe()}; "
                f"report: {at or 'off (report=False)'}"
            )
        else:
            return False
        return True

    def finding(self, finding: Finding) -> None:
        """A watcher's :class:`~hf_precision.watch.finding.Finding`, through ``logging`` at its
        severity (a warning filter does not silence it), once per source and message."""
        key = f"finding:{finding.source}:{finding.message}"
        if key not in self.said:
            self.said.add(key)
            logger.log(finding.level, "%s", finding.message)

    def bridged(
        self,
        kind: str,
        path: str,
        what: str,
        src: torch.dtype,
        dst: torch.dtype,
        *,
        cast: bool,
        report_dir: str | None,
    ) -> None:
        """A guard cast an input at run time (the hooks call this once per kind)."""
        logger.warning(bridged_line(kind, path, what, src, dst, cast, report_dir))

    def fused_heads(self, reads: list[Any], where: str, report_dir: str | None) -> None:
        """A fused LM head reading its weight outside its module, once per weight."""
        for read in reads:
            if read.kind == "fused_head" and read.tensor not in self.said:
                self.said.add(read.tensor)
                logger.warning(f"{where}: {read.describe()}; report: {report_dir or 'off'}")
