"""Where dtype maps go: files always (JSON per event + a text table), W&B when asked."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from torch import nn

from .dtype_map import DtypeMap, dtype_map

logger = logging.getLogger("hf_precision")


class PrecisionReporter:
    """Writes ``<output_dir>/precision/<step>-<event>.json`` and logs a group table."""

    def __init__(self, report_dir: str | os.PathLike[str] | None, *, console: bool = True,
                 is_main_process: bool = True) -> None:
        self.report_dir = Path(report_dir) if report_dir is not None else None
        self.console = console
        self.is_main_process = is_main_process
        self.last_map: DtypeMap | None = None
        self.written: list[Path] = []

    @classmethod
    def from_training_args(cls, args: Any, *, report_dir: str | None = None,
                           report_to: list[str] | str | None = None) -> PrecisionReporter:
        out = report_dir or os.path.join(getattr(args, "output_dir", None) or ".", "precision")
        main = bool(getattr(args, "process_index", 0) == 0)
        return cls(out, is_main_process=main)

    def log_event(self, event: str, model: nn.Module, *, step: int, policy: Any = None,
                  groups: Any = None, report: Any = None) -> DtypeMap:
        dmap = dtype_map(model, groups, policy=policy)
        drift = self.last_map.diff(dmap) if self.last_map is not None else None
        self.last_map = dmap
        if not self.is_main_process:
            return dmap
        if self.console:
            logger.info("hf-precision %s (step %d):\n%s", event, step, dmap.table())
        if self.report_dir is not None:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            path = self.report_dir / f"{step:06d}-{event}.json"
            payload = {"event": event, "step": step,
                       "policy": policy.to_dict() if policy is not None else None,
                       "dtype_map": dmap.to_dict(),
                       "drift": drift.to_rows() if drift else [],
                       "changes": report.to_dict()["changes"] if report is not None else []}
            path.write_text(json.dumps(payload, indent=1))
            self.written.append(path)
        return dmap
