"""Examples that stay true: module doctests and the README's Python blocks run."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = [
    "errors",
    "dtypes",
    "policy",
    "groups",
    "dtype_map",
    "enforce",
    "batch",
    "hooks",
    "callback",
    "reporting",
    "plot",
    "diagnostics",
    "diagnosis",
    "diffusion",
    "accelerate_plugin",
    "distributed",
    "deepspeed_config",
]


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name):
    module = importlib.import_module(f"hf_precision.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def _readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("index", range(len(_readme_blocks())))
def test_readme_python_blocks_run(index, tmp_path, monkeypatch):
    block = _readme_blocks()[index]
    if "Trainer(" in block and "PrecisionGuardCallback()" in block and "args=" in block:
        pytest.skip(
            "the one-line snippet needs the user's model/args/dataset; covered by "
            "tests/test_callback.py"
        )
    monkeypatch.chdir(tmp_path)
    if "register_group_rule" in block:
        from hf_precision.groups import unregister_group_rule

        unregister_group_rule("my_vlm")
    exec(compile(block, f"README block {index}", "exec"), {})
    if "register_group_rule" in block:
        unregister_group_rule("my_vlm")
