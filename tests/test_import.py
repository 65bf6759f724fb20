import subprocess
import sys


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
