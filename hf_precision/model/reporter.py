"""``Reporter``: what the engine (:class:`~hf_precision.engine.guard.PrecisionGuard`) asks of the
object that writes its events, as a typed protocol. It lives in the model layer, below the
engine, so the engine names it without importing :mod:`hf_precision.report.reporter` (a front end's
layer): :class:`~hf_precision.report.reporter.PrecisionReporter` implements it, and so can a test's
or a user's own recorder.

>>> from hf_precision.model.reporter import Reporter
>>> from hf_precision.report.reporter import PrecisionReporter
>>> isinstance(PrecisionReporter(report_dir=None), Reporter)
True
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn

    from .dtype_maps import DtypeMap


@runtime_checkable
class Reporter(Protocol):
    """Writes one event of the engine (files, trackers) and says where its files go."""

    #: the folder of the event files (``None``: no files)
    report_dir: Path | None

    def log_event(
        self,
        event: str,
        model: nn.Module,
        *,
        step: int,
        policy: Any = None,
        groups: Any = None,
        report: Any = None,
        view: Any = None,
        sections: Mapping[str, Any] | None = None,
    ) -> DtypeMap:
        """Snapshot ``model`` at ``event`` (its :class:`DtypeMap`) and write/log it."""
        ...


__all__ = ["Reporter"]
