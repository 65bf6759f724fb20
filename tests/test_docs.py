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


#: the pages whose Python blocks run: the README and every page of docs/
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
#: blocks that need what only the user has (their model, args and data; a framework and its
#: YAML), each run for real by the test named
NEEDS_THE_USERS_OWN = {
    "from llamafactory": "LLaMA-Factory and a cfg.yaml: tests/integrations/test_llamafactory.py",
    "callbacks=[PrecisionGuardCallback()])": (
        "the one-line snippet: tests/frontends/test_callback.py"
    ),
}


def _blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


BLOCKS = [(page, i) for page in PAGES for i in range(len(_blocks(page)))]


def test_every_page_is_reached_from_the_readme() -> None:
    """The README is a front page: every docs/ page is one link away."""
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"]({page})" in readme, f"README.md does not link {page}"


@pytest.mark.parametrize(("page", "index"), BLOCKS, ids=[f"{p}-{i}" for p, i in BLOCKS])
def test_python_blocks_of_the_readme_and_docs_run(page, index, tmp_path, monkeypatch):
    block = _blocks(page)[index]
    for marker, reason in NEEDS_THE_USERS_OWN.items():
        if marker in block:
            pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    if "Accelerator(" in block:  # each block runs as in a fresh process: no accelerate state
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    if "register_group_rule" in block:
        from hf_precision.rules.groups.registry import unregister_group_rule

        unregister_group_rule("my_vlm")
    exec(compile(block, f"{page} block {index}", "exec"), {})
    if "register_group_rule" in block:
        unregister_group_rule("my_vlm")


_DISTRIBUTIONS = {"TRL": "trl", "DeepSpeed": "deepspeed"}


COMPATIBILITY = ROOT / "docs" / "compatibility.md"


def _compat_rows() -> list[list[str]]:
    text = COMPATIBILITY.read_text()
    section = text.split("## Compatibility", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row] for row in rows[1:]]  # the header row dropped


def test_compatibility_table_matches_what_runs() -> None:
    """docs/compatibility.md's table: the versions of this leg are the installed ones, the 4.x
    column is what ``make test-tf4`` pins, and every test it names exists."""
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


def test_the_architecture_table_is_generated_from_the_rules(capsys):
    from hf_precision.rules.groups.registry import architecture_table, group_rules
    from hf_precision.tools.cli import main

    text = (ROOT / "docs" / "api.md").read_text()
    block = re.search(r"<!-- architectures:[^\n]*-->\n(.*?)<!-- /architectures -->", text, re.S)
    assert block is not None, "docs/api.md lost its generated architecture table markers"
    assert block.group(1) == architecture_table(), (
        "docs/api.md's architecture table is stale: regenerate it with `hf-precision architectures`"
    )
    # every model-layout rule has its row, and the CLI prints the same table
    for rule in group_rules():
        if not rule.name.startswith("diffusion_"):
            assert f"| {rule.name} | " in block.group(1)
    assert main(["architectures"]) == 0
    assert capsys.readouterr().out == architecture_table()


# ---------------------------------------------------------------- the README's own claims


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _table(section: str) -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip().strip("`") for c in row] for row in rows]


def test_the_install_lines_name_extras_and_a_wheel_that_exist() -> None:
    """Every extra the README's install section names is one pyproject declares, and the
    wheel file it installs is the one ``python -m build`` makes of this version."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    section = _readme_section("Install")
    assert "not on the package index yet" in section
    named = set()
    for spec in re.findall(r'pip install (?:-e )?"([^"]+)"', section):
        named |= set(re.search(r"\[([^\]]+)\]", spec).group(1).split(","))
    named |= set(re.findall(r"`(\w+)` \(", section.split("Extras:", 1)[1]))
    assert named and named <= extras, sorted(named - extras)
    assert set(section.split("Extras:", 1)[1].replace("`", " ").split()) >= extras
    wheel = f"{project['name'].replace('-', '_')}-{project['version']}-py3-none-any.whl"
    assert f"dist/{wheel}[wandb]" in section
    # make demo installs what the README says: the wandb and recipes extras, no others
    makefile = (ROOT / "Makefile").read_text()
    assert '-e ".[wandb,recipes]"' in makefile.split("$(DEMO_VENV)/.installed:", 1)[1]


def test_the_presets_table_is_the_policy() -> None:
    from hf_precision import PrecisionPolicy
    from hf_precision.rules.dtypes import parse_dtype

    rows = _table(_readme_section("The rules"))
    presets = {r[0]: r[1:4] for r in rows if r[0] in ("bf16", "bf16-true", "fp16", "fp16-true")}
    presets["fp32"] = next(r[1:4] for r in rows if r[0] == "fp32")
    assert len(presets) == 5
    for name, (frozen, trainable, compute) in presets.items():
        policy = PrecisionPolicy.from_preset(name)
        assert (policy.frozen_dtype, policy.trainable_dtype, policy.compute_dtype) == tuple(
            parse_dtype(d, call="README") for d in (frozen, trainable, compute)
        ), name


def test_the_inference_table_is_from_training_args() -> None:
    from types import SimpleNamespace

    import torch

    from hf_precision import PrecisionPolicy
    from hf_precision.tiny import tiny_llava

    section = _readme_section("The rules")
    assert "| `bf16=True` | `bf16` |" in section and "| `fp16=True` | `fp16` |" in section
    assert PrecisionPolicy.from_training_args(SimpleNamespace(bf16=True)).name == "bf16"
    assert PrecisionPolicy.from_training_args(SimpleNamespace(fp16=True)).name == "fp16"
    # no flag: frozen weights follow the language model, trainable ones keep their dtype
    model = tiny_llava().to(torch.bfloat16)
    model.model.vision_tower.float()
    model.requires_grad_(False)
    model.model.multi_modal_projector.float().requires_grad_(True)
    policy = PrecisionPolicy.from_training_args(SimpleNamespace(), model)
    assert policy.frozen_dtype == torch.bfloat16 and policy.keep_trainable_fp32


def test_the_rules_table_is_the_precedence() -> None:
    from typing import get_args

    from hf_precision.rules.policy.precedence import Rule

    rows = _table(_readme_section("The rules"))
    order = [r[1] for r in rows if r[0].isdigit()]
    names = [n.strip(" `") for cell in order for n in cell.split(",")]
    assert names == [r for r in get_args(Rule) if r != "keep_trainable_fp32"]
