"""TensorBoard side of the precision report: a guest in the event files the script's own tracker
writes (a :class:`~hf_precision.report.trackers.Tracker`).

Where the events go:

* under accelerate (``Accelerator(log_with="tensorboard")``, diffusers' scripts'
  ``--report_to tensorboard``): into the ``SummaryWriter`` of the accelerator's TensorBoard
  tracker (``accelerator.get_tracker("tensorboard", unwrap=True)``), the same event file the
  script logs its loss to, once ``init_trackers`` made it; events before that wait;
* under a ``transformers.Trainer`` with ``"tensorboard"`` in ``report_to``: into the writer of
  transformers' ``TensorBoardCallback`` (made at ``on_train_begin``, in ``args.logging_dir`` on
  transformers 4.x, ``TENSORBOARD_LOGGING_DIR`` or ``<output_dir>/runs/<date>_<host>`` on 5.x);
  when that callback's writer is closed, or there is no such callback, a writer of its own in the
  same folder (TensorBoard reads every event file of a folder as one run).

The writer is never closed here (only one this module opened is flushed). Only the main process
logs. ``tensorboard`` (or ``tensorboardX``) missing: one :class:`PrecisionWarning`, said only
when TensorBoard was asked for; the files are written regardless.

What one event logs, at the event's step::

    precision/bytes/<dtype>, precision/mismatches/{found,repaired,open}, precision/kept,
    precision/modules_aggregated, precision/<section>/...      scalars (as the W&B adapter)
    precision/<event>/modules, precision/<event>/groups, precision/drift   text (markdown tables)
    precision/policy                                           text
    precision/<event>/picture                                  image (with Pillow)

The blame and the trace log ``precision/nonfinite`` and ``precision/trace`` as text tables and
their summary entries (``precision/nonfinite/line``, ``precision/trace/first_change``) as text.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import PrecisionWarning
from .trackers import TrackerPayload

#: Events kept while the writer does not exist yet (older ones are still in the files).
MAX_PENDING = 32
_said_missing = False  # the missing package is said once per process


def tensorboard_missing() -> bool:
    """Neither ``tensorboard`` (for ``torch.utils.tensorboard``) nor ``tensorboardX``."""
    for name in ("tensorboard", "tensorboardX"):
        try:
            __import__(name)
        except ImportError:
            continue
        return False
    return True


def in_all() -> bool:
    """``report_to="all"`` includes TensorBoard where it is installed (as transformers')."""
    return not tensorboard_missing()


def markdown_table(columns: list[Any], rows: list[list[Any]]) -> str:
    """A table TensorBoard's text tab draws.

    >>> print(markdown_table(["a", "b"], [[1, "x|y"]]))
    | a | b |
    |---|---|
    | 1 | x\\|y |
    """

    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class OwnWriter:
    """A ``SummaryWriter`` this module opened in a folder (one per folder at a time)."""

    def __init__(self) -> None:
        self.writer: Any = None
        self.log_dir: str | None = None

    def at(self, log_dir: str | os.PathLike[str] | None) -> Any:
        log_dir = None if log_dir is None else os.fspath(log_dir)
        if self.writer is None or log_dir != self.log_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                from tensorboardX import SummaryWriter  # type: ignore[no-redef]
            self.writer, self.log_dir = SummaryWriter(log_dir=log_dir), log_dir
        return self.writer


class TensorBoardSink:
    """Logs :class:`~hf_precision.report.trackers.TrackerPayload` objects to a
    ``SummaryWriter``, once ``source()`` returns one (default: a writer of its own in
    ``TENSORBOARD_LOGGING_DIR``, else ``runs/<date>_<host>``)."""

    label = "TensorBoard"

    def __init__(self, source: Callable[[], Any] | None = None) -> None:
        global _said_missing
        own = OwnWriter()
        self.find_writer = source or (lambda: own.at(os.environ.get("TENSORBOARD_LOGGING_DIR")))
        self.enabled = True
        self.pending: list[TrackerPayload] = []
        self.logged: list[tuple[str, int]] = []  # (event, step) for inspection
        if tensorboard_missing():
            self.enabled = False
            if not _said_missing:
                _said_missing = True
                warnings.warn(
                    "hf-precision TensorBoard report: tensorboard is not installed, so dtype "
                    "maps go to the files only. Fix: pip install tensorboard, or report_to "
                    "without 'tensorboard'.",
                    PrecisionWarning,
                    stacklevel=4,
                )

    def submit(self, payload: TrackerPayload, *, may_warn_no_run: bool) -> None:
        """Log now when the writer exists, otherwise keep the payload for later."""
        if not self.enabled:
            return
        self.pending.append(payload)
        if len(self.pending) > MAX_PENDING:
            self.pending.pop(0)
        self.flush()

    def flush(self) -> None:
        """Log what waits, if the writer exists now. Its errors reach the reporter, which warns
        once and goes on."""
        if not self.enabled or not self.pending:
            return
        writer = self.find_writer()
        if writer is None:
            return
        while self.pending:
            self._log(writer, self.pending[0])
            p = self.pending.pop(0)
            self.logged.append((p.event, p.step))
        writer.flush()

    def _log(self, writer: Any, p: TrackerPayload) -> None:
        for key, value in p.scalars.items():
            writer.add_scalar(key, value, global_step=p.step)
        tables = dict(p.tables)
        if p.module_columns:
            tables[f"precision/{p.event}/modules"] = (p.module_columns, p.module_rows)
            tables[f"precision/{p.event}/groups"] = (p.group_columns, p.group_rows)
        if p.drift_rows:
            tables["precision/drift"] = (p.drift_columns, p.drift_rows)
        for key, (columns, rows) in tables.items():
            writer.add_text(key, markdown_table(columns, rows), global_step=p.step)
        texts = {"precision/policy": p.policy} if p.policy is not None else {}
        texts.update({k: str(v) for k, v in p.summary.items()})
        for key, text in texts.items():
            writer.add_text(key, text, global_step=p.step)
        image = _image(p.png)
        if image is not None:
            writer.add_image(
                f"precision/{p.event}/picture", image, global_step=p.step, dataformats="HWC"
            )


def _image(png: bytes | None) -> Any:
    """The picture as an HWC array (``None`` without a picture or Pillow)."""
    if png is None:
        return None
    try:
        import io

        import numpy as np
        from PIL import Image
    except ImportError:
        return None
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


# ---------------------------------------------------------------------------- a Trainer
def logging_dir(args: Any) -> str:
    """The folder transformers' ``TensorBoardCallback`` writes to when it has no writer to say
    it: ``args.logging_dir`` (4.x), ``TENSORBOARD_LOGGING_DIR``, else ``<output_dir>/runs``."""
    return (
        getattr(args, "logging_dir", None)
        or os.environ.get("TENSORBOARD_LOGGING_DIR")
        or os.path.join(getattr(args, "output_dir", None) or ".", "runs")
    )


def tensorboard_callback(trainer: Any) -> Any:
    """transformers' ``TensorBoardCallback`` among the Trainer's callbacks, or ``None``."""
    handler = getattr(trainer, "callback_handler", None)
    for cb in getattr(handler, "callbacks", ()):
        if any(c.__name__ == "TensorBoardCallback" for c in type(cb).__mro__):
            return cb
    return None


def trainer_source(args: Any, trainer: Any) -> Callable[[], Any]:
    """Under a Trainer: the writer of its ``TensorBoardCallback`` (``None`` until that callback
    made it at ``on_train_begin``); once it closed it (``on_train_end``), or without one, a
    writer of this module's own in the folder that callback writes to."""
    ref = weakref.ref(trainer) if trainer is not None else None
    own = OwnWriter()

    def source() -> Any:
        cb = tensorboard_callback(ref() if ref is not None else None)
        if cb is None:
            return own.at(logging_dir(args))
        if getattr(cb, "tb_writer", None) is not None:
            return cb.tb_writer
        folder = getattr(cb, "logging_dir", None)  # 5.x: known from on_train_begin on
        return own.at(folder) if folder is not None else None

    return source


#: the :class:`~hf_precision.report.trackers.Tracker` of this module (the table's entry point)
Sink = TensorBoardSink

__all__ = [
    "TensorBoardSink",
    "in_all",
    "logging_dir",
    "markdown_table",
    "tensorboard_callback",
    "tensorboard_missing",
    "trainer_source",
]
