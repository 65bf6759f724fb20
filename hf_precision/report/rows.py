"""The rows of an event: the module table (repeated layers aggregated above
:data:`MAX_TABLE_ROWS`), the drift rows, the mismatch counts and the flattened numbers of an
event's extra sections. Plain data: the files and the trackers take them as they are."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..model.dtype_maps import DtypeDiff, DtypeMap

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
    "fp8",
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
    "fp8",
    "compute",
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


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


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
                r["fp8"],
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
    :class:`~hf_precision.engine.records.EnforceReport`) and modules whose map changed since the
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
    :class:`~hf_precision.engine.records.EnforceReport` found off the policy, those it cast back
    (an applied report's changes) and those still off (an audit's changes, a wrapper's casts).

    >>> mismatch_counts(None)
    {'found': 0, 'repaired': 0, 'open': 0}
    """
    changes = len(getattr(report, "changes", None) or ())
    held = len(getattr(report, "wrapper_casts", None) or ())
    repaired = changes if getattr(report, "applied", False) else 0
    return {"found": changes + held, "repaired": repaired, "open": changes + held - repaired}


__all__ = [
    "DRIFT_COLUMNS",
    "GROUP_COLUMNS",
    "MAX_TABLE_ROWS",
    "MODULE_COLUMNS",
    "NONFINITE_COLUMNS",
    "drift_rows",
    "mismatch_counts",
    "module_table_rows",
    "section_scalars",
]
