"""Build the demo notebooks from the cells below (stored without outputs).

Edit the cells here, then regenerate::

    python notebooks/_build.py

``tests/test_notebooks.py`` checks the ``.ipynb`` files match this script and executes them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

# Every notebook starts here: find the repository root (notebooks run from notebooks/ or the
# root) and an output folder (NOTEBOOK_OUTPUT_DIR overrides it; the tests use a temporary one).
SETUP = """\
import os
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "recipes").is_dir() else Path.cwd().parent
OUT = Path(os.environ.get("NOTEBOOK_OUTPUT_DIR", ROOT / "outputs" / "notebooks"))
os.environ.setdefault("WANDB_MODE", "offline")"""

LOAD_RECIPE = """\
import importlib.util
import sys


def load_recipe(name):
    \"\"\"Import recipes/<name>.py as a module (recipes are scripts, not a package).\"\"\"
    spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module"""

QUICKSTART = [
    new_markdown_cell("""\
# Quickstart: break a tiny VLM's precision, see the error, add the guard, see the map

A tiny LLaVA (about 60k parameters) is built offline from a config. We load it the way real
checkpoints often arrive: the language model and projector in bf16, the vision tower left in
fp32. The first forward fails; `hf_precision` names the module, the dtypes and the fix, then
puts every group on one policy and keeps it there."""),
    new_code_cell(SETUP),
    new_code_cell("""\
import torch

from hf_precision import PrecisionError, PrecisionPolicy, dtype_map, enforce_policy
from hf_precision import install_guards, remove_guards
from hf_precision.tiny import tiny_batch, tiny_llava

model = tiny_llava().requires_grad_(False)  # frozen, as under LoRA or for inference
model.model.language_model.to(torch.bfloat16)
model.model.multi_modal_projector.to(torch.bfloat16)
model.lm_head.to(torch.bfloat16)
batch = tiny_batch(model)  # fp32 pixel_values, as every processor makes them
print(dtype_map(model).table())"""),
    new_markdown_cell("## 1. The error users report\n\nThe fp32 vision tower's output "
                      "reaches the bf16 projector:"),
    new_code_cell("""\
try:
    model(**batch)
except RuntimeError as err:
    error = err
    print(f"{type(err).__name__}: {err}")
assert "dtype" in str(error)"""),
    new_markdown_cell("""\
## 2. Audit: the guard in `raise` mode names the module, the dtypes and the fix

Nothing is cast; the first wrong input raises a `PrecisionError`."""),
    new_code_cell("""\
policy = PrecisionPolicy.from_preset("bf16", mode="raise")
install_guards(model, policy)
try:
    model(**batch)
except PrecisionError as err:
    print(err)
remove_guards(model)"""),
    new_markdown_cell("""\
## 3. Fix: one policy for every group

`enforce_policy` is the one function that casts; `install_guards` keeps inputs in line on
every path (forward, `generate()`, evaluation). In a `Trainer` both happen through
`callbacks=[PrecisionGuardCallback()]`."""),
    new_code_cell("""\
policy = PrecisionPolicy.from_preset("bf16")
report = enforce_policy(model, policy)
print(report.summary())
handle = install_guards(model, policy, report)
out = model(**batch)
print("loss", float(out.loss), "logits", out.logits.dtype, handle)
ids = model.generate(**{k: v for k, v in batch.items() if k != "labels"}, max_new_tokens=3)
print("generated", ids.shape)"""),
    new_markdown_cell("## 4. The dtype map: per group, and as a picture"),
    new_code_cell("""\
from IPython.display import Image, display

from hf_precision.plot import plot_group_bytes

dmap = dtype_map(model)
print(dmap.table())
assert all(g.dtypes == ("bfloat16",) for g in dmap.groups.values())
display(Image(plot_group_bytes(dmap, title="tiny LLaVA after the guard")))"""),
]

LORA_LLAVA = [
    new_markdown_cell("""\
# LoRA on LLaVA with the precision guard

Runs `recipes/lora_llava.py` with its tiny config (about ten seconds of CPU): the tiny LLaVA is
loaded with the language model in bf16 and the vision tower and projector in fp32; the projector
is trained in full and LoRA goes on the language model, and `PrecisionGuardCallback` puts every
frozen weight on the bf16 policy. The model learns to name the colour and shape of held-out
pictures. For a real checkpoint, use `recipes/configs/llava/llava-1.5-7b-bf16.yaml` on a GPU."""),
    new_code_cell(SETUP),
    new_code_cell(LOAD_RECIPE),
    new_code_cell("""\
recipe = load_recipe("lora_llava")
report = recipe.main([
    "--config", str(ROOT / "recipes/configs/llava/tiny.yaml"),
    "--output_dir", str(OUT / "llava"), "--disable_tqdm", "true",
])"""),
    new_markdown_cell("## The dtype map before and after the guard"),
    new_code_cell("""\
from IPython.display import Image, display

from hf_precision import DtypeMap
from hf_precision.plot import plot_group_bytes

before = DtypeMap.from_dict(report["dtype_map_before"])
after = DtypeMap.from_dict(report["dtype_map_after"])
display(Image(plot_group_bytes(before, title="as loaded (+ LoRA weights)")))
display(Image(plot_group_bytes(after, title="after PrecisionGuardCallback")))
assert before.groups["vision_encoder"].dtypes == ("float32",)
assert after.groups["vision_encoder"].dtypes == ("bfloat16",)"""),
    new_markdown_cell("## Loss curve, and the held-out answers before and after training"),
    new_code_cell("""\
import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

curve = report["loss"]["curve"]
fig = Figure(figsize=(5, 3), dpi=100)
FigureCanvasAgg(fig)
ax = fig.add_subplot()
ax.plot(range(1, len(curve) + 1), curve, marker="o")
ax.set(xlabel="logged step", ylabel="training loss", title="tiny LLaVA LoRA")
fig.tight_layout()
png = io.BytesIO()
fig.savefig(png, format="png")
display(Image(png.getvalue()))
assert curve[-1] < curve[0]
print(report["answers_table"])
assert report["accuracy"] >= 0.8"""),
    new_markdown_cell("""\
## Reload the adapter

The adapter is a plain peft adapter: rebuild the base model, load it, apply the same policy."""),
    new_code_cell("""\
from peft import PeftModel

from hf_precision import PrecisionPolicy, enforce_policy, install_guards

base, processor = recipe.load_model(recipe.ModelArguments())
model = PeftModel.from_pretrained(base, report["adapter"])
policy = PrecisionPolicy.from_dict(report["policy"])
install_guards(model, policy, enforce_policy(model, policy))
print(policy.describe())"""),
]

LORA_MINICPMV = [
    new_markdown_cell("""\
# LoRA on MiniCPM-V (2.x remote-code layout) with the precision guard

MiniCPM-V 2.x adds a sin-cos position table, computed in numpy, to the resampler's keys in
fp32. In a bf16 model that fails as soon as images are encoded outside the autocast-wrapped
training forward, e.g. in `generate()`:
`mat1 and mat2 must have the same dtype, but got Float and BFloat16`.
The tiny copy of that layout in `hf_precision.tiny` keeps the bug; the recipe shows it with
`--no_guard` and trains with the guard."""),
    new_code_cell(SETUP),
    new_code_cell(LOAD_RECIPE),
    new_code_cell("""\
recipe = load_recipe("lora_minicpmv")
args = ["--config", str(ROOT / "recipes/configs/minicpmv/tiny.yaml"), "--logging_steps", "2",
        "--num_synthetic_train", "32", "--disable_tqdm", "true"]
try:  # two steps, then the first evaluation's generate() call
    recipe.main([*args, "--max_steps", "2", "--eval_steps", "2", "--no_guard",
                 "--output_dir", str(OUT / "minicpmv-no-guard")])
except RuntimeError as err:
    error = err
    print(f"without the guard: {type(err).__name__}: {err}")
assert "must have the same dtype" in str(error)"""),
    new_code_cell("""\
report = recipe.main([*args, "--max_steps", "10", "--eval_steps", "10",
                      "--output_dir", str(OUT / "minicpmv")])
print(report["guard_hooks"])"""),
    new_markdown_cell("## The dtype map and what the guard installed"),
    new_code_cell("""\
from IPython.display import Image, display

from hf_precision import DtypeMap
from hf_precision.plot import plot_group_bytes

after = DtypeMap.from_dict(report["dtype_map_after"])
display(Image(plot_group_bytes(after, title="tiny MiniCPM-V 2.x after the guard")))
print("answers:", report["generations"][-1]["answers"])
assert report["loss"]["last"] < report["loss"]["first"]"""),
]

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_lora_llava.ipynb": LORA_LLAVA,
    "03_lora_minicpmv.ipynb": LORA_MINICPMV,
}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook ``name`` as a node, without outputs."""
    nb = new_notebook(cells=NOTEBOOKS[name])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{Path(name).stem}-{i:02d}"  # stable ids: rebuilding changes nothing
    return nb


def main(out_dir: Path = HERE) -> list[Path]:
    paths = []
    for name in NOTEBOOKS:
        path = out_dir / name
        nbformat.write(build(name), path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(p)
