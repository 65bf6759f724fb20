"""The picture of one event (:func:`hf_precision.report.plot.plot_precision`), drawn again only
when what it shows changed; matplotlib is imported here, lazily, and its absence said once."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from ..errors import PrecisionWarning
from ..model.dtype_maps import DtypeMap


class EventPicture:
    """Renders an event's PNG; ``enabled`` turns off for good when matplotlib is missing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._cache: tuple[Any, bytes] | None = None

    def render(
        self, dmap: DtypeMap, event: str, step: int, policy: Any, report: Any, model: nn.Module
    ) -> bytes | None:
        if not self.enabled:
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
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        try:
            png = plot_precision(rows, title=title, subtitle=subtitle)
        except ImportError:
            self.enabled = False
            warnings.warn(
                "hf-precision report: matplotlib is not installed, so no dtype-map "
                "picture is drawn (pip install 'hf-precision[wandb]'); tables and JSON "
                "files are written.",
                PrecisionWarning,
                stacklevel=4,
            )
            return None
        self._cache = (key, png)
        return png

    def finding(self, finding: Any, step: int) -> bytes | None:
        """The picture of a watcher's finding (one bar per group), ``None`` when it has no
        per-group numbers or matplotlib is missing."""
        if not self.enabled or not getattr(finding, "groups", None):
            return None
        try:
            from .plot import plot_finding

            return plot_finding(finding, title=f"{finding.source}, step {step}")
        except ImportError:
            return None

    def trace(self, trace: Any, title: str) -> bytes | None:
        """The strip picture of an activation dtype trace (``None`` without matplotlib)."""
        if not self.enabled:
            return None
        try:
            from .plot import plot_trace

            return plot_trace(trace, title=title)
        except ImportError:
            return None


__all__ = ["EventPicture"]
