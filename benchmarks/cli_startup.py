"""How long the ``hf-precision`` command takes, as ratios against two floors, each arm a fresh
interpreter (``python -m hf_precision ...``, as a user runs it):

* ``cli_help``, ``cli_version``, ``cli_arg_error`` — ``--help``, ``--version`` and a missing
  argument ÷ ``python -c "import transformers"`` (what any transformers tool pays first);
  below 1 means the command answers before transformers would have imported;
* ``cli_help_vs_header`` — ``--help`` ÷ a bare safetensors header read in a fresh interpreter
  (``struct`` + ``json``: the least a checkpoint tool can do);
* ``cli_audit_vs_import`` — ``audit`` of a tiny saved checkpoint (config + headers, a meta build)
  ÷ ``import transformers``; ``cli_audit_vs_header`` the same ÷ the bare header read.

Times are the CPU time of the child processes (``os.times().children_*``: on a shared machine
the waiting is not billed), wall clock in the details; arms interleaved, rotated each
repetition, the median per-repetition ratio reported (:mod:`benchmarks.common`).

>>> arms = _arms(Path("ckpt"))
>>> sorted(arms)[:3]
['arg_error', 'audit', 'header']
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import Figure, smoke

FAMILY = "cli"

_HEADER = (
    "import json, struct, sys\n"
    "with open(sys.argv[1], 'rb') as fh:\n"
    "    (n,) = struct.unpack('<Q', fh.read(8)); json.loads(fh.read(n))\n"
)


def _arms(folder: Path) -> dict[str, list[str]]:
    """arm -> the command line it runs."""
    py, cli = sys.executable, [sys.executable, "-m", "hf_precision"]
    return {
        "import_transformers": [py, "-c", "import transformers"],
        "header": [py, "-c", _HEADER, str(folder / "model.safetensors")],
        "help": [*cli, "--help"],
        "version": [*cli, "--version"],
        "arg_error": [*cli, "audit"],
        "audit": [*cli, "audit", str(folder), "--trainable", "none", "--json"],
    }


def _child_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def _measure(arms: dict[str, list[str]], reps: int) -> tuple[dict[str, list[float]], ...]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    names = list(arms)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps + 1):  # the first repetition warms the file cache, untimed
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            c0, w0 = _child_cpu(), time.perf_counter()
            subprocess.run(arms[name], env=env, capture_output=True, check=False)
            c1, w1 = _child_cpu(), time.perf_counter()
            if rep:
                cpu[name].append(c1 - c0)
                wall[name].append(w1 - w0)
    return cpu, wall


def _ratio(samples: dict[str, list[float]], num: str, den: str) -> float:
    return statistics.median(a / b for a, b in zip(samples[num], samples[den], strict=True))


def run(quick: bool = False, reps: int | None = None) -> list[Figure]:
    import torch

    from hf_precision.tiny import tiny_llava

    reps = reps or (1 if quick else 7)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = tiny_llava(torch.bfloat16)
        model.model.vision_tower.float()  # stored split
        model.save_pretrained(folder)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        t0 = time.perf_counter()
        cpu, wall = _measure(_arms(folder), reps)
        seconds = time.perf_counter() - t0
    figures = []
    for fid, title, num, den, target in (
        (
            "cli_help",
            "`--help` ÷ `import transformers` (fresh processes)",
            "help",
            "import_transformers",
            0.5,
        ),
        (
            "cli_version",
            "`--version` ÷ `import transformers`",
            "version",
            "import_transformers",
            0.5,
        ),
        (
            "cli_arg_error",
            "argument error ÷ `import transformers`",
            "arg_error",
            "import_transformers",
            0.5,
        ),
        ("cli_help_vs_header", "`--help` ÷ a bare safetensors header read", "help", "header", 3.0),
        (
            "cli_audit_vs_import",
            "`audit` of a tiny checkpoint ÷ `import transformers`",
            "audit",
            "import_transformers",
            None,
        ),
        (
            "cli_audit_vs_header",
            "`audit` of a tiny checkpoint ÷ a bare header read",
            "audit",
            "header",
            None,
        ),
    ):
        fig = Figure(
            fid,
            title,
            round(_ratio(cpu, num, den), 3),
            target,
            seconds=seconds / 6,
            detail={
                "clock": "children cpu",
                f"{num}_s": round(statistics.median(cpu[num]), 3),
                f"{den}_s": round(statistics.median(cpu[den]), 3),
                f"{num}_wall_s": round(statistics.median(wall[num]), 3),
                f"{den}_wall_s": round(statistics.median(wall[den]), 3),
                "wall_ratio": round(_ratio(wall, num, den), 3),
                "reps": reps,
                "checkpoint_bytes": size,
            },
        )
        figures.append(smoke(fig) if quick else fig)
    return figures
