"""How the reporter talks to experiment trackers (W&B, TensorBoard): one small interface
(:class:`Tracker`), one payload per event (:class:`TrackerPayload`, plain data kept until the
tracker's run or writer exists) and one table (:data:`TRACKERS`) from the name ``report_to`` /
``log_with`` uses to the module that adapts it.

A tracker module (``wandb_tracker``, ``tensorboard_tracker``) is imported only when its tracker
is asked for, and defines:

* ``Sink(source)``: the :class:`Tracker`; ``source()`` returns the tracker's live object (the
  W&B run, the ``SummaryWriter``) or ``None`` while it does not exist yet;
* ``trainer_source(args, trainer)``: that source for a ``transformers.Trainer`` (its tracker's
  callback, its arguments);
* ``in_all()``: whether ``report_to="all"`` includes it here.

Under accelerate the source is the accelerator's own tracker
(``accelerator.get_tracker(name, unwrap=True)``, once ``init_trackers`` made it): the guard logs
into the run or event file the script set up and never opens a second one. Adding a tracker
is one module and one entry in :data:`TRACKERS`.

>>> wanted_trackers(["tensorboard", "wandb"])
('wandb', 'tensorboard')
>>> wanted_trackers("none")
()
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from ..errors import PrecisionError, did_you_mean
from .rows import (
    DRIFT_COLUMNS,
    GROUP_COLUMNS,
    MODULE_COLUMNS,
    NONFINITE_COLUMNS,
    section_scalars,
)
from .snapshot import EventSnapshot

#: tracker name (as in ``report_to`` / ``log_with``) -> its module in ``hf_precision.report``
TRACKERS: dict[str, str] = {
    "wandb": "wandb_tracker",
    "tensorboard": "tensorboard_tracker",
}


@dataclass
class TrackerPayload:
    """One event, ready to be logged (kept as plain data until a run exists)."""

    event: str
    step: int
    module_columns: list[Any]
    module_rows: list[list[Any]]
    group_columns: list[Any]
    group_rows: list[list[Any]]
    drift_columns: list[Any]
    drift_rows: list[list[Any]]
    scalars: dict[str, float | int] = field(default_factory=dict)
    policy: str | None = None
    png: bytes | None = None
    png_path: Path | None = None
    #: further tables (key -> (columns, rows)) and run summary entries: the blame's
    #: ``precision/nonfinite``, the trace's ``precision/trace``
    tables: dict[str, tuple[list[Any], list[list[Any]]]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Tracker(Protocol):
    """What the reporter asks of a tracker adapter."""

    #: the tracker's name in messages ("W&B", "TensorBoard")
    label: str
    #: ``False`` once it said why it cannot log (then it logs nothing more)
    enabled: bool

    def submit(self, payload: TrackerPayload, *, first_event: bool) -> None:
        """Log now when the run/writer exists, otherwise keep the payload for later."""
        ...

    def flush(self) -> None:
        """Log what waits, if the run/writer exists now (silent otherwise)."""
        ...


def tracker_module(name: str) -> ModuleType:
    """The adapter module of tracker ``name`` (imported now)."""
    if name not in TRACKERS:
        hint = did_you_mean(name, tuple(TRACKERS))
        raise PrecisionError(
            f"hf-precision report: no tracker {name!r}.{hint} Known: {', '.join(TRACKERS)}."
        )
    return importlib.import_module(f"{__package__}.{TRACKERS[name]}")


def make_tracker(name: str, source: Callable[[], Any] | None) -> Tracker:
    sink: Tracker = tracker_module(name).Sink(source)
    return sink


def _known_report_to() -> tuple[str, ...]:
    """What ``TrainingArguments.report_to`` accepts (transformers' own list)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    return ("all", "none", *INTEGRATION_TO_CALLBACK)


def _names(report_to: list[str] | str | None, call: str) -> list[str]:
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if isinstance(name, str) and name.lower() in ("all", "none", *TRACKERS):
            continue  # no need to import transformers' integrations (5 s) for these
        known = _known_report_to()
        if not isinstance(name, str) or name.lower() not in known:
            hint = did_you_mean(str(name).lower(), known)
            raise PrecisionError(
                f"{call}={report_to!r}: unknown integration {name!r}.{hint}\n"
                f"Allowed: {', '.join(known)}.\nFix: pass e.g. report_to=['wandb']."
            )
    return [n.lower() for n in names]


def wanted_trackers(
    report_to: list[str] | str | None, *, call: str = "report_to"
) -> tuple[str, ...]:
    """The trackers of :data:`TRACKERS` a ``report_to`` value (as in ``TrainingArguments``)
    asks for: named, or ``"all"`` (a tracker whose package is missing is then left out)."""
    lowered = _names(report_to, call)
    if "none" in lowered:
        return ()
    every = "all" in lowered
    return tuple(n for n in TRACKERS if n in lowered or (every and tracker_module(n).in_all()))


def wants_wandb(report_to: list[str] | str | None, *, call: str = "report_to") -> bool:
    """Does a ``report_to`` value (as in ``TrainingArguments``) ask for W&B?"""
    return "wandb" in wanted_trackers(report_to, call=call)


def accelerator_source(accelerator: Any, name: str) -> Callable[[], Any]:
    """Where tracker ``name`` lives under accelerate: the accelerator's own tracker's object
    (the W&B run, the ``SummaryWriter``), ``None`` until ``init_trackers`` made it."""

    def source() -> Any:
        if any(getattr(t, "name", None) == name for t in accelerator.trackers):
            return accelerator.get_tracker(name, unwrap=True)
        return None

    return source


def accelerator_trackers(accelerator: Any) -> dict[str, Callable[[], Any]]:
    """The trackers of :data:`TRACKERS` that ``accelerator.log_with`` names, each with its
    source."""
    names = [str(getattr(t, "value", t)).lower() for t in (accelerator.log_with or [])]
    return {n: accelerator_source(accelerator, n) for n in TRACKERS if any(n in x for x in names)}


# ---------------------------------------------------------------------------- payloads
def event_payload(snap: EventSnapshot, png_path: Path | None) -> TrackerPayload:
    """An event's payload: its module, group and drift tables, the numbers (bytes per dtype,
    mismatches, tensors kept, aggregated rows, the sections'), the policy and the picture."""
    scalars: dict[str, float | int] = {
        f"precision/bytes/{d}": b for d, b in sorted(snap.dmap.bytes_by_dtype.items())
    }
    for kind, n in snap.mismatches.items():
        scalars[f"precision/mismatches/{kind}"] = n
    scalars["precision/kept"] = len(getattr(snap.report, "kept", None) or ())
    scalars["precision/modules_aggregated"] = snap.aggregated
    scalars.update(section_scalars(snap.sections))
    group_rows = snap.dmap.group_rows()
    return TrackerPayload(
        event=snap.event,
        step=snap.step,
        module_columns=list(MODULE_COLUMNS),
        module_rows=[[r[c] for c in MODULE_COLUMNS] for r in snap.rows],
        group_columns=list(GROUP_COLUMNS),
        group_rows=[[r[c] for c in GROUP_COLUMNS] for r in group_rows],
        drift_columns=list(DRIFT_COLUMNS),
        drift_rows=[[r[c] for c in DRIFT_COLUMNS] for r in snap.drift],
        scalars=scalars,
        policy=snap.policy.describe() if snap.policy is not None else None,
        png=snap.png,
        png_path=png_path,
    )


def nonfinite_payload(records: list[dict[str, Any]], step: int) -> TrackerPayload:
    """The blame's findings so far as a table; the last one in the summary."""
    columns = list(NONFINITE_COLUMNS)
    rows = [[str(r[c]) if isinstance(r[c], tuple) else r[c] for c in columns] for r in records]
    last = records[-1]
    return TrackerPayload(
        "nonfinite",
        step,
        [],
        [],
        [],
        [],
        [],
        [],
        tables={"precision/nonfinite": (columns, rows)},
        summary={
            f"precision/nonfinite/{k}": last[k] for k in ("module", "role", "kind", "phase", "line")
        },
    )


def finding_payload(
    finding: Any, step: int, png: bytes | None, path: Path | None
) -> TrackerPayload:
    """A watcher's :class:`~hf_precision.watch.finding.Finding` (``path``: its JSON file): its
    numbers as ``precision/<source>/...`` scalars, its groups as the table
    ``precision/<source>`` and its picture; the message and severity in the summary."""
    source = finding.source
    png_path = path.with_suffix(".png") if path is not None and png is not None else None
    tables: dict[str, tuple[list[Any], list[list[Any]]]] = {}
    if finding.groups:
        rows = [[g, float(v)] for g, v in finding.groups.items()]
        tables[f"precision/{source}"] = (["group", finding.measure or "value"], rows)
    return TrackerPayload(
        source,
        step,
        [],
        [],
        [],
        [],
        [],
        [],
        scalars=section_scalars({source: finding.numbers}),
        png=png,
        png_path=png_path,
        tables=tables,
        summary={
            f"precision/{source}/message": finding.message,
            f"precision/{source}/severity": finding.severity,
        },
    )


def trace_payload(
    trace: Any, step: int, png: bytes | None, png_path: Path | None
) -> TrackerPayload:
    """An activation dtype trace: the modules whose output dtype differs from their input's,
    its strip picture, the first change in the summary."""
    columns = ["index", "module", "module_type", "before", "after", "cause", "detail"]
    first = trace.first_change
    return TrackerPayload(
        "trace",
        step,
        [],
        [],
        [],
        [],
        [],
        [],
        png=png,
        png_path=png_path,
        tables={
            "precision/trace": (columns, [[getattr(c, k) for k in columns] for c in trace.changes])
        },
        summary={"precision/trace/first_change": first.line() if first else "none"},
    )


__all__ = [
    "TRACKERS",
    "Tracker",
    "TrackerPayload",
    "accelerator_source",
    "accelerator_trackers",
    "event_payload",
    "finding_payload",
    "make_tracker",
    "nonfinite_payload",
    "trace_payload",
    "tracker_module",
    "wanted_trackers",
    "wants_wandb",
]
