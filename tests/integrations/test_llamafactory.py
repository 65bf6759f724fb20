"""LLaMA-Factory 0.9.5 in its own venv (``make test-frameworks``): its real command line on a tiny
LLaVA LoRA job (a bf16 checkpoint, ``upcast_layernorm: true``, no bf16 flag, 3 steps, CPU).

Without the guard the job stops at the first forward: LLaMA-Factory casts the norms to fp32,
their fp32 output meets the bf16 ``q_proj`` (``expected m1 and m2 to have the same dtype``).
With the guard, through ``run_exp(callbacks=...)``, ``hf-precision run`` or
``HF_PRECISION_GUARD=auto``, it trains and reports under ``<output_dir>/precision/``.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

CRASH = "expected m1 and m2 to have the same dtype"
RUN_EXP = """
import sys, yaml
from llamafactory.train.tuner import run_exp
from hf_precision import PrecisionGuardCallback
run_exp(args=yaml.safe_load(open(sys.argv[1])), callbacks=[PrecisionGuardCallback()])
"""
needs_launcher = pytest.mark.skipif(
    importlib.util.find_spec("hf_precision.integrations.launcher") is None,
    reason="hf_precision.integrations.launcher (the `hf-precision run` launcher) is not here yet",
)


@pytest.fixture
def job(llamafactory_venv: Any, tmp_path: Path) -> Path:
    """The issue's failing YAML and what it reads (model, processor, images, dataset)."""
    return llamafactory_venv.fixtures("llamafactory", tmp_path)


def _trained(proc: Any, job: Path, reports: Any) -> dict[str, Any]:
    """The job trained 3 steps with a finite loss and the guard reported; the last report."""
    assert proc.returncode == 0, reports.tail(proc)
    assert CRASH not in proc.stdout
    out = job.parent / "out"
    assert (out / "adapter_model.safetensors").is_file()
    losses = [
        float(line.split("'loss': '")[1].split("'")[0])
        for line in proc.stdout.splitlines()
        if "'loss': '" in line
    ]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    report = reports.last(out / "precision")
    assert report["event"] == "on_train_end" and report["step"] == 3
    return report


def _norms_kept_fp32(report: dict[str, Any], reports: Any) -> None:
    """``upcast_layernorm`` is a deliberate cast: every norm is still fp32 after training."""
    norms = reports.norm_dtypes(report)
    assert norms, "no norm in the report"
    lowered = {path: dtypes for path, dtypes in norms.items() if dtypes != {"float32"}}
    assert not lowered, f"{len(lowered)} norms lowered from fp32, e.g. {next(iter(lowered))}"


def test_cli_crashes_without_the_guard(llamafactory_venv: Any, job: Path, reports: Any) -> None:
    proc = llamafactory_venv.run(["llamafactory-cli", "train", str(job)], cwd=job.parent)
    assert proc.returncode != 0
    assert CRASH in proc.stdout, reports.tail(proc)
    assert not (job.parent / "out" / "precision").exists()


def test_run_exp_with_the_callback(llamafactory_venv: Any, job: Path, reports: Any) -> None:
    proc = llamafactory_venv.run(
        [llamafactory_venv.python, "-c", RUN_EXP, str(job)], cwd=job.parent
    )
    report = _trained(proc, job, reports)
    # no precision flag: the policy keeps what was loaded (bf16 weights, fp32 LoRA adapters)
    assert report["policy"]["frozen_dtype"] == "bfloat16"
    assert report["dtype_map"]["groups"]["language_model"]["trainable"] > 0
    _norms_kept_fp32(report, reports)


@needs_launcher
def test_cli_under_hf_precision_run(llamafactory_venv: Any, job: Path, reports: Any) -> None:
    proc = llamafactory_venv.run(
        ["hf-precision", "run", "--", "llamafactory-cli", "train", str(job)], cwd=job.parent
    )
    _norms_kept_fp32(_trained(proc, job, reports), reports)


@needs_launcher
def test_cli_under_the_environment_variable(
    llamafactory_venv: Any, job: Path, reports: Any
) -> None:
    proc = llamafactory_venv.run(
        ["llamafactory-cli", "train", str(job)], cwd=job.parent, HF_PRECISION_GUARD="auto"
    )
    _norms_kept_fp32(_trained(proc, job, reports), reports)
