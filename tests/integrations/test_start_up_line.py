"""#34: both installs carry the start-up line (``hf_precision_guard.pth``, setup.py): the wheel
and the editable install ``pip install -e .`` (what ``make setup`` runs). Each is made here in a
fresh venv from a copy of this checkout (no network: ``--no-deps --no-build-isolation``, the
build tools and torch/transformers borrowed from this Python's site-packages by a path line),
and in each ``HF_PRECISION_GUARD=auto`` puts the guard on a Trainer that a script builds without
importing hf_precision; without the variable the line imports nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURELIB = Path(sysconfig.get_paths()["purelib"])
#: what a build of the package reads from the checkout
SOURCES = ("pyproject.toml", "setup.py", "README.md", "hf_precision")
#: the build backend, its helpers and their metadata (setuptools' commands are entry points)
BUILD_TOOLS = ("setuptools*", "pkg_resources", "_distutils_hack", "wheel*")

SCRIPT = """
import sys
from transformers import Trainer, TrainingArguments
from transformers import LlamaConfig, LlamaForCausalLM

# the script never imports hf_precision: the start-up line's hook does, with transformers.trainer
cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
args = TrainingArguments(output_dir="out", use_cpu=True, report_to=[], max_steps=1,
                         save_strategy="no", disable_tqdm=True)
trainer = Trainer(model=LlamaForCausalLM(cfg), args=args)
names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
print("@", names.count("PrecisionGuardCallback"), sys.modules["hf_precision"].__file__)
"""
PROBE = (
    "import sys; print('@', sorted(m for m in sys.modules if m.split('.')[0] in "
    "('hf_precision', '_hf_precision_autostart', 'torch', 'transformers')))"
)


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HF_PRECISION_") and k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")
    }
    done = subprocess.run(
        cmd, env={**clean, **env}, capture_output=True, text=True, timeout=300, cwd=env.get("CWD")
    )
    assert done.returncode == 0, (cmd, done.stdout[-2000:], done.stderr[-3000:])
    return done


def _said(done: subprocess.CompletedProcess[str]) -> str:
    return next(x[1:].strip() for x in done.stdout.splitlines() if x.startswith("@"))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A copy of the checkout (what a build reads), and a folder holding only the build tools
    (so pip, run for the new venv, sees no other installed distribution)."""
    work = tmp_path_factory.mktemp("start-up-line")
    copy = work / "src"
    copy.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, copy / name)
    tools = work / "build-tools"
    tools.mkdir()
    for pattern in BUILD_TOOLS:
        for found in PURELIB.glob(pattern):
            (tools / found.name).symlink_to(found)
    return {"copy": copy, "tools": tools, "work": work}


def _venv(folder: Path) -> tuple[Path, Path]:
    """A fresh venv (no pip of its own: this Python's pip installs into it)."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(folder)])
    python = folder / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
        ).stdout.strip()
    )
    return python, site


def _install(python: Path, tools: Path, *what: str) -> None:
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    _run([*pip, "--no-deps", "--no-build-isolation", "--no-index", *what], PYTHONPATH=str(tools))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["editable", "wheel"])
def test_both_installs_carry_the_start_up_line(source: dict[str, Path], kind: str) -> None:
    work = source["work"] / kind
    python, site = _venv(work / "venv")
    if kind == "editable":
        _install(python, source["tools"], "-e", str(source["copy"]))
    else:
        wheels = work / "dist"
        pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        _run([*pip, "-w", str(wheels), str(source["copy"])], PYTHONPATH=str(source["tools"]))
        [wheel] = wheels.glob("hf_precision-*.whl")
        _install(python, source["tools"], str(wheel))
    assert (site / "hf_precision_guard.pth").read_text() == (
        ROOT / "hf_precision" / "integrations" / "hf_precision_guard.pth"
    ).read_text()
    # torch, transformers: this Python's, by a path line (its own .pth files are not run)
    (site / "zz_borrowed.pth").write_text(f"{PURELIB}\n")
    assert _said(_run([str(python), "-c", PROBE])) == "[]"  # no variable: nothing at start
    said = _said(_run([str(python), "-c", PROBE], HF_PRECISION_GUARD="auto"))
    assert said == "['_hf_precision_autostart']"  # the variable: the hook only, no torch
    (work / "run").mkdir()
    done = _run([str(python), "-c", SCRIPT], HF_PRECISION_GUARD="auto", CWD=str(work / "run"))
    count, path = _said(done).split(" ", 1)
    assert count == "1", done.stderr[-2000:]
    where = source["copy"] if kind == "editable" else site  # this install's package
    assert Path(path).is_relative_to(where), path
    assert "precision guard on for Trainer" in done.stderr
    assert "start-up hook is not installed" not in done.stderr
