"""Examples that stay true: module doctests and the README's Python blocks run."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import hf_precision

ROOT = Path(__file__).resolve().parents[1]
# Every module's docstring examples (the modules are found, not listed, so none is missed).
MODULES = sorted(
    m.name.removeprefix("hf_precision.")
    for m in pkgutil.walk_packages(hf_precision.__path__, "hf_precision.")
)


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


_DISTRIBUTIONS = {"TRL": "trl", "DeepSpeed": "deepspeed"}


def _compat_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Compatibility", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row] for row in rows[1:]]  # the header row dropped


def test_compatibility_table_matches_what_runs() -> None:
    """The README's table: the versions of this leg are the installed ones, the 4.x column
    is what ``make test-tf4`` pins, and every test it names exists."""
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    makefile = (ROOT / "Makefile").read_text()
    pins = dict(
        line.split("==")
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    rows = _compat_rows()
    assert {r[0] for r in rows} >= {"transformers", "peft", "TRL", "bitsandbytes", "torchao"}
    tf4 = transformers.__version__.startswith("4.")
    for library, leg5, leg4, _, tests in rows:
        for path in re.findall(r"`(tests/[^`]+)`", tests):
            assert (ROOT / path).exists(), (library, path)
        pinned = pins.get(_DISTRIBUTIONS.get(library, library))
        assert pinned is None or pinned.startswith(leg5), (library, pinned, leg5)
        if leg4 != "–" and library in ("transformers", "peft"):
            assert f'"{library}=={leg4}"' in makefile, (library, leg4)
        if library == "transformers":  # the floor users get is the line the 4.x leg runs
            floor = ".".join(leg4.split(".")[:2])
            assert f'"transformers>={floor},' in (ROOT / "pyproject.toml").read_text()
        try:
            installed = version(_DISTRIBUTIONS.get(library, library))
        except PackageNotFoundError:
            continue  # an integration this leg does not install
        want = leg4 if tf4 else leg5
        if want != "–":
            assert installed.startswith(want), (library, installed, want)


def test_readme_architecture_table_is_generated_from_the_rules(capsys):
    from hf_precision.cli import main
    from hf_precision.groups import architecture_table, group_rules

    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- architectures:[^\n]*-->\n(.*?)<!-- /architectures -->", text, re.S)
    assert block is not None, "README lost its generated architecture table markers"
    assert block.group(1) == architecture_table(), (
        "README's architecture table is stale: regenerate it with `hf-precision architectures`"
    )
    # every model-layout rule has its row, and the CLI prints the same table
    for rule in group_rules():
        if not rule.name.startswith("diffusion_"):
            assert f"| {rule.name} | " in block.group(1)
    assert main(["architectures"]) == 0
    assert capsys.readouterr().out == architecture_table()
