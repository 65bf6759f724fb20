"""``python -m benchmarks``: run the figure families, print a table, write a JSON of results.

python -m benchmarks                      # every CPU figure (~5 min on 2 cores)
python -m benchmarks --quick              # CI smoke: tiny inputs, a few seconds per family
python -m benchmarks --only audit,batch   # some families
python -m benchmarks --only cli           # hf-precision startup and audit, fresh processes
python -m benchmarks --gpu                # the GPU figures only (on a CUDA machine)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .common import Figure, machine

HERE = Path(__file__).resolve().parent
#: family -> module; ``reporting`` is optional (its module may not exist).
FAMILIES: dict[str, str] = {
    "step": "benchmarks.step_overhead",
    "audit": "benchmarks.audit",
    "enforce": "benchmarks.enforce_cost",
    "batch": "benchmarks.batch_cost",
    "reporting": "benchmarks.bench_reporting",
    "gpu": "benchmarks.gpu",
    "cli": "benchmarks.cli_startup",
    "silent": "benchmarks.silent_cost",
    "updates": "benchmarks.updates_cost",
    "rl": "benchmarks.rl_cost",
    "rl_watch": "benchmarks.rl_watch_cost",
    "launcher": "benchmarks.launcher_step",
    "fp16": "benchmarks.fp16_range",
    "fp8_gate": "benchmarks.fp8_gate",
}
CPU_FAMILIES = (
    "step",
    "audit",
    "enforce",
    "batch",
    "reporting",
    "cli",
    "silent",
    "updates",
    "rl",
    "rl_watch",
    "launcher",
    "fp16",
    "fp8_gate",
)


def _as_figure(item: Any) -> Figure:
    if isinstance(item, Figure):
        return item
    if isinstance(item, dict):  # a family that reports plain dicts
        known = {
            k: item[k]
            for k in ("id", "title", "value", "target", "unit", "detail", "seconds", "note")
            if k in item
        }
        known.setdefault("id", str(item.get("name", "?")))
        known.setdefault("title", known["id"])
        known.setdefault("value", None)
        extra = {k: v for k, v in item.items() if k not in known and k != "ok"}
        if extra:
            known["detail"] = {**known.get("detail", {}), **extra}
        return Figure(**known)
    raise TypeError(f"a benchmark family returned {type(item).__name__}, not a Figure")


def load_family(name: str) -> Callable[..., list[Any]] | None:
    """The ``run`` function of a family, or ``None`` when its module does not exist."""
    try:
        module = importlib.import_module(FAMILIES[name])
    except ModuleNotFoundError as err:
        if err.name == FAMILIES[name]:
            return None
        raise
    return getattr(module, "run", None) or getattr(module, "main", None)


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ratio":
        return f"{value:.3f}"
    return f"{value:g} {unit}"


def table(figures: list[Figure]) -> str:
    head = f"{'figure':<22} {'value':>14} {'target':>8} {'':<6} {'s':>6}  title"
    lines = [head, "-" * len(head)]
    for f in figures:
        status = {True: "ok", False: "MISSED", None: ""}[f.ok]
        target = f"≤ {f.target:g}" if f.target is not None else "-"
        lines.append(
            f"{f.id:<22} {fmt(f.value, f.unit):>14} {target:>8} {status:<6} "
            f"{f.seconds:>6.1f}  {f.title}"
        )
        if f.note:
            lines.append(f"{'':<22} {'':>14} {'':>8} {'':<6} {'':>6}  ({f.note})")
    return "\n".join(lines)


def markdown(payload: dict[str, Any]) -> str:
    """RESULTS.md tables from a results JSON: the figures, then the architecture scan."""
    lines = ["| figure | value | target | | what |", "|---|---:|---:|---|---|"]
    scan: list[dict[str, Any]] = []
    for f in payload["figures"]:
        target = f"≤ {f['target']:g}" if f.get("target") is not None else "—"
        status = {True: "ok", False: "**missed**", None: ""}[f.get("ok")]
        note = f" ({f['note']})" if f.get("note") else ""
        lines.append(
            f"| `{f['id']}` | {fmt(f['value'], f.get('unit', 'ratio'))} | {target} | "
            f"{status} | {f['title']}{note} |"
        )
        scan = f["detail"].get("rows", scan)
    if scan:
        lines += [
            "",
            "| model_type | params (B) | rule | groups | build s | audit ms |",
            "|---|---:|---|---|---:|---:|",
        ]
        for r in sorted(scan, key=lambda r: ("error" in r, -r.get("params_B", 0))):
            if "error" in r:
                lines.append(f"| {r['model_type']} | — | does not build: {r['error']} | | | |")
                continue
            lines.append(
                f"| {r['model_type']} | {r['params_B']:g} | {r['rule']} | "
                f"{r['groups']} | {r['build_s']:.2f} | {1000 * r['audit_s']:.1f} |"
            )
    return "\n".join(lines)


CHILD_MARK = "[benchmarks-json] "


def run_family(name: str, args: argparse.Namespace) -> list[Figure]:
    run = load_family(name)
    if run is None:
        return []
    kwargs: dict[str, Any] = {"quick": args.quick}
    if args.reps:
        kwargs["reps"] = args.reps
    return [_as_figure(x) for x in run(**kwargs)]


def run_child(name: str, argv: list[str] | None) -> list[Figure]:
    """One family in a fresh interpreter, so that it inherits no earlier family's heap (models,
    optimizer states, garbage)."""
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--strict"]
    keep, skip = [], False
    for a in passed:  # drop the options that only the parent acts on
        if skip:
            skip = False
            continue
        if a in ("--only", "--out"):
            skip = True
            continue
        if not a.startswith(("--only=", "--out=")):
            keep.append(a)
    cmd = [sys.executable, "-m", "benchmarks", *keep, "--child", name]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, cwd=HERE.parent)
    line = next(ln for ln in reversed(res.stdout.splitlines()) if ln.startswith(CHILD_MARK))
    return [_as_figure(d) for d in json.loads(line[len(CHILD_MARK) :])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny inputs: a smoke run for CI")
    parser.add_argument("--gpu", action="store_true", help="run the GPU family only")
    parser.add_argument("--only", default="", help=f"comma list of {', '.join(FAMILIES)}")
    parser.add_argument(
        "--out",
        default=None,
        help="JSON path (default benchmarks/results.json, results_gpu.json "
        "with --gpu, nothing with --quick)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for the CPU figures (default 1: steadier "
        "ratios on a shared machine)",
    )
    parser.add_argument("--reps", type=int, default=None, help="override repetitions")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--render",
        metavar="JSON",
        default=None,
        help="print the markdown tables of a results JSON and exit",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every family in this process (default: a fresh process per family, so no "
        "family inherits another's heap; --quick always runs in-process)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text())))
        return 0

    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in FAMILIES]
        if unknown:
            parser.error(f"--only: unknown famil(ies) {unknown}; allowed: {', '.join(FAMILIES)}")
    else:
        names = ["gpu"] if args.gpu else list(CPU_FAMILIES)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)

    if args.child:
        print(CHILD_MARK + json.dumps([f.to_dict() for f in run_family(args.child, args)]))
        return 0
    figures: list[Figure] = []
    start = time.perf_counter()
    for name in names:
        if load_family(name) is None:
            print(
                f"[benchmarks] {name}: module {FAMILIES[name]} not present, skipped",
                file=sys.stderr,
            )
            continue
        t0 = time.perf_counter()
        print(f"[benchmarks] {name} ...", file=sys.stderr, flush=True)
        in_process = args.quick or args.in_process
        got = run_family(name, args) if in_process else run_child(name, argv)
        for fig in got:
            fig.detail.setdefault("family", name)
        figures.extend(got)
        print(f"[benchmarks] {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    total = time.perf_counter() - start

    print(table(figures))
    print(f"total {total:.0f} s")
    out = args.out or (
        None if args.quick else str(HERE / ("results_gpu.json" if args.gpu else "results.json"))
    )
    if out:
        payload = {
            "command": "python -m benchmarks "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "quick": args.quick,
            "total_seconds": round(total, 1),
            "machine": machine(),
            "figures": [f.to_dict() for f in figures],
        }
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(payload, indent=1, default=str) + "\n")
        print(f"wrote {out}")
    missed = [f.id for f in figures if f.ok is False]
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
