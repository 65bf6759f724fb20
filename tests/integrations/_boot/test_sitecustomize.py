"""The ``sitecustomize`` that ``hf-precision run`` puts first on ``PYTHONPATH``: it loads the
standard-library hook only when ``HF_PRECISION_GUARD`` is set, and always runs the
``sitecustomize`` it shadows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_precision.integrations.launch_cli import BOOT_DIR

ROOT = Path(__file__).resolve().parents[3]
PROBE = (
    "import sys; print(sys.modules['sitecustomize'].MARK, "
    "'_hf_precision_autostart' in sys.modules, "
    f"{str(BOOT_DIR)!r} in sys.path, 'torch' in sys.modules)"
)


@pytest.mark.parametrize("guard", [None, "auto"])
def test_the_shadowed_sitecustomize_still_runs(tmp_path, guard):
    (tmp_path / "sitecustomize.py").write_text("MARK = 'theirs'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_PRECISION_")}
    env["PYTHONPATH"] = os.pathsep.join([str(BOOT_DIR), str(tmp_path), str(ROOT)])
    if guard:
        env["HF_PRECISION_GUARD"] = guard
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    # theirs ran; the hook only with the variable; the boot folder left sys.path; no torch
    assert proc.stdout.split() == ["theirs", str(bool(guard)), "False", "False"]


def test_without_another_sitecustomize(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_PRECISION_")}
    env.update(PYTHONPATH=str(BOOT_DIR), HF_PRECISION_GUARD="auto")
    code = "import sys; print(sys.modules['sitecustomize'].__file__, [f for f in sys.meta_path])"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert str(BOOT_DIR / "sitecustomize.py") in proc.stdout or "sitecustomize" in proc.stdout
    assert "_TrainerFinder" in proc.stdout
