"""One channel for what a watcher found: a :class:`Finding` value and :func:`emit`.

A watcher (the lost-update check, the non-finite blame, the dtype trace, the provenance, and
any new one) says what it found in one :class:`Finding` and hands it to :func:`emit` (or
:meth:`PrecisionGuard.emit <hf_precision.engine.guard.PrecisionGuard.emit>`). The finding then
goes everywhere at once:

* the console, through ``logging`` (logger ``"hf_precision"``, at the finding's severity): a
  script that runs ``warnings.filterwarnings("ignore")`` still sees it. The engine's
  :class:`~hf_precision.engine.speaker.Speaker` says each finding once;
* the reporter (``reporter.log_finding``): the message in words in ``precision.log``, the
  numbers in ``<step>-<source>.json`` (and in the ``findings`` list of every later event JSON),
  a picture of the finding (``groups``: one bar per group) and W&B / TensorBoard.

How a watcher emits a finding::

    from hf_precision.watch.finding import Finding, emit
    found = Finding("fp8_shapes", "warning", "hf-precision fp8: 3 linear(s) ... Fix: ...",
                    numbers={"refused": 3}, groups={"vision_encoder": 1.0}, measure="share")
    emit(found, speaker=guard.speaker, reporter=guard.reporter, step=step)  # or guard.emit

>>> import logging
>>> found = Finding("demo", "warning", "hf-precision: 2 of 4 demo weights odd. Fix: none",
...                 numbers={"odd": 2}, groups={"language_model": 0.5}, measure="odd share")
>>> found.to_dict()["numbers"], found.level == logging.WARNING
({'odd': 2}, True)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ..errors import PrecisionError

logger = logging.getLogger("hf_precision")

Severity = Literal["info", "warning", "error"]
#: a finding's severity -> the ``logging`` level it is said at
LEVELS: dict[str, int] = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_SOURCE = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class Finding:
    """What one watcher found, once.

    Args:
        source: the watcher, lowercase (``"lost_updates"``, ``"nonfinite"``, ``"trace"``,
            ``"provenance"``): the file stem ``<step>-<source>.json``, the JSON key of
            ``numbers`` and the tracker prefix ``precision/<source>/...``.
        severity: ``"info"`` (what was measured, nothing to do), ``"warning"`` (the user should
            act) or ``"error"`` (a value was lost or became non-finite).
        message: one line in the user's words, with the fix in the flags of the user's tool.
        numbers: the structured numbers (JSON-able); their numeric leaves go to the trackers.
        groups: one number per module group, drawn as the finding's picture.
        measure: what ``groups``' numbers are (the picture's axis: ``"unchanged share"``).
        detail: the watcher's own object, for a reporter that writes its own format (the
            blame's :class:`~hf_precision.watch.blame.NonFinite`, the trace's result).
    """

    source: str
    severity: Severity
    message: str
    numbers: Mapping[str, Any] = field(default_factory=dict)
    groups: Mapping[str, float] = field(default_factory=dict)
    measure: str = ""
    detail: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not _SOURCE.match(self.source):
            raise PrecisionError(
                f"Finding(source={self.source!r}): a source is the watcher's name in lowercase "
                "letters, digits and '_'. Fix: e.g. Finding('lost_updates', ...)."
            )
        if self.severity not in LEVELS:
            raise PrecisionError(
                f"Finding(severity={self.severity!r}) is not one of {', '.join(LEVELS)}."
            )
        if not self.message.strip() or "\n" in self.message:
            raise PrecisionError(
                f"Finding({self.source!r}): the message is one non-empty line; put the rest "
                f"in numbers= (got {self.message!r})."
            )

    @property
    def level(self) -> int:
        """The ``logging`` level of :attr:`severity`."""
        return LEVELS[self.severity]

    def words(self, step: int) -> str:
        """The finding as ``precision.log`` writes it."""
        return f"hf-precision {self.source} (step {step}, {self.severity}): {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "severity": self.severity,
            "message": self.message,
            "numbers": dict(self.numbers),
            "groups": dict(self.groups),
            "measure": self.measure,
        }


class Says(Protocol):
    """What :func:`emit` asks of a speaker (:class:`~hf_precision.engine.speaker.Speaker`)."""

    def finding(self, finding: Finding) -> None: ...


def emit(
    finding: Finding, *, speaker: Says | None = None, reporter: Any = None, step: int = 0
) -> None:
    """Say ``finding`` on the console (through ``speaker``, once; without one straight to the
    ``hf_precision`` logger) and hand it to ``reporter.log_finding`` (its files and trackers)
    when there is a reporter. A reporter that fails is said on the console; it never stops
    training."""
    if speaker is not None:
        speaker.finding(finding)
    else:
        logger.log(finding.level, "%s", finding.message)
    log = getattr(reporter, "log_finding", None)
    if log is None:
        return
    try:
        log(finding, step=step)
    except Exception as err:  # a report is an observer
        logger.warning(
            "hf-precision: could not report the %s finding (%s: %s); training goes on",
            finding.source,
            type(err).__name__,
            err,
        )


__all__ = ["LEVELS", "Finding", "Says", "Severity", "emit"]
