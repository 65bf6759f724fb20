"""The package's shape: no import cycles (module-level or inside functions), one folder per layer
and a folder imports only the folders below it, every module imports alone in a fresh
interpreter, and every module has its test file."""

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


def _string_import(node: ast.AST, package: str) -> str | None:
    """The module a call ``importlib.import_module("hf_precision.x")`` (or ``import_module(".x",
    __package__)``) names with a literal string: a lazy import the ``import`` statements hide."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0]
    if name != "import_module" or not isinstance(first, ast.Constant):
        return None
    target = str(first.value)
    if target.startswith("."):
        level = len(target) - len(target.lstrip("."))
        base = package.split(".")
        return ".".join([*base[: len(base) - level + 1], target.lstrip(".")])
    return target if target.startswith("hf_precision") else None


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
        elif (target := _string_import(node, package)) is not None:
            out.add(target)
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


#: The folders of docs/architecture.md ("Layout"), bottom first: a module imports only modules of
#: its own folder or of the folders below it. "" is the package's top level, which holds only
#: the foundation (errors) and ``python -m hf_precision`` (above everything).
FOLDERS: tuple[str, ...] = (
    "",
    "base",
    "rules",
    "model",
    # what observes a run and changes nothing (imports no engine module)
    "watch",
    "engine",
    "report",
    "frontends",
    # one adapter module per third-party tool; adding one touches nothing else
    "integrations",
    "tools",
)
TOP_LEVEL = ("errors",)


def _folder(module: str) -> str:
    parts = module.split(".")  # hf_precision.rules (its __init__) is in rules/ too
    return parts[1] if len(parts) > 2 or parts[-1] in FOLDERS else ""


def _rank(module: str) -> int:
    if module == "hf_precision.__main__":
        return len(FOLDERS)
    return FOLDERS.index(_folder(module))


def _ours(m: str) -> bool:
    return m != "hf_precision" and not m.startswith("hf_precision.tiny")


OURS = sorted(m for m in GRAPH if _ours(m))


def test_the_documented_layout_is_the_checked_one() -> None:
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    documented = re.findall(r"^\| `(\w+)/` \|", text.split("## Layout", 1)[1], flags=re.M)
    assert tuple(documented) == FOLDERS[1:]


def test_every_module_is_in_a_folder() -> None:
    """The top level holds the foundation only: a new module goes into its layer's folder."""
    loose = sorted(
        m for m in OURS if _folder(m) == "" and m.rsplit(".", 1)[-1] not in (*TOP_LEVEL, "__main__")
    )
    unknown = sorted({_folder(m) for m in OURS} - set(FOLDERS))
    assert not loose, f"move these into their layer's folder (docs/architecture.md): {loose}"
    assert not unknown, f"add these folders to FOLDERS and docs/architecture.md: {unknown}"


@pytest.mark.parametrize("module", OURS)
def test_imports_point_down(module: str) -> None:
    above = sorted(d for d in CODE.get(module, ()) if _ours(d) and _rank(d) > _rank(module))
    where = _folder(module) or "the top level"
    assert not above, f"{module} ({where}/) imports a folder above its own: {above}"


def _reach(module: str) -> set[str]:
    out, todo = set(), [module]
    while todo:
        for dep in CODE.get(todo.pop(), ()):
            if dep not in out:
                out.add(dep)
                todo.append(dep)
    return out


INTEGRATIONS = {m for m in OURS if _rank(m) >= FOLDERS.index("frontends")}


@pytest.mark.parametrize("module", sorted(m for m in OURS if m not in INTEGRATIONS))
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
    """``hf_precision/a/b.py`` is tested in ``tests/a/test_b.py`` (other files may test it too;
    ``_b.py`` in ``test_b.py``)."""
    tests = Path(__file__).resolve().parent
    missing = [
        str(p.relative_to(PKG.parent))
        for p in sorted(PKG.rglob("*.py"))
        if p.stem not in ("__init__", "__main__")
        and not (tests / p.parent.relative_to(PKG) / f"test_{p.stem.lstrip('_')}.py").is_file()
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


def test_the_layout_table_names_every_module_of_its_folder() -> None:
    """docs/architecture.md's layout table cannot drift from the tree: each folder's row names
    every module of that folder (``module`` or ``sub/module``), and nothing it names as a
    module is missing from the tree."""
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    table = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)/` \|(.*)$", table, flags=re.M)}
    problems = []
    for folder, row in rows.items():
        named = set(re.findall(r"`([\w/]+)`", row))
        root = PKG / folder
        modules = {
            p.relative_to(root).with_suffix("").as_posix()
            for p in root.rglob("*.py")
            if p.name != "__init__.py"
        }
        missing = sorted(modules - named)
        if missing:
            problems.append(f"{folder}/: the row does not name {missing}")
        ghosts = sorted(
            n for n in named if "/" in n and n not in modules and not (root / n).is_dir()
        )
        if ghosts:
            problems.append(f"{folder}/: the row names modules that do not exist: {ghosts}")
    assert set(rows) == set(FOLDERS[1:])
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ one home per name


def _defined(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (``if``/``try`` blocks included)."""
    out: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If):
            body.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            body.extend(node.body + node.orelse + [s for h in node.handlers for s in h.body])
    return out


_FILES = {_module_name(p): p for p in PKG.rglob("*.py")}
_DEFINED = {m: _defined(ast.parse(p.read_text())) for m, p in _FILES.items()}


def _facade(module: str) -> bool:
    """A package's ``__init__``: its façade may re-export (the top level's public names)."""
    return _FILES[module].name == "__init__.py"


def _imported_names(path: Path, module: str | None) -> list[tuple[int, str, str, str | None]]:
    """``(line, source module, name, alias)`` for every ``from hf_precision... import name`` in
    ``path`` (relative ones resolved for a package module), lazy imports included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level and module is not None:
            package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        elif (node.module or "").startswith("hf_precision"):
            source = node.module or ""
        else:
            continue
        out.extend((node.lineno, source, a.name, a.asname) for a in node.names)
    return out


def _python_files() -> list[tuple[Path, str | None]]:
    root = PKG.parent
    files: list[tuple[Path, str | None]] = [(p, _module_name(p)) for p in sorted(PKG.rglob("*.py"))]
    for folder in ("tests", "benchmarks", "recipes", "notebooks"):
        files += [(p, None) for p in sorted((root / folder).rglob("*.py"))]
    return files


def test_every_name_is_imported_from_its_home() -> None:
    """A name has one home: the module that defines it. Only a package's ``__init__`` (the top
    level's public names, a package's façade) re-exports; ``from hf_precision.engine.hooks import
    Notice`` (a name ``hooks`` only imported) is refused, and so is the explicit re-export form
    ``from .a import b as b`` outside an ``__init__``."""
    wrong = []
    for path, module in _python_files():
        for line, source, name, alias in _imported_names(path, module):
            where = f"{path.relative_to(PKG.parent)}:{line}"
            if source not in _FILES or _facade(source) or f"{source}.{name}" in _FILES:
                continue
            if name not in _DEFINED[source]:
                wrong.append(f"{where}: {name} is not defined in {source}")
            if alias == name and module is not None and path.name != "__init__.py":
                wrong.append(f"{where}: 'import {name} as {name}' re-exports it from {module}")
    assert not wrong, "\n".join(wrong)


_TEXT_IMPORT = re.compile(
    r"from (hf_precision[\w.]*) import \(?([\w, \n]+?)\)?(?:$|#|\\n|;|\"|')", re.M
)


def test_examples_import_each_name_from_its_home() -> None:
    """The same rule for the examples a reader copies and the code written as text: README,
    docs, notebooks, recipes' READMEs, the doctests in docstrings, the code strings tests and
    benchmarks run in other processes, the Makefile and CI."""
    root = PKG.parent
    texts = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    texts += sorted((root / "notebooks").glob("*.ipynb")) + sorted((root / "recipes").rglob("*.md"))
    texts += [*sorted(PKG.rglob("*.py")), root / "Makefile", *sorted((root / ".ci").iterdir())]
    texts += [
        p for d in ("tests", "benchmarks", "recipes") for p in sorted((root / d).rglob("*.py"))
    ]
    wrong = []
    for path in texts:
        for m in _TEXT_IMPORT.finditer(path.read_text()):
            source = m.group(1)
            if source not in _FILES or _facade(source):
                continue
            for item in m.group(2).replace("\n", " ").split(","):
                name = item.split(" as ")[0].strip()
                if name and name not in _DEFINED[source] and f"{source}.{name}" not in _FILES:
                    wrong.append(f"{path.relative_to(root)}: {name} is not defined in {source}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_no_module_reads_a_name_through_a_sibling() -> None:
    """``checkpoint.torch_dtypes`` where ``checkpoint`` only imported it: the package's code
    reads a name from its home module (tests may patch a name where it is used)."""
    wrong = []
    for path, module in _python_files():
        if module is None:
            continue
        tree = ast.parse(path.read_text())
        modules = {
            a.asname or a.name: source
            for line, src, name, alias in _imported_names(path, module)
            for a in [ast.alias(name=name, asname=alias)]
            if (source := f"{src}.{name}") in _FILES
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                source = modules.get(node.value.id)
                if source is None or _facade(source) or node.attr.startswith("__"):
                    continue
                if node.attr not in _DEFINED[source] and f"{source}.{node.attr}" not in _FILES:
                    wrong.append(
                        f"{path.relative_to(PKG.parent)}:{node.lineno}: {source}.{node.attr}"
                    )
    assert not wrong, "\n".join(wrong)
