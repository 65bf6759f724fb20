"""The reporter's files in ``<report_dir>``: ``<step>-<event>.json`` and ``.png`` per event,
``<step>-<source>.json`` (and ``.png``) per watcher's finding (``<step>-nonfinite.json`` /
``<step>-trace.json`` for the blame and the trace), and one block per event, one line per
finding, appended to ``precision.log``. A name already taken gets ``-2``, ``-3``, ...: no event
overwrites another's files. A file that cannot be written is said through ``failed`` (the
reporter warns once per kind) and never stops training.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .snapshot import EventSnapshot

logger = logging.getLogger("hf_precision")


class EventFiles:
    """Writes an event's files under ``report_dir`` (``None``: no files, the log line only)."""

    def __init__(
        self, report_dir: Path | None, *, console: bool, failed: Callable[[str, str], None]
    ) -> None:
        self.report_dir = report_dir
        self.console = console
        self.failed = failed  # (kind, detail): the reporter's warn-once
        self.written: list[Path] = []
        self._stems: dict[str, int] = {}  # <step>-<event> -> the next number to try

    def stem(self, event: str, step: int) -> str:
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

    def append_log(self, text: str, *, console: bool = True) -> None:
        """``text`` to ``precision.log`` (and to the ``hf_precision`` logger at INFO when the
        reporter has a console and ``console``: a finding's line is the speaker's)."""
        if self.console and console:
            logger.info("%s", text)
        if self.report_dir is None:
            return
        try:
            self.report_dir.mkdir(parents=True, exist_ok=True)  # a finding before any event
            with open(self.report_dir / "precision.log", "a", encoding="utf-8") as fh:
                fh.write(text + "\n\n")
        except OSError as err:
            self.failed(
                "files",
                f"could not append to {self.report_dir / 'precision.log'} "
                f"({type(err).__name__}: {err})",
            )

    def write_event(
        self,
        snap: EventSnapshot,
        nonfinite: list[dict[str, Any]],
        findings: list[dict[str, Any]] | None = None,
    ) -> Path | None:
        """The event's JSON and picture; returns the picture's path (``None``: none written).
        Raises ``OSError``."""
        assert self.report_dir is not None
        self.report_dir.mkdir(parents=True, exist_ok=True)
        png_path = None
        if snap.png is not None:
            png_path = self.report_dir / f"{snap.stem}.png"
            png_path.write_bytes(snap.png)
            self.written.append(png_path)
        path = self.report_dir / f"{snap.stem}.json"
        path.write_text(json.dumps(event_json(snap, nonfinite, png_path, findings), indent=1))
        self.written.append(path)
        return png_path

    def write_finding(self, finding: Any, step: int, png: bytes | None) -> Path | None:
        """A watcher's finding: its words in ``precision.log`` (the console line is the
        speaker's), ``<step>-<source>.json`` (its numbers under ``<source>``, the finding under
        ``finding``) and its picture ``<step>-<source>.png``."""
        self.append_log(finding.words(step), console=False)
        body = {finding.source: dict(finding.numbers), "finding": finding.to_dict()}
        return self.write_extra(finding.source, step, body, png=png)

    def write_extra(
        self, kind: str, step: int, body: dict[str, Any], png: bytes | None = None
    ) -> Path | None:
        """``<step>-<kind>.json`` (and ``.png``) for a watcher's finding."""
        if self.report_dir is None:
            return None
        stem = self.stem(kind, step)
        try:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            path = self.report_dir / f"{stem}.json"
            path.write_text(json.dumps({"event": kind, "step": step, **body}, indent=1))
            self.written.append(path)
            if png is not None:
                (self.report_dir / f"{stem}.png").write_bytes(png)
                self.written.append(self.report_dir / f"{stem}.png")
        except OSError as err:
            self.failed("files", f"could not write {kind} under {self.report_dir} ({err})")
            return None
        return path


def event_json(
    snap: EventSnapshot,
    nonfinite: list[dict[str, Any]],
    png_path: Path | None,
    findings: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """What ``<step>-<event>.json`` holds: the full map, the drift, the policy, the mismatch
    counts, the engine's findings, the blame's findings so far, every watcher's finding so far
    (``findings``) and the extra sections."""
    report = snap.report.to_dict() if snap.report is not None else {}
    return {
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
        "nonfinite": nonfinite,
        "findings": list(findings or []),
        "picture": png_path.name if png_path is not None else None,
        **snap.sections,
    }


__all__ = ["EventFiles", "event_json"]
