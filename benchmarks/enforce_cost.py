"""Cost of ``enforce_policy`` against the cast it performs, in time and in memory.

* ``enforce_bf16`` — ``enforce_policy(model, "bf16-true")`` ÷ ``for p in params:
  p.data = p.data.to(torch.bfloat16)`` over the same tensors, on a ~127M-parameter (~510 MB fp32)
  LLaVA-shaped model; both arms start from the same fp32 tensors every repetition;
* ``enforce_fp16`` — the same with ``fp16-true``, where ``enforce_policy`` also checks every
  tensor's range before the downcast (the raw loop silently makes ``inf``);
* ``enforce_memory_*`` — peak resident memory above the starting point while ``enforce_policy``
  runs ÷ the largest single tensor, measured in a fresh subprocess through the kernel's peak-RSS
  counter (``/proc/self/clear_refs`` + ``VmHWM``), with a 1 ms sampling thread as fallback.

Run one memory measurement by hand::

    python -m benchmarks.enforce_cost --memory bf16-true
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from hf_precision import enforce_policy

from .common import Figure, interleave, param_count, ratio_figure, rss_bytes, smoke
from .models import build, llava_500mb_config, llava_config

FAMILY = "enforce"


def _quick_config() -> Any:
    return llava_config(
        vision=dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        ),
        text=dict(
            vocab_size=4000,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        ),
        image_token_index=3999,
    )


def _model(quick: bool) -> Any:
    return build(_quick_config() if quick else llava_500mb_config())


def time_figures(quick: bool = False, reps: int | None = None) -> list[Figure]:
    model = _model(quick)
    params = [p for p in model.parameters() if p.is_floating_point()]
    fp32 = [p.data for p in params]

    def restore() -> None:
        for p, data in zip(params, fp32, strict=True):
            p.data = data

    figures = []
    for preset, dtype in (("bf16-true", torch.bfloat16), ("fp16-true", torch.float16)):
        changed: list[int] = []

        def raw(dtype: torch.dtype = dtype) -> None:
            with torch.no_grad():
                for p in params:
                    p.data = p.data.to(dtype)

        def enforce(preset: str = preset, changed: list[int] = changed) -> None:
            changed.append(len(enforce_policy(model, preset).changes))

        t0 = time.perf_counter()
        runs = interleave(
            {"enforce": enforce, "raw": raw},
            setup={"enforce": restore, "raw": restore},
            # ~80 ms a call: many repetitions are cheap, and the first ones touch fresh pages
            reps=reps or (2 if quick else 25),
            warmup=1 if quick else 3,
        )
        short = preset.split("-")[0]
        fig = ratio_figure(
            f"enforce_{short}",
            f"enforce_policy({preset!r}) ÷ raw tensor.to({short}) loop",
            runs,
            "enforce",
            "raw",
            1.1 if short == "bf16" else None,
            params_M=round(param_count(model) / 1e6, 1),
            fp32_MB=round(sum(d.numel() * d.element_size() for d in fp32) / 2**20),
            tensors=len(params),
            cast_by_enforce=changed[-1],
        )
        if short == "fp16":
            fig.note = (
                "includes the range check before every fp16 downcast (one read pass); "
                "the raw loop turns values beyond ±65504 into inf"
            )
        fig.seconds = round(time.perf_counter() - t0, 1)
        figures.append(fig)
        restore()
    return figures


class PeakRSS:
    """Peak resident memory of this process inside a ``with`` block (bytes above the start)."""

    def __init__(self) -> None:
        self.start = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise OSError("no VmHWM")

    def __enter__(self) -> PeakRSS:
        gc.collect()
        self.start = rss_bytes()
        try:  # "5" resets the kernel's peak-RSS counter to the current RSS
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self._hwm()
            self.method = "VmHWM"
        except OSError:
            self.method = "sampling"
            self.peak = self.start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss_bytes())
        else:
            self.peak = self._hwm()

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.start)


def measure_memory(preset: str, quick: bool = False, arm: str = "enforce") -> dict[str, Any]:
    """In this process: build the model, then peak extra RSS of one ``enforce_policy`` call."""
    torch.set_num_threads(1)
    model = _model(quick)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    dtype = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}[preset]
    with PeakRSS() as peak:
        if arm == "enforce":
            enforce_policy(model, preset)
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.data = p.data.to(dtype)
    wrong = [n for n, p in model.named_parameters() if p.dtype != dtype]
    return {
        "preset": preset,
        "arm": arm,
        "extra_bytes": peak.extra,
        "largest_bytes": largest,
        "ratio": round(peak.extra / largest, 4),
        "method": peak.method,
        "start_rss": peak.start,
        "not_cast": len(wrong),
    }


def memory_figures(quick: bool = False) -> list[Figure]:
    """One fresh subprocess per (preset, arm), so that no earlier allocation hides the peak.
    ``quick`` measures bf16 only, in this process (a smoke test of the measurement itself)."""
    figures = []
    for preset in ("bf16-true",) if quick else ("bf16-true", "fp16-true"):
        t0 = time.perf_counter()
        out: dict[str, dict[str, Any]] = {}
        for arm in ("enforce", "raw"):
            if quick:
                out[arm] = measure_memory(preset, quick=True, arm=arm)
                continue
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.enforce_cost",
                "--memory",
                preset,
                "--arm",
                arm,
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            res = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                check=True,
                env=env,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            )
            out[arm] = json.loads(res.stdout.strip().splitlines()[-1])
        short = preset.split("-")[0]
        e, r = out["enforce"], out["raw"]
        figures.append(
            Figure(
                f"enforce_memory_{short}",
                f"peak extra RSS in enforce_policy({preset!r}) ÷ largest tensor",
                e["ratio"],
                1.05,
                seconds=round(time.perf_counter() - t0, 1),
                detail={
                    "extra_MB": round(e["extra_bytes"] / 2**20, 1),
                    "largest_MB": round(e["largest_bytes"] / 2**20, 1),
                    "raw_loop_ratio": r["ratio"],
                    "method": e["method"],
                    "start_rss_MB": round(e["start_rss"] / 2**20),
                },
            )
        )
    return figures


def run(quick: bool = False, reps: int | None = None) -> list[Figure]:
    figures = time_figures(quick, reps) + memory_figures(quick)
    return [smoke(f) for f in figures] if quick else figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="peak extra RSS of one enforce_policy call")
    parser.add_argument("--memory", choices=("bf16-true", "fp16-true"), required=True)
    parser.add_argument("--arm", choices=("enforce", "raw"), default="enforce")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(json.dumps(measure_memory(args.memory, args.quick, args.arm)))


if __name__ == "__main__":
    main()
