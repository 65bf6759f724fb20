"""Where dtype maps go: files always (JSON + PNG per event, a text table in the logs), W&B when
``"wandb"`` is in ``report_to``.

:class:`PrecisionGuardCallback` calls :meth:`PrecisionReporter.log_event` at ``on_init_end``,
``on_train_begin``, before and after every evaluation/prediction; the reporter can also be used
alone:

>>> import tempfile
>>> from hf_precision.report.reporter import PrecisionReporter
>>> from hf_precision.tiny import tiny_llava
>>> reporter = PrecisionReporter(tempfile.mkdtemp(), console=False)
>>> dmap = reporter.log_event("manual", tiny_llava(), step=0)
>>> sorted(p.suffix for p in reporter.written)
['.json', '.png']

Files per event in ``<output_dir>/precision/``: ``<step>-<event>.json`` (the full map, the drift,
the policy and the mismatch counts: ``found``, ``repaired``, ``open``), ``<step>-<event>.png``
(the picture of :func:`hf_precision.report.plot.plot_precision`: per group, frozen and trainable
weights apart, the dtypes now and before this event's casts against the policy's target) and one
block per event appended to ``precision.log``: the group table, or one line ``unchanged since
<event>`` when the map is the one the last table showed. A name already taken (a second
evaluation at the same step, an earlier run in the same folder) gets ``-2``, ``-3``, ...: no
event overwrites another's files.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import PrecisionWarning
from ..model.dtype_maps import DtypeMap, dtype_map
from .event_files import EventFiles
from .event_picture import EventPicture
from .rows import (
    MAX_TABLE_ROWS,
    drift_rows,
    module_table_rows,
)
from .snapshot import EventSnapshot
from .trackers import (
    Tracker,
    accelerator_trackers,
    event_payload,
    finding_payload,
    make_tracker,
    nonfinite_payload,
    trace_payload,
    tracker_module,
    wanted_trackers,
)

logger = logging.getLogger("hf_precision")


@dataclass
class _Baseline:
    """One model's last event: its map and name (what the next event's drift is against) and
    the last event logged in full (``(event, step, map)``)."""

    map: DtypeMap | None = None
    event: str | None = None
    table: tuple[str, int, DtypeMap] | None = None


class PrecisionReporter:  # implements hf_precision.model.reporter.Reporter
    # (tests/model/test_reporter.py)
    """Writes the dtype map of each event to files and, when asked, to trackers (W&B,
    TensorBoard: :mod:`hf_precision.report.trackers`).

    Args:
        report_dir: folder for the files (``None``: no files).
        console: log the text table through the ``hf_precision`` logger.
        is_main_process: only the main process writes and logs.
        wandb: log to the active W&B run.
        wandb_run: where that run comes from (default ``wandb.run``), called at each event.
        max_table_rows: above this many modules the tables aggregate repeated layers (and say
            how many rows were folded); the JSON files keep every module.
        picture: render the PNG (needs matplotlib; a warning once when it is missing).
        trackers: more trackers by name (``{"tensorboard": source}``), each with where its
            live object comes from (``None``: the tracker's default; see
            :data:`~hf_precision.report.trackers.TRACKERS`).
    """

    def __init__(
        self,
        report_dir: str | os.PathLike[str] | None,
        *,
        console: bool = True,
        is_main_process: bool = True,
        wandb: bool = False,
        wandb_run: Callable[[], Any] | None = None,
        max_table_rows: int = MAX_TABLE_ROWS,
        picture: bool = True,
        trackers: Mapping[str, Callable[[], Any] | None] | None = None,
    ) -> None:
        self.files = EventFiles(
            Path(report_dir) if report_dir is not None else None,
            console=console,
            failed=self._failed,
        )
        self.is_main_process = is_main_process
        self.max_table_rows = max_table_rows
        self._picture = EventPicture(picture)
        #: the map and name of the last event of any model (:meth:`log_event`)
        self.last_map: DtypeMap | None = None
        self.last_event: str | None = None
        self.events: list[tuple[str, int]] = []
        #: per guarded model (its unwrapped root): the last map and event (the drift's
        #: baseline) and the last event logged in full; each model is compared with itself
        self._baselines: weakref.WeakKeyDictionary[nn.Module, _Baseline] = (
            weakref.WeakKeyDictionary()
        )
        self._warned: set[str] = set()  # kinds of report failure already warned about
        #: the blame's findings so far (``NonFinite.to_dict()``): every later event's JSON
        #: carries them as ``nonfinite``
        self.nonfinite: list[dict[str, Any]] = []
        #: every watcher's finding so far, with its step: each later event JSON's ``findings``
        self.findings: list[dict[str, Any]] = []
        asked = dict(trackers or {})
        if wandb:
            asked.setdefault("wandb", wandb_run)
        #: the trackers this reporter logs to, by name (the main process only)
        self.trackers: dict[str, Tracker] = {}
        if is_main_process:
            self.trackers = {name: make_tracker(name, src) for name, src in asked.items()}

    # what the parts hold, under the names this reporter always had
    @property
    def report_dir(self) -> Path | None:
        return self.files.report_dir

    @report_dir.setter
    def report_dir(self, value: Path | None) -> None:
        self.files.report_dir = value

    @property
    def console(self) -> bool:
        return self.files.console

    @console.setter
    def console(self, value: bool) -> None:
        self.files.console = value

    @property
    def written(self) -> list[Path]:
        return self.files.written

    @property
    def picture(self) -> bool:
        return self._picture.enabled

    @picture.setter
    def picture(self, value: bool) -> None:
        self._picture.enabled = value

    @property
    def wandb(self) -> Any:
        """The W&B sink (:class:`~hf_precision.report.wandb_tracker.WandbSink`), or ``None``."""
        return self.trackers.get("wandb")

    @classmethod
    def from_training_args(
        cls,
        args: Any,
        *,
        report_dir: str | os.PathLike[str] | None = None,
        report_to: list[str] | str | None = None,
        trainer: Any = None,
    ) -> PrecisionReporter:
        """Files in ``report_dir`` (default ``<output_dir>/precision``); the trackers
        ``report_to`` (default ``args.report_to``) names (W&B into ``wandb.run``, TensorBoard
        into the writer of ``trainer``'s ``TensorBoardCallback``); main process =
        ``process_index == 0``."""
        out = report_dir or os.path.join(getattr(args, "output_dir", None) or ".", "precision")
        main = bool(getattr(args, "process_index", 0) == 0)
        if report_to is not None:
            names = wanted_trackers(report_to, call="PrecisionGuardCallback(report_to)")
        else:
            names = wanted_trackers(
                getattr(args, "report_to", None) or [], call="TrainingArguments.report_to"
            )
        trackers = {n: tracker_module(n).trainer_source(args, trainer) for n in names}
        return cls(out, is_main_process=main, trackers=trackers)

    @classmethod
    def from_accelerator(
        cls, accelerator: Any, *, report_dir: str | os.PathLike[str] | None = None
    ) -> PrecisionReporter:
        """Files in ``report_dir`` (default ``<project_dir or .>/precision``); the trackers
        ``log_with`` names, each into the accelerator's own tracker (its W&B run, its
        TensorBoard writer) once ``init_trackers`` made it; main process =
        ``accelerator.is_main_process``."""
        return cls(
            report_dir or Path(accelerator.project_dir or ".") / "precision",
            is_main_process=accelerator.is_main_process,
            trackers=accelerator_trackers(accelerator),
        )

    # ------------------------------------------------------------------ event
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
        """Snapshot ``model`` and write/log it; returns the :class:`DtypeMap`.

        ``report`` is the :class:`~hf_precision.engine.records.EnforceReport` of this event when the
        model did not match the policy (its changes become drift rows); ``view`` the event's
        walk of the model (:class:`~hf_precision.model.view.ModelView`), when the caller has one;
        ``sections`` more keys of the event JSON (``memory``, ``provenance``, ``compute``: the
        groups' ``compute`` column, ...), their numbers logged to W&B as ``precision/<key>/...``."""
        dmap = dtype_map(model, groups, policy=policy, view=view)
        dmap.note_compute(dict(sections or {}).get("compute", {}).get("groups", {}))
        # the view's root when the engine walked it (no second unwrap), else the object given
        root = view.root if view is not None else model
        base = self._baselines.get(root)
        if base is None:
            base = self._baselines[root] = _Baseline()
        diff = base.map.diff(dmap) if base.map is not None else None
        previous, first = base.event, self.last_map is None
        base.map, base.event = dmap, event
        self.last_map, self.last_event = dmap, event
        if not self.is_main_process:
            return dmap
        self.events.append((event, step))
        snap = self._snapshot(event, step, policy, report, dmap, diff, previous, first, base)
        snap.sections = json.loads(json.dumps(dict(sections or {}), default=str))
        snap.png = self._picture.render(dmap, event, step, policy, report, model)
        self._publish(snap)
        return dmap

    def _snapshot(
        self,
        event: str,
        step: int,
        policy: Any,
        report: Any,
        dmap: DtypeMap,
        diff: Any,
        previous: str | None,
        first: bool,
        base: _Baseline | None = None,
    ) -> EventSnapshot:
        """One event's rows: the module table (said once while it does not change) and the
        drift since the previous event of the same model."""
        base = _Baseline() if base is None else base
        rows, aggregated = module_table_rows(dmap, self.max_table_rows)
        unchanged = None
        if base.table is not None and not base.table[2].diff(dmap):
            unchanged = base.table[:2]
        else:
            base.table = (event, step, dmap)
        return EventSnapshot(
            event,
            step,
            policy,
            report,
            dmap,
            drift_rows(event, step, report, diff, previous),
            rows,
            aggregated,
            first,
            stem=self.files.stem(event, step),
            unchanged_since=unchanged,
        )

    def _publish(self, snap: EventSnapshot) -> None:
        """Files, the log and the trackers; a failing one warns once and never stops
        training."""
        png_path = None
        if self.report_dir is not None:
            try:
                png_path = self.files.write_event(snap, self.nonfinite, self.findings)
            except OSError as err:  # a report is an observer: it never stops training
                self._failed(
                    "files",
                    f"could not write the dtype map of {snap.event} under "
                    f"{self.report_dir} ({type(err).__name__}: {err})",
                )
        self.files.append_log(snap.text())
        if self.trackers:
            self._submit(event_payload(snap, png_path), may_warn_no_run=not snap.first)

    def _submit(self, payload: Any, *, may_warn_no_run: bool = False) -> None:
        """To every tracker; a tracker's own errors warn once, the files still go on. Only a
        dtype-map event after the first (``may_warn_no_run=True``) may say that no tracker run
        is active: a finding made before the script's run starts (at ``on_init_end``, before
        ``WandbCallback`` makes the run) waits for it quietly."""
        for name, tracker in self.trackers.items():
            try:
                tracker.submit(payload, may_warn_no_run=may_warn_no_run)
            except Exception as err:
                tracker.enabled = False  # said once below; the files go on
                self._failed(
                    name,
                    f"could not log {'the dtype map of ' if payload.module_columns else ''}"
                    f"{payload.event} to {tracker.label} ({type(err).__name__}: {err})",
                )

    def flush_trackers(self) -> None:
        """Log the events that waited for a tracker's run or writer, where it exists now (a
        loop calls this cheaply after ``init_trackers``; the plugin does at each step)."""
        for name, tracker in self.trackers.items():
            try:
                tracker.flush()
            except Exception as err:
                tracker.enabled = False
                self._failed(name, f"could not log to {tracker.label} ({err})")

    def _failed(self, what: str, detail: str) -> None:
        """Warn once per kind of report (files, each tracker); training goes on."""
        if what in self._warned:
            return
        self._warned.add(what)
        tracker = self.trackers.get(what)
        fix = (
            "Fix: pass PrecisionGuardCallback(report_dir=<a writable folder>) or report=False"
            if tracker is None
            else f"Fix: check the {tracker.label} run, or report_to without {what!r}"
        )
        warnings.warn(
            f"hf-precision report: {detail}. Training goes on; later failures of this "
            f"kind are not repeated. {fix}.",
            PrecisionWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------------ findings
    def log_finding(self, finding: Any, *, step: int) -> Path | None:
        """A watcher's :class:`~hf_precision.watch.finding.Finding` (from ``emit``): its files
        (``EventFiles.write_finding``), the trackers, the ``findings`` of later event JSONs;
        the blame and the trace keep their own files."""
        self.findings.append({**finding.to_dict(), "step": step})
        if finding.detail is not None and finding.source == "nonfinite":
            return self.log_nonfinite(finding.detail, step=step)
        if finding.detail is not None and finding.source == "trace":
            return self.log_trace(finding.detail, step=step)
        if not self.is_main_process:
            return None
        png = self._picture.finding(finding, step)
        path = self.files.write_finding(finding, step, png)
        if self.trackers:
            self._submit(finding_payload(finding, step, png, path))
        return path

    # ------------------------------------------------------------------ blame, trace
    def log_nonfinite(self, finding: Any, *, step: int) -> Path | None:
        """A :class:`~hf_precision.watch.blame.NonFinite`: its line to the log,
        ``<step>-nonfinite.json``
        (a ``nonfinite`` section, kept in every later event's JSON too) and the trackers."""
        record = finding.to_dict()
        self.nonfinite.append(record)
        if not self.is_main_process:
            return None
        self.files.append_log(record["line"], console=False)  # the speaker said it
        path = self.files.write_extra("nonfinite", step, {"nonfinite": [record]})
        if self.trackers:
            self._submit(nonfinite_payload(self.nonfinite, step))
        return path

    def log_trace(self, trace: Any, *, step: int, title: str = "") -> Path | None:
        """A :class:`~hf_precision.watch.trace.TraceResult`: its line to the log,
        ``<step>-trace.json``, the strip picture ``<step>-trace.png`` and the trackers."""
        if not self.is_main_process:
            return None
        self.files.append_log(trace.line(), console=False)  # the speaker said it
        png = self._picture.trace(trace, title or f"activation dtype trace, step {step}")
        path = self.files.write_extra("trace", step, {"trace": trace.to_dict()}, png=png)
        if self.trackers:
            png_path = path.with_suffix(".png") if path is not None and png else None
            self._submit(trace_payload(trace, step, png, png_path))
        return path


__all__ = ["PrecisionReporter"]
