"""The package's shape: no import cycles (module-level or inside functions), lower layers know
nothing of the layers above them, every module imports alone in a fresh interpreter, and every
module has its test file."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "hf_precision"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """hf_precision modules ``path`` imports, anywhere in the file (lazy imports count)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module is None:  # from . import x
                out.update(f"{target}.{a.name}" for a in node.names)
            else:
                out.add(target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("hf_precision"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_precision"):
            out.add(node.module or "")
    modules = {_module_name(p) for p in PKG.rglob("*.py")}
    return {m for m in out if m in modules and m != name}


GRAPH = {_module_name(p): _imports(p) for p in sorted(PKG.rglob("*.py"))}
# the package __init__ re-exports everything; cycles through it are not cycles of the code
CODE = {m: {d for d in deps if d != "hf_precision"} for m, deps in GRAPH.items()}


def _cycle_from(start: str) -> list[str] | None:
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    seen: set[str] = set()
    while stack:
        node, path = stack.pop()
        for dep in CODE.get(node, ()):
            if dep == start:
                return [*path, start]
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, [*path, dep]))
    return None


def test_no_module_imports_another_modules_private_names() -> None:
    private = [
        f"{_module_name(path)}: from {node.module} import {a.name}"
        for path in sorted(PKG.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module != "__future__"
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]
    assert not private, private


def test_no_import_cycles() -> None:
    cycles = {m: c for m in CODE if (c := _cycle_from(m)) is not None}
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles.values())


#: The layers of docs/architecture.md ("Layout"), top first: a module imports only modules of
#: its own layer or of the layers above it.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("errors", "names", "tables", "wrappers"),
    "values": (
        "dtypes",
        "flags",
        "batch_keys",
        "groups",
        "group_rules",
        "diffusion_rules",
        "keep_rules",
        "roles",
        "presets",
        "policy_json",
        "inference",
        "policy",
        "policy_spec",
    ),
    "model": ("view", "dtype_maps", "reporter"),
    "core": (
        "records",
        "plan",
        "enforce",
        "batch",
        "claims",
        "hooks",
        "outside_reads",
        "deepspeed_config",
        "distributed",
        "fsdp2",
        "blame",
        "trace",
        "lost_updates",
        "memory_account",
        "provenance",
        "console",
        "stash",
    ),
    "engine": ("guard", "frontend"),
    "frontends": (
        "callback",
        "accelerate_plugin",
        "diffusion",
        "reporting",
        "report_wandb",
        "plot",
    ),
    # the folder hf_precision/integrations/: one adapter module per third-party tool; every module
    # in it belongs to this layer without being listed (adding one touches nothing else)
    "frameworks": ("integrations",),
    "tools": (
        "findings",
        "diagnostics",
        "checkpoint",
        "audit_files",
        "audit",
        "doctor",
        "cli",
        "__main__",
    ),
}
RANK = {f"hf_precision.{m}": i for i, mods in enumerate(LAYERS.values()) for m in mods}
RANK.update(
    {
        m: RANK["hf_precision.integrations"]
        for m in (_module_name(p) for p in sorted((PKG / "integrations").rglob("*.py")))
    }
)
INTEGRATIONS = {m for m, r in RANK.items() if r >= list(LAYERS).index("engine")}


def _ours(m: str) -> bool:
    return m != "hf_precision" and not m.startswith("hf_precision.tiny")


def test_the_documented_layout_is_the_checked_one() -> None:
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\w+) \| (`[^|]*`) \|", text.split("## Layout", 1)[1], flags=re.M)
    documented = {layer: tuple(re.findall(r"`(\w+)`", mods)) for layer, mods in rows}
    assert documented == LAYERS


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in GRAPH if _ours(m) and m not in RANK)
    assert not unplaced, f"add these to LAYERS (and docs/architecture.md's Layout): {unplaced}"


@pytest.mark.parametrize("module", sorted(RANK))
def test_imports_point_up(module: str) -> None:
    below = sorted(d for d in CODE.get(module, ()) if _ours(d) and RANK[d] > RANK[module])
    assert not below, f"{module} ({list(LAYERS)[RANK[module]]}) imports a lower layer: {below}"


def _reach(module: str) -> set[str]:
    out, todo = set(), [module]
    while todo:
        for dep in CODE.get(todo.pop(), ()):
            if dep not in out:
                out.add(dep)
                todo.append(dep)
    return out


@pytest.mark.parametrize("module", sorted(m for m in RANK if m not in INTEGRATIONS))
def test_lower_layers_know_nothing_of_the_integrations(module: str) -> None:
    assert not (_reach(module) & INTEGRATIONS), sorted(_reach(module) & INTEGRATIONS)


def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    modules = [m for m in GRAPH if not m.startswith("hf_precision.tiny.")] + ["hf_precision.tiny"]
    # one interpreter each (an import that only works after another would fail), four at once
    for i in range(0, len(modules), 4):
        runs = {
            m: subprocess.Popen(
                [sys.executable, "-c", code, m], stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for m in modules[i : i + 4]
        }
        for m, run in runs.items():
            _, err = run.communicate(timeout=120)
            assert run.returncode == 0, (m, err.decode()[-2000:])


def test_tests_mirror_the_package() -> None:
    """``hf_precision/a/b.py`` is tested in ``tests/a/test_b.py`` (other files may test it too)."""
    tests = Path(__file__).resolve().parent
    missing = [
        str(p.relative_to(PKG.parent))
        for p in sorted(PKG.rglob("*.py"))
        if p.stem not in ("__init__", "__main__")
        and not (tests / p.parent.relative_to(PKG) / f"test_{p.stem}.py").is_file()
    ]
    assert missing == [], f"modules without their test file: {missing}"


def test_no_integration_module_shadows_a_package() -> None:
    """ms-swift's ``--external_plugins`` puts hf_precision/integrations/ first on ``sys.path``:
    a module there named like an installed package (``trl``, ``swift``) would replace it."""
    import importlib.util

    shadows = [
        p.stem
        for p in sorted((PKG / "integrations").glob("*.py"))
        if p.stem != "__init__" and importlib.util.find_spec(p.stem) is not None
    ]
    assert shadows == [], f"rename these (e.g. <tool>_models.py): {shadows}"


def test_trainer_adapters_are_integrations_that_exist() -> None:
    """``callback.TRAINER_ADAPTERS`` loads its modules by name: each one must be a module of
    ``hf_precision/integrations/`` (the ``frameworks`` layer) with a ``trainer_models``."""
    from hf_precision.callback import TRAINER_ADAPTERS

    assert TRAINER_ADAPTERS, "the table is empty"
    for package, module in TRAINER_ADAPTERS.items():
        assert module in RANK and module.startswith("hf_precision.integrations."), (package, module)
        assert RANK[module] == RANK["hf_precision.integrations"], module
        assert "def trainer_models(" in (PKG.parent / f"{module.replace('.', '/')}.py").read_text()
