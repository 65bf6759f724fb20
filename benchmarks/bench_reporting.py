"""Reporting cost on LLaVA-1.5-7B (meta device): one dtype-map event, and the audit it runs.

* ``report_event_s`` — seconds for one :meth:`PrecisionReporter.log_event` with a fresh picture
  (dtype map + module/group tables + text table + PNG + JSON file), target ≤ 0.5 s;
* ``report_event_cached_s`` — the same when the picture would not change (same event, step and
  rows: it is reused);
* ``report_wandb_s`` — building the ``wandb.Table``/``wandb.Image`` payload and logging it to an
  offline run (only with ``--wandb`` when run as a script: a W&B run costs seconds to start);
* ``report_audit_ratio`` — ``dtype_map(model, groups, policy=...)`` (what an event computes) ÷
  one bare pass over ``named_parameters()``, target ≤ 3.

Run it alone (prints both times and their ratio)::

    python -m benchmarks.bench_reporting            # or: python benchmarks/bench_reporting.py
    python -m benchmarks.bench_reporting --wandb    # also time logging to an offline W&B run
    python -m benchmarks --only reporting           # inside the benchmark table
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Figure, interleave, ratio_figure, smoke
from benchmarks.models import build_meta, llava15_7b_config
from hf_precision import PrecisionPolicy, dtype_map, find_module_groups
from hf_precision.report.reporter import PrecisionReporter
from hf_precision.report.rows import module_table_rows

FAMILY = "reporting"
TARGET_EVENT_S = 0.5
TARGET_AUDIT_RATIO = 3.0


def bare_pass(model: Any) -> None:
    for _ in model.named_parameters():
        pass


def llava_7b(quick: bool = False) -> Any:
    """LLaVA-1.5-7B on meta, loaded as people do: bf16 language model, fp32 vision tower."""
    import torch

    model = build_meta(llava15_7b_config(0.25 if quick else 1.0))
    model.model.language_model.to(torch.bfloat16)
    model.lm_head.to(torch.bfloat16)
    return model


def _time(fn: Any, reps: int) -> tuple[float, float]:
    """Median CPU and wall seconds of ``fn`` (CPU time: a shared machine's waits don't count)."""
    cpu, wall = [], []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def event_figures(model: Any, reps: int, out_dir: Path) -> list[Figure]:
    policy = PrecisionPolicy.from_preset("bf16")
    groups = find_module_groups(model)
    reporter = PrecisionReporter(out_dir, console=False)
    reporter.log_event("warmup", model, step=0, policy=policy, groups=groups)  # imports, fonts

    def fresh() -> None:
        reporter._png_cache = None  # force a new picture: the worst case of an event
        reporter.log_event("on_evaluate", model, step=1, policy=policy, groups=groups)

    def cached() -> None:
        reporter.log_event("on_evaluate", model, step=1, policy=policy, groups=groups)

    from hf_precision.report.plot import picture_rows, plot_precision

    dmap = dtype_map(model, groups, policy=policy)
    rows, folded = module_table_rows(dmap)
    parts = {
        "dtype_map_s": _time(lambda: dtype_map(model, groups, policy=policy), reps)[0],
        "table_rows_s": _time(lambda: module_table_rows(dmap), reps)[0],
        "text_table_s": _time(lambda: dmap.table(use_rich=None), reps)[0],
        "picture_s": _time(
            lambda: plot_precision(picture_rows(dmap, policy=policy), title="bench"), reps
        )[0],
    }
    fresh_cpu, fresh_wall = _time(fresh, reps)
    cached_cpu, cached_wall = _time(cached, reps)
    detail: dict[str, Any] = {k: round(v, 4) for k, v in parts.items()}
    detail.update(
        clock="cpu",
        wall_s=round(fresh_wall, 4),
        modules=len(dmap),
        table_rows=len(rows),
        aggregated=folded,
        reps=reps,
    )
    return [
        Figure(
            "report_event_s",
            "one dtype-map event (tables + picture + JSON), LLaVA-1.5-7B",
            round(fresh_cpu, 4),
            TARGET_EVENT_S,
            unit="s",
            detail=detail,
        ),
        Figure(
            "report_event_cached_s",
            "one event, picture unchanged since the last one",
            round(cached_cpu, 4),
            TARGET_EVENT_S,
            unit="s",
            detail={"clock": "cpu", "wall_s": round(cached_wall, 4), "reps": reps},
        ),
    ]


def wandb_figure(model: Any, reps: int, out_dir: Path) -> Figure:
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    policy = PrecisionPolicy.from_preset("bf16")
    run = wandb.init(project="hf-precision-bench", dir=str(out_dir), mode="offline")
    try:
        reporter = PrecisionReporter(out_dir, console=False, wandb=True)
        reporter.log_event("warmup", model, step=0, policy=policy)
        cpu, wall = _time(
            lambda: reporter.log_event("on_evaluate", model, step=1, policy=policy), reps
        )
    finally:
        run.finish()
    return Figure(
        "report_wandb_s",
        "one event logged to an offline W&B run (files + W&B)",
        round(cpu, 4),
        TARGET_EVENT_S,
        unit="s",
        detail={"clock": "cpu", "wall_s": round(wall, 4), "reps": reps},
    )


def audit_figure(model: Any, reps: int) -> Figure:
    policy = PrecisionPolicy.from_preset("bf16")
    groups = find_module_groups(model)
    t0 = time.process_time()
    bare_pass(model)
    inner = max(1, int(0.02 / max(time.process_time() - t0, 1e-5)))
    runs = interleave(
        {
            "audit": lambda: dtype_map(model, groups, policy=policy),
            "map_only": lambda: dtype_map(model, groups),
            "bare": lambda: bare_pass(model),
        },
        reps=reps,
        inner=inner,
    )
    # The event's map carries each module's keep-fp32 reason (a policy lookup per tensor);
    # the plain map is what the guard's audit computes without a policy.
    return ratio_figure(
        "report_audit_ratio",
        "dtype map of an event ÷ bare named_parameters() pass, LLaVA-1.5-7B",
        runs,
        "audit",
        "bare",
        TARGET_AUDIT_RATIO,
        inner=inner,
        map_only_ratio=round(runs.ratio("map_only", "bare"), 4),
    )


def run(quick: bool = False, reps: int | None = None, *, wandb: bool = False) -> list[Figure]:
    """The figures of this family (``python -m benchmarks --only reporting``)."""
    reps = reps or (2 if quick else 7)
    model = llava_7b(quick)
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        for fig in event_figures(model, reps, Path(tmp) / "precision"):
            fig.seconds = round(time.perf_counter() - t0, 1)
            figures.append(fig)
        if wandb:
            t0 = time.perf_counter()
            fig = wandb_figure(model, reps, Path(tmp))
            fig.seconds = round(time.perf_counter() - t0, 1)
            figures.append(fig)
    t0 = time.perf_counter()
    fig = audit_figure(model, reps * 2)
    fig.seconds = round(time.perf_counter() - t0, 1)
    figures.append(fig)
    if quick:
        for fig in figures:
            if fig.unit == "ratio":
                smoke(fig)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_reporting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a quarter of the layers")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--wandb", action="store_true", help="also log to an offline W&B run")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    figures = run(args.quick, args.reps, wandb=args.wandb)
    for fig in figures:
        status = {True: "ok", False: "MISSED", None: ""}[fig.ok]
        target = f"(target ≤ {fig.target:g})" if fig.target is not None else ""
        print(f"{fig.id:<24} {fig.value:>10.4f} {fig.unit:<6} {target} {status}  {fig.title}")
    audit = next(f for f in figures if f.id == "report_audit_ratio")
    d = audit.detail
    print(
        f"audit (dtype map with policy) {d['audit_s'] * 1e3:.2f} ms, bare named_parameters() "
        f"pass {d['bare_s'] * 1e3:.2f} ms, ratio {audit.value:.2f} (CPU time; wall ratio "
        f"{d['wall_ratio']:.2f}; without the policy's keep-fp32 reasons "
        f"{d['map_only_ratio']:.2f})"
    )
    event = next(f for f in figures if f.id == "report_event_s")
    print("event breakdown: " + ", ".join(f"{k} {v}" for k, v in event.detail.items()))
    return 0 if all(f.ok is not False for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
