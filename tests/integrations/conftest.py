"""Framework venvs for the tests in this folder: each framework pins its own transformers, peft
and trl, so its command line runs in its own venv (``make test-frameworks`` creates them) as a
subprocess, with this checkout first on ``PYTHONPATH`` so the code under test is imported.

A venv is found at ``$HF_PRECISION_<NAME>_VENV`` or ``<repo>/.venv-<name>``; a test that needs
a missing one skips and names the command that creates it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hf_precision.integrations.launch_config import ENV_VARS

REPO = Path(__file__).resolve().parents[2]
#: what `hf-precision run` sets: a test sets its own, none leaks in from the caller
LAUNCH_VARS = ENV_VARS
FIXTURES = Path(__file__).resolve().parent / "make_fixtures.py"


@dataclass(frozen=True)
class Venv:
    """A framework's venv: ``run`` runs a command there (its ``bin`` first on ``PATH``)."""

    name: str
    path: Path

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    @property
    def python(self) -> str:
        return str(self.bin / "python")

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in LAUNCH_VARS and not k.startswith(("PYTEST_", "COV_"))
        }
        env.update(
            PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}",
            PYTHONPATH=str(REPO),
            VIRTUAL_ENV=str(self.path),
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            WANDB_MODE="offline",
            TOKENIZERS_PARALLELISM="false",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            # LLaMA-Factory/ms-swift check the hub for newer files unless told not to
            USE_MODELSCOPE_HUB="0",
            DISABLE_VERSION_CHECK="1",
        )
        env.update(extra)
        return env

    def run(
        self, argv: Sequence[str], cwd: Path, timeout: int = 600, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in this venv; stdout and stderr together in ``.stdout`` (also saved to
        ``cwd/run.log`` for a failing test's reader)."""
        proc = subprocess.run(
            list(argv),
            cwd=cwd,
            env=self.env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
        (cwd / "run.log").write_text(proc.stdout)
        return proc

    def fixtures(self, kind: str, root: Path, **overrides: Any) -> Path:
        """``make_fixtures.py kind root k=v...`` with this venv's interpreter (its transformers
        writes the checkpoint it will read); the path it prints."""
        args = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
        root.mkdir(parents=True, exist_ok=True)
        proc = self.run([self.python, str(FIXTURES), kind, str(root), *args], cwd=root)
        assert proc.returncode == 0, proc.stdout[-3000:]
        return Path(proc.stdout.strip().splitlines()[-1])


def find_venv(name: str) -> Venv | None:
    env_key = f"HF_PRECISION_{name.upper()}_VENV"
    path = Path(os.environ.get(env_key) or REPO / f".venv-{name}")
    return Venv(name, path) if (path / "bin" / "python").is_file() else None


def venv_fixture(name: str, target: str) -> Callable[[], Venv]:
    def fixture() -> Venv:
        venv = find_venv(name)
        if venv is None:
            pytest.skip(
                f"no {name} venv (.venv-{name} or $HF_PRECISION_{name.upper()}_VENV): "
                f"`make {target}` creates it and runs these tests"
            )
        return venv

    return fixture


def tail(proc: subprocess.CompletedProcess[str], n: int = 4000) -> str:
    return proc.stdout[-n:]


def last_report(report_dir: Path) -> dict[str, Any]:
    """The last JSON report the guard wrote in ``report_dir`` (``<output_dir>/precision``)."""
    reports = sorted(report_dir.glob("*.json"))
    assert reports, f"no report in {report_dir}"
    return json.loads(reports[-1].read_text())


def norm_dtypes(report: dict[str, Any]) -> dict[str, set[str]]:
    """{module path: dtypes of its parameters} for every LayerNorm/RMSNorm in a report."""
    records = report["dtype_map"]["records"]
    return {
        path: set(rec["params"])
        for path, rec in records.items()
        if rec["type"].endswith(("LayerNorm", "RMSNorm")) and rec["params"]
    }


llamafactory_venv = pytest.fixture(venv_fixture("llamafactory", "test-frameworks"))
swift_venv = pytest.fixture(venv_fixture("swift", "test-frameworks"))


@pytest.fixture
def reports() -> SimpleNamespace:
    """The helpers above for the test files (``--import-mode=importlib``: no conftest import)."""
    return SimpleNamespace(last=last_report, norm_dtypes=norm_dtypes, tail=tail)


axolotl_venv = pytest.fixture(venv_fixture("axolotl", "test-frameworks"))
# sd-scripts runs on a tiny SD 1.5: its venv, and the snapshot of its source (test_kohya.py)
kohya_venv = pytest.fixture(scope="module")(venv_fixture("kohya", "test-kohya"))
