"""Shared measurement helpers: interleaved repetitions, median ratios, machine facts.

Every figure is a ratio of two (or more) *arms* measured side by side in one process: each
repetition runs every arm once, in a rotated order (so drift and warm-up cancel), and the figure
is the median over repetitions of the per-repetition ratio. Times are CPU time of this process
(``time.process_time``) by default: on a shared machine, waiting for another process's core is
not counted, while everything this process computes is; wall-clock ratios are recorded too.

>>> from benchmarks.common import Runs, interleave
>>> runs = interleave({"a": lambda: sum(range(1000)), "b": lambda: sum(range(2000))}, reps=3)
>>> [len(runs.cpu[arm]) for arm in ("a", "b")]
[3, 3]
>>> Runs(cpu={"guard": [1.1, 2.2, 3.0], "none": [1.0, 2.0, 3.0]}).ratio("guard", "none")
1.1

(The example asserts no timing: a doctest that compares two timings fails on a busy machine.)
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class Runs:
    """Per-arm samples (seconds) of one interleaved measurement, CPU and wall clock."""

    cpu: dict[str, list[float]] = field(default_factory=dict)
    wall: dict[str, list[float]] = field(default_factory=dict)

    def per_rep(self, num: str, den: str, *, clock: str = "cpu") -> list[float]:
        samples = self.cpu if clock == "cpu" else self.wall
        return [a / b for a, b in zip(samples[num], samples[den], strict=True) if b > 0]

    def ratio(self, num: str, den: str, *, clock: str = "cpu") -> float:
        """Median over repetitions of ``num / den`` (both measured in the same repetition)."""
        return statistics.median(self.per_rep(num, den, clock=clock))

    def spread(self, num: str, den: str, *, clock: str = "cpu") -> tuple[float, float]:
        """(min, max) of the per-repetition ratios: how noisy the machine was."""
        values = self.per_rep(num, den, clock=clock)
        return min(values), max(values)

    def median(self, arm: str, *, clock: str = "cpu") -> float:
        return statistics.median((self.cpu if clock == "cpu" else self.wall)[arm])


def interleave(
    arms: Mapping[str, Callable[[], Any]],
    *,
    reps: int,
    warmup: int = 1,
    setup: Mapping[str, Callable[[], Any]] | None = None,
    inner: int | Mapping[str, int] = 1,
) -> Runs:
    """Time every arm ``reps`` times, rotating the order each repetition.

    ``setup[arm]`` runs untimed before each timed call of ``arm`` (install/remove guards, restore
    weights). ``inner`` repeats the call inside one sample, for arms shorter than a few ms;
    per arm (a mapping, see :func:`calibrate`) it keeps every arm's samples equally long, so
    that bursts of noise on a shared machine do not land more often in the longer arm.
    A garbage collection runs (untimed) before each sample, so that a collection made due by
    one arm's garbage is not billed to the next arm; collections during a sample count.
    """
    names = list(arms)
    setup = setup or {}
    runs = Runs({n: [] for n in names}, {n: [] for n in names})
    counts = dict(inner) if isinstance(inner, Mapping) else dict.fromkeys(names, inner)
    _loop(arms, names, setup, runs, reps=reps, warmup=warmup, inner=counts)
    return runs


def calibrate(arms: Mapping[str, Callable[[], Any]], seconds: float = 0.02) -> dict[str, int]:
    """Calls per sample for each arm so that every sample lasts about ``seconds``."""
    out = {}
    for name, fn in arms.items():
        fn()  # warm
        t0 = time.process_time()
        fn()
        once = max(time.process_time() - t0, 1e-5)
        out[name] = max(1, math.ceil(seconds / once))
    return out


def _loop(
    arms: Mapping[str, Callable[[], Any]],
    names: list[str],
    setup: Mapping[str, Callable[[], Any]],
    runs: Runs,
    *,
    reps: int,
    warmup: int,
    inner: Mapping[str, int],
) -> None:
    for rep in range(warmup + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            if name in setup:
                setup[name]()
            n = inner[name]
            gc.collect()
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(n):
                arms[name]()
            c1, w1 = time.process_time(), time.perf_counter()
            if rep >= warmup:
                runs.cpu[name].append((c1 - c0) / n)
                runs.wall[name].append((w1 - w0) / n)


@dataclass
class Figure:
    """One row of the benchmark table."""

    id: str
    title: str
    value: float | None
    target: float | None = None  # the value must stay at or below it
    unit: str = "ratio"
    detail: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    note: str = ""

    @property
    def ok(self) -> bool | None:
        if self.target is None or self.value is None:
            return None
        return self.value <= self.target

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def runs_of(runs: Runs, arm: str, clock: str) -> list[float]:
    return (runs.cpu if clock == "cpu" else runs.wall)[arm]


def ratio_figure(
    fid: str,
    title: str,
    runs: Runs,
    num: str,
    den: str,
    target: float | None,
    *,
    clock: str = "cpu",
    **detail: Any,
) -> Figure:
    """A figure whose value is the median ``num / den`` ratio of ``runs`` (CPU time by default;
    the other clock's ratio is kept in the details)."""
    other = "wall" if clock == "cpu" else "cpu"
    lo, hi = runs.spread(num, den, clock=clock)
    return Figure(
        fid,
        title,
        round(runs.ratio(num, den, clock=clock), 4),
        target,
        detail={
            "clock": clock,
            f"{num}_s": round(runs.median(num, clock=clock), 6),
            f"{den}_s": round(runs.median(den, clock=clock), 6),
            "reps": len(runs.cpu[num]),
            "min_ratio": round(min(runs_of(runs, num, clock)) / min(runs_of(runs, den, clock)), 4),
            "per_rep_min": round(lo, 4),
            "per_rep_max": round(hi, 4),
            f"{other}_ratio": round(runs.ratio(num, den, clock=other), 4),
            **detail,
        },
    )


def smoke(fig: Figure) -> Figure:
    """Quick runs exercise the code on tiny inputs: their ratios are not measurements."""
    fig.note = "quick smoke run (tiny inputs, few repetitions): not a measurement"
    fig.target = None
    return fig


def finished(figures: list[Figure], start: float, quick: bool) -> list[Figure]:
    """A family's figures as it returns them: each with the family's seconds so far (since
    ``start``, a ``time.perf_counter()``), marked as smoke runs when ``quick``."""
    for fig in figures:
        fig.seconds = round(time.perf_counter() - start, 1)
    return [smoke(f) for f in figures] if quick else figures


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    import transformers

    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "load_avg_1min": round(load, 2),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def rss_bytes() -> int:
    """Resident memory of this process (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
