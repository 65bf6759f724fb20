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
