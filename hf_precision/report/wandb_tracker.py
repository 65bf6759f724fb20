"""W&B side of the precision report: a guest in the run that ``WandbCallback`` owns.

Rules (same as transformers' own trackers): ``wandb`` is imported only here and only when W&B
reporting is wanted; the run is never created nor finished here (``wandb.run`` is reused once
``WandbCallback.on_train_begin`` / ``on_log`` made it); everything is logged with a
``train/global_step`` key rather than ``step=`` (``WandbCallback`` defines it as the step metric);
only the main process logs. Events that fire before the run exists (``on_init_end``) are kept and
logged when it appears. Any W&B problem gives one :class:`PrecisionWarning` and turns W&B
reporting off; the files are written regardless.

What one event logs (``<event>`` is ``on_train_begin``, ``on_evaluate`` …)::

    precision/<event>/modules   wandb.Table, one row per module that owns tensors
    precision/<event>/groups    wandb.Table, one row per group
    precision/<event>/picture   wandb.Image, the report's picture
    (hf_precision.report.plot.plot_precision)
    precision/drift             wandb.Table, only when something did not match (event column)
    precision/bytes/<dtype>, precision/modules_aggregated   numbers
    precision/mismatches/found, .../repaired, .../open      tensors off the policy at the event:
                                found, cast back by the guard, still off
    summary: precision/policy and the numbers above

The blame and the trace (``hf_precision.watch.blame``, ``hf_precision.watch.trace``) log::

    precision/nonfinite         wandb.Table, one row per finding (module, role, kind, pass,
                                dtypes, value, fix); summary: precision/nonfinite/module,
                                .../role, .../kind, .../line
    precision/trace             wandb.Table, the modules whose output dtype differs from their
                                input's; precision/trace/picture; summary:
                                precision/trace/first_change
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import PrecisionWarning
from .trackers import TrackerPayload

#: Events kept while no run exists (older ones are still in the files).
MAX_PENDING = 32
_QUIET_MODES = ("offline", "disabled", "dryrun")


def wandb_offline_unless_logged_in(environ: Any = None) -> bool:
    """Before a run that reports to W&B: with no API key to be found (``WANDB_API_KEY``, or a
    ``wandb login`` entry in the netrc file) and ``WANDB_MODE`` unset, switch this process to
    offline mode and say so in one line, instead of letting ``wandb.init`` end the run in a
    ``UsageError`` traceback. Returns ``True`` when it switched. Reads no network.

    >>> wandb_offline_unless_logged_in({"WANDB_MODE": "offline"})
    False
    """
    import netrc
    from urllib.parse import urlparse

    env = os.environ if environ is None else environ
    if str(env.get("WANDB_MODE", "")).lower() in _QUIET_MODES or env.get("WANDB_API_KEY"):
        return False
    if str(env.get("WANDB_DISABLED", "")).lower() in ("1", "true", "yes"):
        return False
    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    home = Path(env.get("HOME", str(Path.home())))
    for path in filter(None, (env.get("NETRC"), home / ".netrc", home / "_netrc")):
        try:
            if netrc.netrc(str(path)).authenticators(host):
                return False
        except (OSError, netrc.NetrcParseError):
            continue
    env["WANDB_MODE"] = "offline"
    print(
        "hf-precision: W&B has no API key here (no WANDB_API_KEY, no `wandb login`), so this "
        "run logs offline; upload it afterwards with `wandb sync <run folder>`, or run "
        "`wandb login` (or set WANDB_MODE=offline to silence this line).",
        flush=True,
    )
    return True


#: the payload of one event, shared with the other trackers
WandbPayload = TrackerPayload


def wandb_disabled_reason() -> str | None:
    """Why W&B cannot log here, or ``None`` (imports wandb: call only when W&B is wanted)."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode == "disabled" or os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "W&B is disabled (WANDB_MODE=disabled or WANDB_DISABLED=true)"
    try:
        import wandb  # noqa: F401
    except ImportError:
        return "wandb is not installed (pip install 'hf-precision[wandb]')"
    return None


#: :meth:`WandbSink._reach_run`'s answer when asking for the run raised
_UNREACHABLE = object()


def _active_run() -> Any:
    import wandb

    return wandb.run


class WandbSink:
    """Logs :class:`WandbPayload` objects to the active W&B run, once it exists
    (a :class:`~hf_precision.report.trackers.Tracker`)."""

    label = "W&B"

    def __init__(self, run: Callable[[], Any] | None = None) -> None:
        #: where the run comes from (default ``wandb.run``; accelerate: its wandb tracker's run)
        self.find_run = run or _active_run
        self.enabled = True
        self.pending: list[WandbPayload] = []
        self.logged: list[tuple[str, int]] = []  # (event, step) for inspection
        self.dropped_pending = 0
        self._warned_no_run = False
        reason = wandb_disabled_reason()
        if reason is not None:
            self._disable(f"{reason}; dtype maps go to the files only.")

    # ------------------------------------------------------------------ helpers
    def _disable(self, message: str) -> None:
        """One warning, then W&B reporting stays off for this reporter."""
        if self.enabled:
            warnings.warn(f"hf-precision W&B report: {message}", PrecisionWarning, stacklevel=4)
        self.enabled = False
        self.pending.clear()

    def _reach_run(self) -> Any:
        """The run (``None``: none active yet), or :data:`_UNREACHABLE` once asking for it
        raised (said once; W&B reporting is then off)."""
        try:
            return self.find_run()
        except Exception as err:
            self._disable(f"could not reach wandb ({type(err).__name__}: {err}).")
            return _UNREACHABLE

    # ------------------------------------------------------------------ API
    def submit(self, payload: WandbPayload, *, may_warn_no_run: bool) -> None:
        """Log now when a run exists, otherwise keep the payload for later."""
        if not self.enabled:
            return
        run = self._reach_run()
        if run is _UNREACHABLE:
            return
        if run is None:
            self.pending.append(payload)
            if len(self.pending) > MAX_PENDING:
                self.pending.pop(0)
                self.dropped_pending += 1
            if may_warn_no_run and not self._warned_no_run:
                self._warned_no_run = True
                warnings.warn(
                    "hf-precision W&B report: 'wandb' was asked for but no W&B run is active, so "
                    f"{len(self.pending)} dtype map(s) wait to be logged (the files are written "
                    "meanwhile). Fix: add 'wandb' to TrainingArguments.report_to, or call "
                    "wandb.init() before training.",
                    PrecisionWarning,
                    stacklevel=4,
                )
            return
        self.pending.append(payload)
        self._log_pending(run)

    def flush(self) -> None:
        """Log the events that waited for a run, if one exists now (silent otherwise)."""
        if not self.enabled or not self.pending:
            return
        run = self._reach_run()
        if run is not None and run is not _UNREACHABLE:
            self._log_pending(run)

    def _log_pending(self, run: Any) -> None:
        payload = self.pending[-1]
        try:
            while self.pending:
                self._log(run, self.pending[0])
                self.pending.pop(0)
        except Exception as err:
            self._disable(
                f"logging to W&B failed at {payload.event} (step {payload.step}): "
                f"{type(err).__name__}: {err}. Training goes on; the dtype maps are "
                "in the files."
            )

    def _log(self, run: Any, p: WandbPayload) -> None:
        import wandb

        data: dict[str, Any] = {"train/global_step": p.step}
        if p.module_columns:
            data[f"precision/{p.event}/modules"] = wandb.Table(
                columns=p.module_columns, data=p.module_rows
            )
            data[f"precision/{p.event}/groups"] = wandb.Table(
                columns=p.group_columns, data=p.group_rows
            )
        for key, (columns, rows) in p.tables.items():
            data[key] = wandb.Table(columns=columns, data=rows)
        if p.drift_rows:
            data["precision/drift"] = wandb.Table(columns=p.drift_columns, data=p.drift_rows)
        if p.png_path is not None and p.png_path.exists():
            data[f"precision/{p.event}/picture"] = wandb.Image(
                str(p.png_path), caption=f"{p.event} step {p.step}"
            )
        elif p.png is not None:
            import io

            from PIL import Image

            data[f"precision/{p.event}/picture"] = wandb.Image(
                Image.open(io.BytesIO(p.png)), caption=f"{p.event} step {p.step}"
            )
        data.update(p.scalars)
        run.log(data)
        if p.policy is not None:
            run.summary["precision/policy"] = p.policy
        for key, value in p.summary.items():
            run.summary[key] = value
        self.logged.append((p.event, p.step))


#: the :class:`~hf_precision.report.trackers.Tracker` of this module (the table's entry point)
Sink = WandbSink


def in_all() -> bool:
    """``report_to="all"`` includes W&B (a missing wandb is then said once)."""
    return True


def trainer_source(args: Any, trainer: Any) -> Callable[[], Any] | None:
    """Under a Trainer the run is ``wandb.run``, made by ``WandbCallback``."""
    return None
