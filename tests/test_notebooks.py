"""The demo notebooks: built by notebooks/_build.py, stored with the outputs of its execution,
and stale outputs fail here.

Each notebook is executed with ``_build.execute`` (the function ``python notebooks/_build.py``
regenerates them with): nbclient on the ``python3`` kernel of the interpreter running the tests
(the venv's), from the repository root, writing under a temporary folder. Its cleaned outputs
must equal the stored ones (``_build.comparable``: text with timings, paths and addresses
normalised, floats to two digits, pictures by pixel size).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NAMES = (
    "01_quickstart.ipynb",
    "02_lora_llava.ipynb",
    "03_lora_minicpmv.ipynb",
    "04_silent_losses.ipynb",
)
REGENERATE = "python notebooks/_build.py"


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


def _sources(nb: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(c["id"], c["cell_type"], "".join(c["source"])) for c in nb["cells"]]


def test_notebooks_are_built_from_the_generator_with_their_outputs(tmp_path: Path) -> None:
    builder = load_builder()
    assert tuple(builder.NOTEBOOKS) == NAMES
    builder.main(tmp_path, run=False)
    for name in NAMES:
        stored = json.loads((NOTEBOOKS / name).read_text())
        built = json.loads((tmp_path / name).read_text())
        assert _sources(stored) == _sources(built) and stored["metadata"] == built["metadata"], (
            f"{name} differs from notebooks/_build.py: run `{REGENERATE}`"
        )
        code = [c for c in stored["cells"] if c["cell_type"] == "code"]
        # committed with outputs, numbered as one run from the top
        assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), name
        assert sum(len(c["outputs"]) for c in code) >= len(code) // 2, name
        assert stored["metadata"]["kernelspec"]["name"] == "python3"
        text = json.dumps(stored)
        for leak in (str(ROOT), "/tmp/", "0x7f", "Failed to load"):
            assert leak not in text, (name, leak)  # cleaned: no paths, addresses, env noise


def test_stale_outputs_are_told_apart_from_fresh_ones() -> None:
    """What ``comparable`` keeps: a changed message is stale, a timing or a path is not."""
    import nbformat

    builder = load_builder()
    stored = nbformat.read(NOTEBOOKS / NAMES[0], as_version=4)
    fresh = nbformat.read(NOTEBOOKS / NAMES[0], as_version=4)
    stream = next(
        o
        for c in fresh.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "stream"
    )
    stream.text += "{'train_runtime': 0.1234, 'loss': 5.5312}\n"
    stored_stream = next(
        o
        for c in stored.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "stream"
    )
    stored_stream.text += "{'train_runtime': '...', 'loss': 5.5318}\n"
    tmp = Path("/tmp/some-run")
    assert builder.clean(stored, tmp) == builder.clean(stored, tmp)
    assert builder.comparable(builder.clean(fresh, tmp)) == builder.comparable(stored)
    stream.text = stream.text.replace("float32", "float16", 1)
    assert builder.comparable(builder.clean(fresh, tmp)) != builder.comparable(stored)


def execute_and_compare(name: str, kernel: str, out_dir: Path) -> Any:
    """Execute ``name`` as the regeneration does and compare with the stored outputs."""
    import nbformat

    builder = load_builder()
    nb = builder.clean(builder.execute(name, out_dir, kernel), out_dir)
    stored = nbformat.read(NOTEBOOKS / name, as_version=4)
    fresh, old = builder.comparable(nb), builder.comparable(stored)
    for i, (a, b) in enumerate(zip(fresh, old)):
        assert a == b, (
            f"{name}: the outputs of code cell {i + 1} are stale; run `{REGENERATE}` and commit "
            f"the notebooks.\nnow:    {a}\nstored: {b}"
        )
    assert len(fresh) == len(old), f"{name}: run `{REGENERATE}`"
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


def test_quickstart_notebook(kernel_name: str, tmp_path: Path) -> None:
    text, mimes = outputs(execute_and_compare(NAMES[0], kernel_name, tmp_path))
    assert "RuntimeError: expected m1 and m2 to have the same dtype" in text  # the break
    assert "model.multi_modal_projector" in text and "Fix:" in text  # the guard's audit
    assert "cast 41 tensor(s)" in text and "vision_encoder  bfloat16" in text  # the map
    assert "image/png" in mimes


@pytest.mark.slow
def test_lora_llava_notebook(kernel_name: str, tmp_path: Path) -> None:
    text, mimes = outputs(execute_and_compare(NAMES[1], kernel_name, tmp_path))
    assert mimes.count("image/png") == 3  # before, after, loss curve
    assert (tmp_path / "llava" / "adapter" / "adapter_model.safetensors").is_file()
    assert "bf16 (frozen bfloat16, trainable float32" in text
    assert "Held-out answers (exact match): before training" in text


@pytest.mark.slow
def test_lora_minicpmv_notebook(kernel_name: str, tmp_path: Path) -> None:
    text, mimes = outputs(execute_and_compare(NAMES[2], kernel_name, tmp_path))
    assert "without the guard: RuntimeError: mat1 and mat2 must have the same dtype" in text
    assert "GuardHandle(" in text and "image/png" in mimes
    assert not (tmp_path / "minicpmv-no-guard" / "adapter").exists()
    assert (tmp_path / "minicpmv" / "adapter" / "adapter_model.safetensors").is_file()
    # a working result: every held-out picture answered in the task's form
    assert re.search(r"after 100 steps: \d/8 exact", text), text[-2000:]


def test_silent_losses_notebook(kernel_name: str, tmp_path: Path) -> None:
    text, mimes = outputs(execute_and_compare(NAMES[3], kernel_name, tmp_path))
    assert "hooks while idle: 0" in text and "hooks after the finding: 0" in text
    assert "model.layers.1.mlp.down_proj (Linear) overflowed float16" in text
    assert "first at model.layers.0.mlp (StdBiasMLP): bfloat16 -> float32" in text
    assert "made by its buffer std_bias (float32)" in text and "image/png" in mimes


def test_in_trained_cells_only_what_the_guard_says_is_compared() -> None:
    """Losses and answers depend on the CPU's bf16 kernels; the dtype tables do not."""
    import nbformat

    builder = load_builder()
    stored = nbformat.read(NOTEBOOKS / NAMES[1], as_version=4)
    fresh = nbformat.read(NOTEBOOKS / NAMES[1], as_version=4)
    cell = next(c for c in fresh.cells if builder.TRAINED in c.metadata.get("tags", ()))
    stream = next(o for o in cell.outputs if o.output_type == "stream" and "loss" in o.text)
    stream.text = stream.text.replace("Held-out answers", "Held-out answers!!")
    stream.text = re.sub(r"'loss': '[0-9.]+'", "'loss': '9.999'", stream.text)
    assert builder.comparable(fresh) == builder.comparable(stored)
    stream.text = stream.text.replace("bfloat16:21,536", "float16:21,536", 1)
    assert builder.comparable(fresh) != builder.comparable(stored)
