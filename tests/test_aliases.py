"""Every old module path (before the folders) imports the moved module itself: the same object,
its own name and spec, under both names in sys.modules and on the package."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

import hf_precision
from hf_precision._aliases import ALIASES

PKG = Path(hf_precision.__file__).parent


def test_the_table_names_the_tree() -> None:
    """Each new path is a file of the package; no old path is one any more."""
    for old, new in ALIASES.items():
        assert (PKG.parent / (new.replace(".", "/") + ".py")).is_file(), new
        assert not (PKG.parent / (old.replace(".", "/") + ".py")).exists(), old
        assert old.count(".") == 1 and new.rsplit(".", 1)[1] == old.rsplit(".", 1)[1]


@pytest.mark.parametrize(("old", "new"), sorted(ALIASES.items()))
def test_old_path_is_the_new_module(old: str, new: str) -> None:
    moved = importlib.import_module(new)
    assert importlib.import_module(old) is moved
    assert sys.modules[old] is moved is sys.modules[new]
    assert getattr(hf_precision, old.rsplit(".", 1)[1]) is moved
    assert moved.__name__ == new and moved.__spec__ is not None and moved.__spec__.name == new


def test_old_paths_first_in_a_fresh_interpreter() -> None:
    """Nothing imported before: ``from hf_precision.<old> import X`` and ``import a.b as c``."""
    if not ALIASES:
        pytest.skip("no module moved yet")
    lines = ["import importlib, sys"]
    for i, (old, new) in enumerate(sorted(ALIASES.items())):
        lines.append(f"import {old} as m{i}")
        lines.append(f"assert m{i} is importlib.import_module({new!r}), {old!r}")
    lines.append("from hf_precision.policy import PrecisionPolicy")
    lines.append("from hf_precision.rules.policy import PrecisionPolicy as P")
    lines.append("assert PrecisionPolicy is P")
    run = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_patching_an_old_path_patches_the_module() -> None:
    """``mock.patch("hf_precision.<old>.name")`` (users' tests) reaches the code that runs."""
    if "hf_precision.policy" not in ALIASES:
        pytest.skip("hf_precision.policy not moved")
    new = importlib.import_module(ALIASES["hf_precision.policy"])
    with mock.patch("hf_precision.policy.PrecisionPolicy", "patched"):
        assert new.PrecisionPolicy == "patched"
    assert new.PrecisionPolicy != "patched"


def test_public_paths_do_not_move() -> None:
    """Top-level names, integrations.*, tiny.*, the axolotl plugin and the entry point."""
    from hf_precision.integrations import axolotl

    assert axolotl.PLUGIN == "hf_precision.integrations.axolotl.PrecisionGuardPlugin"
    assert axolotl.__name__ == "hf_precision.integrations.axolotl"
    assert not any(
        k.startswith(("hf_precision.integrations", "hf_precision.tiny")) for k in ALIASES
    )
    for name in hf_precision.__all__:
        assert getattr(hf_precision, name) is not None
    assert (PKG / "integrations" / "ms_swift.py").is_file()
    assert importlib.import_module("hf_precision.integrations.autostart").__name__.endswith(
        "autostart"
    )


def test_python_dash_m_on_an_old_path_runs_the_moved_module() -> None:
    """``python -m hf_precision.cli --help`` (the CLI's old path) runs the CLI, as
    ``python -m hf_precision`` does; an old path without a ``__main__`` block runs and ends
    quietly. Neither ends in a traceback."""
    env = {**__import__("os").environ, "PYTHONPATH": str(PKG.parent)}
    old = subprocess.run(
        [sys.executable, "-m", "hf_precision.cli", "--help"],
        capture_output=True,
        text=True,
        env=env,
    )
    new = subprocess.run(
        [sys.executable, "-m", "hf_precision", "--help"], capture_output=True, text=True, env=env
    )
    assert old.returncode == 0, old.stderr
    assert "Traceback" not in old.stderr and old.stdout == new.stdout
    assert "usage: hf-precision" in old.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "hf_precision.cli", "audit", "--policy"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr  # argparse's own exit
    plain = subprocess.run(
        [sys.executable, "-m", "hf_precision.doctor", "--help"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert plain.returncode == 0 and "Traceback" not in plain.stderr, plain.stderr
