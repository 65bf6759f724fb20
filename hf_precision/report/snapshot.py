"""One event as the reporter assembles it (:class:`EventSnapshot`): the map, its drift and table
rows, the picture, the extra sections, and the text block it writes to the log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..model.dtype_maps import DtypeMap
from .rows import mismatch_counts


@dataclass
class EventSnapshot:
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


__all__ = ["EventSnapshot"]
