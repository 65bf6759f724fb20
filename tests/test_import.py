import subprocess
import sys

import pytest


def test_import_is_lean():
    """`import hf_precision` imports no tracker and touches no GPU."""
    code = (
        "import sys, hf_precision\n"
        "bad = [m for m in ('wandb', 'matplotlib', 'peft', 'datasets', 'diffusers') "
        "if m in sys.modules]\n"
        "import torch\n"
        "print(bad, torch.cuda.is_initialized())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.stdout.strip() == "[] False", out.stdout + out.stderr


def test_public_names():
    import hf_precision

    for name in (
        "PrecisionPolicy",
        "PrecisionGuardCallback",
        "PrecisionCollator",
        "find_module_groups",
        "dtype_map",
        "enforce_policy",
        "PrecisionError",
    ):
        assert getattr(hf_precision, name) is not None


def test_no_public_name_is_shadowed_by_a_module():
    """``hf_precision.dtype_map`` stays the function after every submodule is imported (a module
    of the same name would replace it as an attribute of the package)."""
    import importlib
    import pkgutil
    import types

    import hf_precision

    names = set()
    for info in pkgutil.walk_packages(hf_precision.__path__, "hf_precision."):
        importlib.import_module(info.name)
        names.add(info.name.split(".")[1])
    # `import hf_precision.x as m` would give the function, not the module
    assert not names & set(hf_precision.__all__)
    shadowed = [
        n for n in hf_precision.__all__ if isinstance(getattr(hf_precision, n), types.ModuleType)
    ]
    assert not shadowed
    assert callable(hf_precision.dtype_map) and callable(hf_precision.diagnose)


def test_import_loads_no_engine():
    """``import hf_precision`` is lazy in every process (no reading of the command line):
    no torch, no registry, no module of the layers; each public name loads its module on first
    use and is the object that module defines."""
    code = (
        "import sys, hf_precision\n"
        "print(sorted(m for m in ('torch', 'transformers', 'accelerate', 'hf_precision.rules',\n"
        "    'hf_precision.engine', 'hf_precision.model') if m in sys.modules))\n"
        "from hf_precision import enforce_policy\n"
        "from hf_precision.engine.enforce import enforce_policy as e\n"
        "print(enforce_policy is e, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[:2] == ["[]", "True False"], out


def test_names_are_listed_and_typed():
    """``dir()`` lists every public name before it loads; the ``TYPE_CHECKING`` imports (what
    mypy and IDEs see) name exactly ``__all__``, each from the module ``__getattr__`` loads."""
    import ast
    from pathlib import Path

    import hf_precision

    assert set(hf_precision.__all__) | {"__version__"} <= set(dir(hf_precision))
    tree = ast.parse(Path(hf_precision.__file__).read_text())
    typed = {
        a.name: "." + (node.module or "")
        for block in tree.body
        if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }
    assert typed == {n: hf_precision._PUBLIC[n] for n in hf_precision.__all__}
    assert hf_precision.__version__ == hf_precision.__dict__["__version__"]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hf_precision.nope  # noqa: B018
