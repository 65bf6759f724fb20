"""The demo notebooks: stored without outputs, in sync with notebooks/_build.py, and executable.

They run with nbclient on the ``python3`` kernel of the interpreter running the tests (the
venv's), from the repository root, writing their outputs under a temporary folder.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NAMES = ("01_quickstart.ipynb", "02_lora_llava.ipynb", "03_lora_minicpmv.ipynb")


def load_builder() -> Any:
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOKS / "_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def kernel_name() -> str:
    """``python3`` must start this interpreter; install the venv's kernelspec if it does not."""
    from jupyter_client.kernelspec import KernelSpecManager

    def spec_python() -> str | None:
        try:
            return str(KernelSpecManager().get_kernel_spec("python3").argv[0])
        except Exception:
            return None

    exe = spec_python()
    if exe not in (sys.executable, "python", "python3", "{python}"):
        subprocess.run(
            [sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"],
            check=True,
            capture_output=True,
        )
    return "python3"


def test_notebooks_are_built_from_the_generator_without_outputs(tmp_path: Path) -> None:
    builder = load_builder()
    assert tuple(builder.NOTEBOOKS) == NAMES
    builder.main(tmp_path)
    for name in NAMES:
        stored = json.loads((NOTEBOOKS / name).read_text())
        assert stored == json.loads((tmp_path / name).read_text()), (
            f"{name} differs from notebooks/_build.py: run `python notebooks/_build.py`"
        )
        code = [c for c in stored["cells"] if c["cell_type"] == "code"]
        assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
        assert stored["metadata"]["kernelspec"]["name"] == "python3"


def execute(name: str, kernel: str, out_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("NOTEBOOK_OUTPUT_DIR", str(out_dir))  # the kernel inherits it
    monkeypatch.setenv("WANDB_MODE", "offline")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(
        nb, kernel_name=kernel, timeout=240, resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError with the cell's traceback on any error
    return nb


def outputs(nb: Any) -> tuple[str, list[str]]:
    """All stdout text, and the mime types of every displayed item."""
    text, mimes = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream" and out["name"] == "stdout":
                text.append(out["text"])
            elif out["output_type"] in ("display_data", "execute_result"):
                mimes.extend(out["data"])
    return "".join(text), mimes


def test_quickstart_notebook(
    kernel_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, mimes = outputs(execute(NAMES[0], kernel_name, tmp_path, monkeypatch))
    assert "RuntimeError: expected m1 and m2 to have the same dtype" in text  # the break
    assert "model.multi_modal_projector" in text and "Fix:" in text  # the guard's audit
    assert "cast 41 tensor(s)" in text and "vision_encoder  bfloat16" in text  # the map
    assert "image/png" in mimes


@pytest.mark.slow
def test_lora_llava_notebook(
    kernel_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, mimes = outputs(execute(NAMES[1], kernel_name, tmp_path, monkeypatch))
    assert mimes.count("image/png") == 3  # before, after, loss curve
    assert (tmp_path / "llava" / "adapter" / "adapter_model.safetensors").is_file()
    assert "bf16 (frozen bfloat16, trainable float32" in text
    assert "Held-out answers (exact match): before training" in text


@pytest.mark.slow
def test_lora_minicpmv_notebook(
    kernel_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text, mimes = outputs(execute(NAMES[2], kernel_name, tmp_path, monkeypatch))
    assert "without the guard: RuntimeError: mat1 and mat2 must have the same dtype" in text
    assert "GuardHandle(" in text and "image/png" in mimes
    assert not (tmp_path / "minicpmv-no-guard" / "adapter").exists()
    assert (tmp_path / "minicpmv" / "adapter" / "adapter_model.safetensors").is_file()
