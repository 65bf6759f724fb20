"""The package's shape: no import cycles (module-level or inside functions), lower layers know
nothing of the layers above them, and every module imports alone in a fresh interpreter."""

from __future__ import annotations

import ast
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


def test_no_import_cycles() -> None:
    cycles = {m: c for m in CODE if (c := _cycle_from(m)) is not None}
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles.values())


#: Lower layers (what a model and a policy are) never import the layers that use them.
LOWER = [
    "hf_precision.errors",
    "hf_precision.dtypes",
    "hf_precision.policy",
    "hf_precision.groups",
    "hf_precision.group_rules",
    "hf_precision.wrappers",
    "hf_precision.dtype_maps",
    "hf_precision.enforce",
    "hf_precision.batch",
    "hf_precision.hooks",
    "hf_precision.tables",
]
UPPER = {
    "hf_precision.guard",
    "hf_precision.callback",
    "hf_precision.accelerate_plugin",
    "hf_precision.diffusion",
    "hf_precision.distributed",
    "hf_precision.deepspeed_config",
    "hf_precision.reporting",
    "hf_precision.report_wandb",
    "hf_precision.plot",
    "hf_precision.diagnostics",
    "hf_precision.findings",
    "hf_precision.doctor",
    "hf_precision.cli",
    "hf_precision.checkpoint",
}


def test_every_module_has_a_layer() -> None:
    placed = {*LOWER, *UPPER, "hf_precision"}
    unplaced = sorted(m for m in GRAPH if m not in placed and not m.startswith("hf_precision.tiny"))
    assert not unplaced, f"add these to LOWER or UPPER (and docs/architecture.md): {unplaced}"


def _reach(module: str) -> set[str]:
    out, todo = set(), [module]
    while todo:
        for dep in CODE.get(todo.pop(), ()):
            if dep not in out:
                out.add(dep)
                todo.append(dep)
    return out


@pytest.mark.parametrize("module", LOWER)
def test_lower_layers_know_nothing_of_the_integrations(module: str) -> None:
    assert not (_reach(module) & UPPER), sorted(_reach(module) & UPPER)


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
