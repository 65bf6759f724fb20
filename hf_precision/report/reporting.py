"""Where dtype maps go: files always (JSON + PNG per event, a text table in the logs), W&B when
``"wandb"`` is in ``report_to``.

:class:`PrecisionGuardCallback` calls :meth:`PrecisionReporter.log_event` at ``on_init_end``,
``on_train_begin``, before and after every evaluation/prediction; the reporter can also be used
alone:

>>> import tempfile
>>> from hf_precision.report.reporting import PrecisionReporter
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
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import PrecisionError, PrecisionWarning, did_you_mean
from ..model.dtype_maps import DtypeDiff, DtypeMap, dtype_map

logger = logging.getLogger("hf_precision")

#: Above this many modules the W&B/text module table aggregates repeated layers
#: (``layers.*.mlp.up_proj``); the JSON file always keeps every module.
MAX_TABLE_ROWS = 1000
MODULE_COLUMNS = (
    "path",
    "group",
    "type",
    "dtypes",
    "buffer_dtypes",
    "devices",
    "numel",
    "bytes",
    "trainable",
    "quantized",
    "kept_fp32",
    "modules",
)
GROUP_COLUMNS = (
    "group",
    "dtypes",
    "devices",
    "numel",
    "bytes",
    "trainable",
    "quantized",
    "modules",
)
NONFINITE_COLUMNS = (
    "step",
    "module",
    "module_type",
    "role",
    "kind",
    "phase",
    "input_dtypes",
    "weight_dtypes",
    "output_dtype",
    "max_abs",
    "nonfinite",
    "fix",
)
DRIFT_COLUMNS = (
    "event",
    "step",
    "name",
    "kind",
    "group",
    "before",
    "after",
    "device_before",
    "device_after",
    "reason",
    "repaired",
)


def _known_report_to() -> tuple[str, ...]:
    """What ``TrainingArguments.report_to`` accepts (transformers' own list); only ``"wandb"``
    is acted on here."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    return ("all", "none", *INTEGRATION_TO_CALLBACK)


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def wants_wandb(report_to: list[str] | str | None, *, call: str = "report_to") -> bool:
    """Does a ``report_to`` value (as in ``TrainingArguments``) ask for W&B?"""
    if report_to is None:
        return False
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    for name in names:
        if isinstance(name, str) and name.lower() in ("wandb", "all", "none"):
            continue  # no need to import transformers' integrations (5 s) for these
        known = _known_report_to()
        if not isinstance(name, str) or name.lower() not in known:
            hint = did_you_mean(str(name).lower(), known)
            raise PrecisionError(
                f"{call}={report_to!r}: unknown integration {name!r}.{hint}\n"
                f"Allowed: {', '.join(known)}.\nFix: pass e.g. report_to=['wandb']."
            )
    lowered = [n.lower() for n in names]
    return "none" not in lowered and ("wandb" in lowered or "all" in lowered)


# ---------------------------------------------------------------------------- rows
def module_table_rows(
    dmap: DtypeMap, max_rows: int = MAX_TABLE_ROWS
) -> tuple[list[dict[str, Any]], int]:
    """Per-module rows, aggregated when there are more than ``max_rows`` modules.

    Returns ``(rows, aggregated)``: ``aggregated`` is how many module rows were folded into
    others (0 when none). Folding first merges repeated layers whose dtypes/devices agree
    (``...layers.*.mlp``), then, if still too many, whole groups by module type; numel, bytes,
    trainable and quantized counts are summed, so nothing is dropped.
    """
    rows = dmap.module_rows()
    for r in rows:
        r["modules"] = 1
    if len(rows) <= max_rows:
        return rows, 0
    for level in (0, 1):
        merged: dict[tuple[Any, ...], dict[str, Any]] = {}
        for r in rows:
            path = _INDEX.sub("*", r["path"]) if level == 0 else f"{r['group']}.*"
            key = (
                path,
                r["group"],
                r["type"],
                r["dtypes"],
                r["buffer_dtypes"],
                r["devices"],
                r["kept_fp32"],
            )
            m = merged.get(key)
            if m is None:
                merged[key] = {**r, "path": path}
                continue
            for k in ("numel", "bytes", "trainable", "quantized", "modules"):
                m[k] += r[k]
        rows = list(merged.values())
        if len(rows) <= max_rows:
            break
    return rows, len(dmap.records) - len(rows)


def drift_rows(
    event: str, step: int, report: Any, diff: DtypeDiff | None, previous_event: str | None
) -> list[dict[str, Any]]:
    """What did not match at this event: tensors against the policy (from the
    :class:`~hf_precision.engine.enforce.EnforceReport`) and modules whose map changed since the
    previous event."""
    rows: list[dict[str, Any]] = []
    applied = bool(getattr(report, "applied", False))
    casts = list(getattr(report, "wrapper_casts", None) or ())
    for c in [*(getattr(report, "changes", None) or ()), *casts]:
        rows.append(
            {
                "event": event,
                "step": step,
                "name": c.name,
                "kind": c.kind,
                "group": c.group,
                "before": c.before,
                "after": c.after,
                "device_before": c.device_before,
                "device_after": c.device_after,
                "reason": c.reason,
                "repaired": applied and c not in casts,
                "mismatch": True,
            }
        )
    for ch in diff or ():
        before, after = ch.before, ch.after
        if (
            before is not None
            and after is not None
            and before.dtypes == after.dtypes
            and before.devices == after.devices
        ):
            continue  # counts or trainability changed, not precision: no drift
        rec = after if after is not None else before
        rows.append(
            {
                "event": event,
                "step": step,
                "name": ch.path,
                "kind": "module",
                "group": rec.group if rec is not None else "",
                "before": "/".join(before.dtypes) if before else "(absent)",
                "after": "/".join(after.dtypes) if after else "(absent)",
                "device_before": "/".join(before.devices) if before else "",
                "device_after": "/".join(after.devices) if after else "",
                "reason": f"map changed since {previous_event}",
                "repaired": False,
                "mismatch": False,
            }
        )
    return rows


def section_scalars(sections: Mapping[str, Any], prefix: str = "precision") -> dict[str, float]:
    """The numbers of an event's extra sections, flattened for W&B
    (``precision/lost_updates/share``, ``precision/memory/decisions/trainable_upcast/bytes``);
    lists are left to the JSON."""
    out: dict[str, float] = {}
    for key, value in sections.items():
        name = f"{prefix}/{str(key).replace(' ', '_')}"
        if isinstance(value, Mapping):
            out.update(section_scalars(value, name))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out


def mismatch_counts(report: Any) -> dict[str, int]:
    """``{"found", "repaired", "open"}``: the tensors an event's
    :class:`~hf_precision.engine.enforce.EnforceReport` found off the policy, those it cast back
    (an applied report's changes) and those still off (an audit's changes, a wrapper's casts).

    >>> mismatch_counts(None)
    {'found': 0, 'repaired': 0, 'open': 0}
    """
    changes = len(getattr(report, "changes", None) or ())
    held = len(getattr(report, "wrapper_casts", None) or ())
    repaired = changes if getattr(report, "applied", False) else 0
    return {"found": changes + held, "repaired": repaired, "open": changes + held - repaired}


# ---------------------------------------------------------------------------- reporter
@dataclass
class _Snapshot:
    """One event as the reporter writes it: the map, its drift rows, its table rows."""

    event: str
    step: int
    policy: Any
    report: Any  # the event's EnforceReport when the model did not match, else None
    dmap: DtypeMap
    drift: list[dict[str, Any]]
    rows: list[dict[str, Any]]  # the module table (repeated layers aggregated)
    aggregated: int  # module rows folded into repeated-layer rows
    first: bool  # the reporter's first event
    stem: str  # the event's file names, without suffix: unique in the report folder
    #: ``(event, step)`` of the last event that logged the table, when the map is the same
    unchanged_since: tuple[str, int] | None = None
    png: bytes | None = None
    sections: dict[str, Any] = field(default_factory=dict)

    @property
    def mismatches(self) -> dict[str, int]:
        """Tensors off the policy at this event: ``found``, ``repaired`` (cast back by this
        event) and ``open`` (still off: an audit, or what a wrapper cast and the guard may not
        undo)."""
        return mismatch_counts(self.report)

    def text(self) -> str:
        """What the event writes to the log: the group table (or one line when the map is the
        one the last table showed), the mismatches, the drift, where the rest is."""
        dmap, drift, stem = self.dmap, self.drift, self.stem
        head = f"hf-precision {self.event} (step {self.step})"
        counts = self.mismatches
        found = (
            f"{counts['found']} tensor(s) off the policy: {counts['repaired']} repaired, "
            f"{counts['open']} open"
            if counts["found"]
            else ""
        )
        if self.unchanged_since is not None:
            event, step = self.unchanged_since
            text = f"{head}: dtypes/devices unchanged since {event} (step {step})"
            text += f"; {found}" if found else ""
            text += f"; {stem}.json"
        else:
            text = dmap.table(title=head, use_rich=None)
            text += f"\n{found}" if found else ""
        if drift:
            text += (
                f"\ndrift ({len(drift)} row(s)): "
                + "; ".join(f"{r['name']} {r['before']}->{r['after']}" for r in drift[:5])
                + (f"; ... {len(drift) - 5} more in {stem}.json" if len(drift) > 5 else "")
            )
        if self.aggregated:
            text += (
                f"\n(module table: {self.aggregated} of {len(dmap)} module rows aggregated into "
                f"repeated-layer rows; {stem}.json has every module)"
            )
        return text


class PrecisionReporter:  # implements hf_precision.model.reporter.Reporter
    # (tests/model/test_reporter.py)
    """Writes the dtype map of each event to files and, when asked, to W&B.

    Args:
        report_dir: folder for the files (``None``: no files).
        console: log the text table through the ``hf_precision`` logger.
        is_main_process: only the main process writes and logs.
        wandb: log to the active W&B run.
        wandb_run: where that run comes from (default ``wandb.run``), called at each event.
        max_table_rows: above this many modules the tables aggregate repeated layers (and say
            how many rows were folded); the JSON files keep every module.
        picture: render the PNG (needs matplotlib; a warning once when it is missing).
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
    ) -> None:
        self.report_dir = Path(report_dir) if report_dir is not None else None
        self.console = console
        self.is_main_process = is_main_process
        self.max_table_rows = max_table_rows
        self.picture = picture
        self.last_map: DtypeMap | None = None
        self.last_event: str | None = None
        self.written: list[Path] = []
        self.events: list[tuple[str, int]] = []
        self.wandb: Any = None
        self._png_cache: tuple[Any, bytes] | None = None
        self._stems: dict[str, int] = {}  # <step>-<event> -> the next number to try
        self._table: tuple[str, int, DtypeMap] | None = None  # the last event logged in full
        self._warned: set[str] = set()  # kinds of report failure already warned about
        #: the blame's findings so far (``NonFinite.to_dict()``): every later event's JSON
        #: carries them as ``nonfinite``
        self.nonfinite: list[dict[str, Any]] = []
        if wandb and is_main_process:
            from .report_wandb import WandbSink

            self.wandb = WandbSink(wandb_run)

    @classmethod
    def from_training_args(
        cls,
        args: Any,
        *,
        report_dir: str | os.PathLike[str] | None = None,
        report_to: list[str] | str | None = None,
    ) -> PrecisionReporter:
        """Files in ``report_dir`` (default ``<output_dir>/precision``); W&B when ``report_to``
        (default ``args.report_to``) names ``"wandb"``; main process = ``process_index == 0``."""
        out = report_dir or os.path.join(getattr(args, "output_dir", None) or ".", "precision")
        main = bool(getattr(args, "process_index", 0) == 0)
        if report_to is not None:
            use_wandb = wants_wandb(report_to, call="PrecisionGuardCallback(report_to)")
        else:
            use_wandb = wants_wandb(
                getattr(args, "report_to", None) or [], call="TrainingArguments.report_to"
            )
        return cls(out, is_main_process=main, wandb=use_wandb)

    @classmethod
    def from_accelerator(
        cls, accelerator: Any, *, report_dir: str | os.PathLike[str] | None = None
    ) -> PrecisionReporter:
        """Files in ``report_dir`` (default ``<project_dir or .>/precision``); W&B when
        ``log_with`` names wandb, into the run of accelerate's wandb tracker once
        ``init_trackers`` made it; main process = ``accelerator.is_main_process``."""
        names = [str(getattr(t, "value", t)).lower() for t in (accelerator.log_with or [])]

        def tracker_run() -> Any:
            if any(t.name == "wandb" for t in accelerator.trackers):
                return accelerator.get_tracker("wandb", unwrap=True)
            return None

        return cls(
            report_dir or Path(accelerator.project_dir or ".") / "precision",
            is_main_process=accelerator.is_main_process,
            wandb=any("wandb" in n for n in names),
            wandb_run=tracker_run,
        )

    # ------------------------------------------------------------------ picture
    def _render_png(
        self, dmap: DtypeMap, event: str, step: int, policy: Any, report: Any, model: nn.Module
    ) -> bytes | None:
        if not self.picture:
            return None
        from .plot import PICTURE_SIZE, picture_rows, plot_precision  # matplotlib: lazily, below

        trainable: list[str] = []
        if getattr(report, "wrapper_casts", None):  # to place what a wrapper cast by role
            trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        # no report: the event's audit found the model on the policy (log_event's contract)
        rows = picture_rows(
            dmap, policy=policy, report=report, trainable_names=trainable, checked=True
        )
        title = f"{dmap.model_type or 'model'}: {event}, step {step}"
        subtitle = f"policy {policy.describe()}" if policy is not None else ""
        # The key is everything the picture draws: the same key, the same picture.
        key = (tuple(rows), title, subtitle, PICTURE_SIZE)
        if self._png_cache is not None and self._png_cache[0] == key:
            return self._png_cache[1]
        try:
            png = plot_precision(rows, title=title, subtitle=subtitle)
        except ImportError:
            self.picture = False
            warnings.warn(
                "hf-precision report: matplotlib is not installed, so no dtype-map "
                "picture is drawn (pip install 'hf-precision[wandb]'); tables and JSON "
                "files are written.",
                PrecisionWarning,
                stacklevel=3,
            )
            return None
        self._png_cache = (key, png)
        return png

    def _stem(self, event: str, step: int) -> str:
        """``<step>-<event>``, or ``<step>-<event>-<n>`` when that name was taken (an
        evaluation at the step where another one ran, an earlier run in the same folder): no
        event overwrites another's files."""
        base = f"{step:06d}-{event}"
        n = self._stems.get(base, 1)
        stem = base if n == 1 else f"{base}-{n}"
        while self.report_dir is not None and any(
            (self.report_dir / f"{stem}{ext}").exists() for ext in (".json", ".png")
        ):
            n += 1
            stem = f"{base}-{n}"
        self._stems[base] = n + 1  # the next event of this name starts after this one
        return stem

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

        ``report`` is the :class:`~hf_precision.engine.enforce.EnforceReport` of this event when the
        model did not match the policy (its changes become drift rows); ``view`` the event's
        walk of the model (:class:`~hf_precision.model.view.ModelView`), when the caller has one;
        ``sections`` more top-level keys of the event JSON (``memory``, ``provenance``,
        ``lost_updates``), their numbers also logged to W&B as ``precision/<section>/...``.
        """
        dmap = dtype_map(model, groups, policy=policy, view=view)
        diff = self.last_map.diff(dmap) if self.last_map is not None else None
        previous, first = self.last_event, self.last_map is None
        self.last_map, self.last_event = dmap, event
        if not self.is_main_process:
            return dmap
        self.events.append((event, step))
        snap = self._snapshot(event, step, policy, report, dmap, diff, previous, first)
        snap.sections = json.loads(json.dumps(dict(sections or {}), default=str))
        snap.png = self._render_png(dmap, event, step, policy, report, model)
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
    ) -> _Snapshot:
        """One event's rows: the module table (said once while it does not change) and the
        drift since the previous event."""
        rows, aggregated = module_table_rows(dmap, self.max_table_rows)
        unchanged = None
        if self._table is not None and not self._table[2].diff(dmap):
            unchanged = self._table[:2]
        else:
            self._table = (event, step, dmap)
        return _Snapshot(
            event,
            step,
            policy,
            report,
            dmap,
            drift_rows(event, step, report, diff, previous),
            rows,
            aggregated,
            first,
            stem=self._stem(event, step),
            unchanged_since=unchanged,
        )

    def _publish(self, snap: _Snapshot) -> None:
        """Files, the log and W&B; a failing one warns once and never stops training."""
        event = snap.event
        png_path = None
        if self.report_dir is not None:
            try:
                png_path = self._write_event_files(snap)
            except OSError as err:  # a report is an observer: it never stops training
                self._failed(
                    "files",
                    f"could not write the dtype map of {event} under "
                    f"{self.report_dir} ({type(err).__name__}: {err})",
                )
        self._append_log(snap.text())
        if self.wandb is not None:
            try:
                self._to_wandb(snap, png_path)
            except Exception as err:  # W&B's own errors: warn once, the files still go on
                self._failed(
                    "wandb",
                    f"could not log the dtype map of {event} to W&B ({type(err).__name__}: {err})",
                )

    def _append_log(self, text: str) -> None:
        if self.console:
            logger.info("%s", text)
        if self.report_dir is None:
            return
        try:
            with open(self.report_dir / "precision.log", "a", encoding="utf-8") as fh:
                fh.write(text + "\n\n")
        except OSError as err:
            self._failed(
                "files",
                f"could not append to {self.report_dir / 'precision.log'} "
                f"({type(err).__name__}: {err})",
            )

    def _failed(self, what: str, detail: str) -> None:
        """Warn once per kind of report (files, W&B); training goes on."""
        if what in self._warned:
            return
        self._warned.add(what)
        fix = (
            "Fix: pass PrecisionGuardCallback(report_dir=<a writable folder>) or report=False"
            if what == "files"
            else "Fix: check the W&B run, or report_to without 'wandb'"
        )
        warnings.warn(
            f"hf-precision report: {detail}. Training goes on; later failures of this "
            f"kind are not repeated. {fix}.",
            PrecisionWarning,
            stacklevel=3,
        )

    def _write_event_files(self, snap: _Snapshot) -> Path | None:
        assert self.report_dir is not None
        self.report_dir.mkdir(parents=True, exist_ok=True)
        png_path = None
        if snap.png is not None:
            png_path = self.report_dir / f"{snap.stem}.png"
            png_path.write_bytes(snap.png)
            self.written.append(png_path)
        path = self.report_dir / f"{snap.stem}.json"
        report = snap.report.to_dict() if snap.report is not None else {}
        payload = {
            "event": snap.event,
            "step": snap.step,
            "policy": snap.policy.to_dict() if snap.policy is not None else None,
            "mismatches": snap.mismatches,
            "unchanged_since": (
                dict(zip(("event", "step"), snap.unchanged_since))
                if snap.unchanged_since is not None
                else None
            ),
            "bytes_by_dtype": snap.dmap.bytes_by_dtype,
            "dtype_map": snap.dmap.to_dict(),
            "drift": snap.drift,
            "changes": report.get("changes", []),
            "wrapper_casts": report.get("wrapper_casts", []),
            "wrapper_findings": report.get("wrapper_findings", []),
            "kept": report.get("kept", []),
            "outside_reads": report.get("outside_reads", []),
            "nonfinite": self.nonfinite,
            "picture": png_path.name if png_path is not None else None,
            **snap.sections,
        }
        path.write_text(json.dumps(payload, indent=1))
        self.written.append(path)
        return png_path

    def _to_wandb(self, snap: _Snapshot, png_path: Path | None) -> None:
        from .report_wandb import WandbPayload

        scalars: dict[str, float | int] = {
            f"precision/bytes/{d}": b for d, b in sorted(snap.dmap.bytes_by_dtype.items())
        }
        for kind, n in snap.mismatches.items():
            scalars[f"precision/mismatches/{kind}"] = n
        scalars["precision/modules_aggregated"] = snap.aggregated
        scalars.update(section_scalars(snap.sections))
        group_rows = snap.dmap.group_rows()
        self.wandb.submit(
            WandbPayload(
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
            ),
            first_event=snap.first,
        )

    # ------------------------------------------------------------------ blame, trace
    def log_nonfinite(self, finding: Any, *, step: int) -> Path | None:
        """A :class:`~hf_precision.engine.blame.NonFinite`: its line to the log,
        ``<step>-nonfinite.json``
        (a ``nonfinite`` section, kept in every later event's JSON too) and W&B."""
        record = finding.to_dict()
        self.nonfinite.append(record)
        if not self.is_main_process:
            return None
        self._append_log(record["line"])
        path = self._write_extra("nonfinite", step, {"nonfinite": [record]})
        if self.wandb is not None:
            from .report_wandb import WandbPayload

            columns = list(NONFINITE_COLUMNS)
            self._submit_extra(
                WandbPayload(
                    "nonfinite",
                    step,
                    [],
                    [],
                    [],
                    [],
                    [],
                    [],
                    tables={
                        "precision/nonfinite": (
                            columns,
                            [
                                [
                                    str(record[c]) if isinstance(record[c], tuple) else record[c]
                                    for c in columns
                                ]
                                for record in self.nonfinite
                            ],
                        )
                    },
                    summary={
                        f"precision/nonfinite/{k}": record[k]
                        for k in ("module", "role", "kind", "phase", "line")
                    },
                ),
            )
        return path

    def log_trace(self, trace: Any, *, step: int, title: str = "") -> Path | None:
        """A :class:`~hf_precision.engine.trace.TraceResult`: its line to the log,
        ``<step>-trace.json``,
        the strip picture ``<step>-trace.png`` and W&B."""
        if not self.is_main_process:
            return None
        self._append_log(trace.line())
        png = None
        if self.picture:
            try:
                from .plot import plot_trace

                png = plot_trace(trace, title=title or f"activation dtype trace, step {step}")
            except ImportError:
                png = None
        path = self._write_extra("trace", step, {"trace": trace.to_dict()}, png=png)
        if self.wandb is not None:
            from .report_wandb import WandbPayload

            columns = ["index", "module", "module_type", "before", "after", "cause", "detail"]
            first = trace.first_change
            self._submit_extra(
                WandbPayload(
                    "trace",
                    step,
                    [],
                    [],
                    [],
                    [],
                    [],
                    [],
                    png=png,
                    png_path=path.with_suffix(".png") if path is not None and png else None,
                    tables={
                        "precision/trace": (
                            columns,
                            [[getattr(c, k) for k in columns] for c in trace.changes],
                        )
                    },
                    summary={"precision/trace/first_change": first.line() if first else "none"},
                ),
            )
        return path

    def _write_extra(
        self, kind: str, step: int, body: dict[str, Any], png: bytes | None = None
    ) -> Path | None:
        if self.report_dir is None:
            return None
        stem = self._stem(kind, step)
        try:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            path = self.report_dir / f"{stem}.json"
            path.write_text(json.dumps({"event": kind, "step": step, **body}, indent=1))
            self.written.append(path)
            if png is not None:
                (self.report_dir / f"{stem}.png").write_bytes(png)
                self.written.append(self.report_dir / f"{stem}.png")
        except OSError as err:
            self._failed("files", f"could not write {kind} under {self.report_dir} ({err})")
            return None
        return path

    def _submit_extra(self, payload: Any) -> None:
        try:
            self.wandb.submit(payload, first_event=False)
        except Exception as err:  # W&B's own errors: warn once, the files still go on
            self._failed("wandb", f"could not log {payload.event} to W&B ({err})")
