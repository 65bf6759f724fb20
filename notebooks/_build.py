"""Build the demo notebooks from the cells below, execute them and store them with their outputs.

Edit the cells here, then regenerate (from the repository root, with the project's venv)::

    python notebooks/_build.py          # or: make notebooks

Every notebook is executed the way ``tests/test_notebooks.py`` executes it (:func:`execute`:
nbclient, the ``python3`` kernel, from the repository root, outputs under a temporary folder,
W&B offline, fixed seeds), and its outputs are stored cleaned (:func:`clean`: no timings,
temporary paths, memory addresses or environment noise). The tests execute them again and
compare (:func:`comparable`): a notebook whose stored outputs are stale fails. ``--no-execute``
writes the cells only (outputs empty), e.g. to review an edit before running it.
"""

from __future__ import annotations

import copy
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: The environment every execution runs in (the tests' conftest sets the same).
ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning",
}

#: Tag of the cells whose output a training run decides (losses, accuracies, generated answers):
#: bf16 kernels round differently across CPUs, so :func:`comparable` keeps only what the
#: precision guard says in them (dtypes, casts, hooks), not the numbers training gives.
TRAINED = "trained"


def trained(source: str) -> nbformat.NotebookNode:
    """A code cell tagged :data:`TRAINED`."""
    return new_code_cell(source, metadata={"tags": [TRAINED]})


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
    new_markdown_cell("""\
## 4. The dtype map: per group, and as a picture

The picture answers "is my precision right?": per group, frozen and trainable weights apart,
the dtypes now (the thin bar: before the casts), the policy's target and a verdict. The
`PrecisionGuardCallback` writes one per event under `<output_dir>/precision/`."""),
    new_code_cell("""\
from IPython.display import Image, display

from hf_precision.report.plot import picture_rows, plot_precision

dmap = dtype_map(model, policy=policy)
print(dmap.table())
assert all(g.dtypes == ("bfloat16",) for g in dmap.groups.values())
rows = picture_rows(dmap, policy=policy, report=report)
display(Image(plot_precision(rows, title="tiny LLaVA after enforce_policy",
                             subtitle=f"policy {policy.describe()}")))"""),
]

LORA_LLAVA = [
    new_markdown_cell("""\
# LoRA on LLaVA with the precision guard

Runs `recipes/lora_llava.py` with its tiny config, as `make demo` does: the tiny LLaVA is
loaded with the language model in bf16 and the vision tower and projector in fp32; the projector
and the LM head are trained in full and LoRA goes on the language model, and
`PrecisionGuardCallback` puts every frozen weight on the bf16 policy. The model learns to name
the colour and shape of held-out pictures (at least 90% exact). For a real checkpoint, use `recipes/configs/llava/llava-1.5-7b-bf16.yaml` on a GPU."""),
    new_code_cell(SETUP),
    new_code_cell(LOAD_RECIPE),
    trained("""\
recipe = load_recipe("lora_llava")
report = recipe.main([
    "--config", str(ROOT / "recipes/configs/llava/tiny.yaml"),
    "--output_dir", str(OUT / "llava"), "--disable_tqdm", "true",
])"""),
    new_markdown_cell("## The dtype map before and after the guard"),
    new_code_cell("""\
from IPython.display import Image, display

from hf_precision import DtypeMap, PrecisionPolicy
from hf_precision.report.plot import picture_rows, plot_precision

policy = PrecisionPolicy.from_dict(report["policy"])
before = DtypeMap.from_dict(report["dtype_map_before"])
after = DtypeMap.from_dict(report["dtype_map_after"])
display(Image(plot_precision(picture_rows(before), title="as loaded (+ LoRA weights)")))
display(Image(plot_precision(picture_rows(after, policy=policy),
                             title="after PrecisionGuardCallback",
                             subtitle=f"policy {policy.describe()}")))
assert before.groups["vision_encoder"].dtypes == ("float32",)
assert after.groups["vision_encoder"].dtypes == ("bfloat16",)"""),
    new_markdown_cell("## Loss curve, and the held-out answers before and after training"),
    trained("""\
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
assert report["accuracy"] >= 0.9"""),
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
    trained("""\
recipe = load_recipe("lora_minicpmv")
args = ["--config", str(ROOT / "recipes/configs/minicpmv/tiny.yaml"), "--logging_steps", "2",
        "--disable_tqdm", "true"]
try:  # two steps, then the first evaluation's generate() call
    recipe.main([*args, "--max_steps", "2", "--eval_steps", "2", "--no_guard",
                 "--output_dir", str(OUT / "minicpmv-no-guard")])
except RuntimeError as err:
    error = err
    print(f"without the guard: {type(err).__name__}: {err}")
assert "must have the same dtype" in str(error)"""),
    new_markdown_cell("""\
With the guard: 100 steps (LoRA on the language model, the resampler's `kv_proj` and the LM head;
the learning rate decays to zero), then `generate()` answers eight held-out pictures. In 100 steps
the tiny MiniCPM-V learns the answers' form (`a <colour> <shape>`) and starts on their content;
the LLaVA notebook (02) trains to at least 90% exact."""),
    trained("""\
report = recipe.main([*args, "--max_steps", "100", "--eval_steps", "100",
                      "--lr_scheduler_type", "cosine", "--warmup_steps", "10",
                      "--lora_targets", "language_model,projector,lm_head",
                      "--num_generate", "8", "--logging_steps", "20",
                      "--output_dir", str(OUT / "minicpmv")])
print(report["guard_hooks"])"""),
    new_markdown_cell("## The dtype map and what the guard installed"),
    new_code_cell("""\
from IPython.display import Image, display

from hf_precision import DtypeMap, PrecisionPolicy
from hf_precision.report.plot import picture_rows, plot_precision

policy = PrecisionPolicy.from_dict(report["policy"])
after = DtypeMap.from_dict(report["dtype_map_after"])
display(Image(plot_precision(picture_rows(after, policy=policy),
                             title="tiny MiniCPM-V 2.x after the guard",
                             subtitle=f"policy {policy.describe()}")))
assert report["loss"]["last"] < report["loss"]["first"]"""),
    trained("""\
final = report["generations"][-1]
for a in final["answers"]:
    print(f"{a['answer']:<20} {a['prediction']:<20} {'ok' if a['prediction'] == a['answer'] else '--'}")
right = sum(a["prediction"] == a["answer"] for a in final["answers"])
print(f"after {final['step']} steps: {right}/{len(final['answers'])} exact")
assert all(a["prediction"] for a in final["answers"])  # every picture gets an answer
"""),
]

SILENT_LOSSES = [
    new_markdown_cell("""\
# What is lost silently: who made the NaN, where the activation dtype changed

Two watchers of `PrecisionGuardCallback` (docs/silent_losses.md). The **blame** is on by
default and costs nothing until a logged loss or gradient norm turns inf/NaN; then it names the
first module whose output went non-finite. The **trace** records one forward module by module
and names the first place the activation stream changes dtype, and what did it."""),
    new_code_cell(SETUP),
    new_markdown_cell("""\
## 1. Who made the NaN

A tiny LLaMA loaded in float16 whose layer-1 MLP output passes 65504, trained by a real
`Trainer` with the one-line callback. Trainer hides the NaN loss (`logging_nan_inf_filter`);
the gradient norm turns NaN at step 1, arms the blame, and step 2 is inspected."""),
    new_code_cell("""\
import contextlib
import json
import sys

import torch
from transformers import Trainer, TrainingArguments

from hf_precision import PrecisionGuardCallback
from hf_precision.tiny import tiny_text_llama

os.environ["HF_PRECISION_TOOL"] = "python"  # fixes as bf16=True (argv reads as a CLI)
torch.manual_seed(0)
model = tiny_text_llama(torch.float16)
model.requires_grad_(False)
model.lm_head.requires_grad_(True)
with torch.no_grad():
    model.model.layers[1].mlp.up_proj.weight.mul_(1000)
    model.model.layers[1].mlp.down_proj.weight.mul_(1e5)
ids = torch.randint(4, 200, (4, 8), generator=torch.Generator().manual_seed(0))
rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i} for i in ids]
args = TrainingArguments(output_dir=str(OUT / "blame"), use_cpu=True, max_steps=3,
                         per_device_train_batch_size=2, logging_steps=1, report_to=[],
                         save_strategy="no", disable_tqdm=True)
guard = PrecisionGuardCallback()


def hooks():  # the blame's (the guard's one-shot "what ran" hooks go at the next forward)
    every = [h for m in model.modules() for h in (*m._forward_hooks.values(),
                                                  *m._backward_hooks.values())]
    return sum(not h.__qualname__.startswith("ComputeWatch.") for h in every)


with contextlib.redirect_stderr(sys.stdout):  # the guard's log lines and Trainer's, in order
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[guard])
    print("hooks while idle:", hooks())
    trainer.train()
    print("hooks after the finding:", hooks())"""),
    new_code_cell("""\
[finding] = guard.blame.findings
print(finding.line())
record = json.loads((OUT / "blame" / "precision" / "000002-nonfinite.json").read_text())
print({k: record["nonfinite"][0][k] for k in ("module", "role", "kind", "input_dtypes",
                                              "weight_dtypes", "output_dtype")})"""),
    new_markdown_cell("""\
## 2. Where the activation dtype changed

The same tiny LLaMA in bf16, with a float32 buffer multiplying layer 0's MLP output (as Gemma
4's `std_bias`). A map of parameter dtypes shows nothing wrong; the trace shows where the bf16
stream became float32, and that the buffer did it."""),
    new_code_cell("""\
from IPython.display import Image, display
from torch import nn

from hf_precision.report.plot import plot_trace
from hf_precision.watch.trace import trace_forward


class StdBiasMLP(nn.Module):
    def __init__(self, mlp, hidden):
        super().__init__()
        self.mlp = mlp
        self.register_buffer("std_bias", torch.ones(hidden))  # float32

    def forward(self, x):
        return self.mlp(x) * self.std_bias


model = tiny_text_llama(torch.bfloat16)
model.model.layers[0].mlp = StdBiasMLP(model.model.layers[0].mlp, model.config.hidden_size)
trace = trace_forward(model, input_ids=ids[:2], autocast=torch.bfloat16)
print(trace.line())
for change in trace.changes[:3]:
    print("  ", change.line())
display(Image(plot_trace(trace, title="tiny LLaMA, bf16 + a float32 std_bias buffer")))"""),
]

NOTEBOOKS = {
    "01_quickstart.ipynb": QUICKSTART,
    "02_lora_llava.ipynb": LORA_LLAVA,
    "03_lora_minicpmv.ipynb": LORA_MINICPMV,
    "04_silent_losses.ipynb": SILENT_LOSSES,
}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook ``name`` as a node, without outputs."""
    nb = new_notebook(cells=copy.deepcopy(NOTEBOOKS[name]))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{Path(name).stem}-{i:02d}"  # stable ids: rebuilding changes nothing
    return nb


# ---------------------------------------------------------------------------- execution
@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def execute(name: str, out_dir: Path, kernel: str = "python3") -> nbformat.NotebookNode:
    """Run the notebook ``name`` as built by :func:`build` (the tests and the regeneration
    run this same function): the ``kernel`` kernel from the repository root, its outputs under
    ``out_dir``, in :data:`ENV`. Raises ``CellExecutionError`` on any error."""
    from nbclient import NotebookClient

    nb = build(name)
    env = {**ENV, "NOTEBOOK_OUTPUT_DIR": str(out_dir)}
    with _environ(env):  # the kernel inherits it
        client = NotebookClient(
            nb, kernel_name=kernel, timeout=600, resources={"metadata": {"path": str(ROOT)}}
        )
        client.execute()
    return nb


_ADDRESS = re.compile(r"\b0x[0-9a-f]{6,}\b")
_TIMING = re.compile(
    r"(['\"]?\w*(?:runtime|per_second|preparation_time)['\"]?:\s*)'?[0-9.e+-]+'?"
)
_FILE_LINE = re.compile(r"^\S*?([\w.-]+\.py):\d+: ", re.M)
#: a library's own timestamped log line on stdout (DeepSpeed's "Setting accelerator to CPU")
_LIBRARY_LOG = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+\] ")
#: stderr lines kept in the stored notebooks: the package's own warnings, not the environment's
_OURS = re.compile(r"hf-precision|hf_precision|Precision(Warning|Error)|PrecisionGuard")


def _clean_text(text: str, out_dir: Path) -> str:
    text = text.replace(str(out_dir), "<OUT>").replace(str(ROOT), "<ROOT>")
    text = text.replace(sys.prefix, "<VENV>")
    text = _ADDRESS.sub("0x...", text)
    text = _TIMING.sub(lambda m: m.group(1) + "'...'", text)
    return _FILE_LINE.sub(lambda m: f"{m.group(1)}: ", text)


def clean(nb: nbformat.NotebookNode, out_dir: Path) -> nbformat.NotebookNode:
    """``nb`` as it is stored: execution counts from 1, no execution timestamps, paths under
    ``out_dir`` and the repository as ``<OUT>``/``<ROOT>``, no memory addresses or timings,
    stderr only for what hf-precision says (the environment's own warnings vary by machine)."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    nb.metadata["language_info"] = {"name": "python"}  # the kernel's adds its Python version
    count = 0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        kept = []
        for out in cell.outputs:
            if "execution_count" in out:
                out["execution_count"] = count
            if out.output_type == "stream":
                text = out.text
                lines = text.splitlines(keepends=True)
                if out.name == "stderr":
                    lines = [ln for ln in lines if _OURS.search(ln)]
                text = "".join(ln for ln in lines if not _LIBRARY_LOG.match(ln))
                if not text:
                    continue
                out.text = _clean_text(text, out_dir)
            elif out.output_type == "error":
                out.traceback = []
            elif "text/plain" in out.get("data", {}):
                out.data["text/plain"] = _clean_text(out.data["text/plain"], out_dir)
            if (
                out.output_type == "stream"
                and kept
                and kept[-1].output_type == "stream"
                and kept[-1].name == out.name
            ):  # one print may arrive in pieces: how it is split depends on timing
                kept[-1].text += out.text
                continue
            kept.append(out)
        cell.outputs = kept
    return nb


#: in a :data:`TRAINED` cell, the lines compared: what the guard and the dtype maps say
_PRECISION_LINE = re.compile(r"float|hf-precision|GuardHandle|Precision|Fix:|policy", re.I)
_FLOAT = re.compile(r"-?\d+\.\d+(?:e[+-]?\d+)?")


def comparable(nb: nbformat.NotebookNode) -> list[list[Any]]:
    """What must not change between the stored and a fresh execution, per code cell: the text
    (floats to two significant digits: a loss may differ in its last digits across CPUs) and
    each picture's pixel size (not its bytes: font rendering differs across machines)."""
    import base64

    from hf_precision.report.plot import png_size

    def num(m: re.Match[str]) -> str:
        return f"{float(m.group(0)):.2g}"

    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        trained = TRAINED in cell.metadata.get("tags", ())
        outs: list[Any] = []
        for out in cell.outputs:
            if out.output_type == "stream":
                text = out.text
                if trained:
                    text = "".join(
                        ln for ln in text.splitlines(keepends=True) if _PRECISION_LINE.search(ln)
                    )
                outs.append((out.name, _FLOAT.sub(num, text)))
            elif out.output_type == "error":
                outs.append(("error", out.ename, out.evalue))
            else:
                data = out.get("data", {})
                for mime in sorted(data):
                    if mime == "image/png":
                        outs.append((mime, png_size(base64.b64decode(data[mime]))))
                    elif mime == "text/plain":
                        outs.append((mime, _FLOAT.sub(num, data[mime])))
                    else:
                        outs.append((mime,))
        cells.append(outs)
    return cells


def main(out_dir: Path = HERE, *, run: bool = True, names: list[str] | None = None) -> list[Path]:
    """Write the notebooks (``names``, default all) to ``out_dir``, executed and cleaned
    unless ``run`` is false."""
    paths = []
    for name in names or NOTEBOOKS:
        if run:
            with tempfile.TemporaryDirectory(prefix="hf-precision-notebook-") as tmp:
                nb = clean(execute(name, Path(tmp)), Path(tmp))
        else:
            nb = build(name)
        path = out_dir / name
        nbformat.write(nb, path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    argv = sys.argv[1:]
    run = "--no-execute" not in argv
    args = [a for a in argv if a != "--no-execute"]
    wanted = [a for a in args if a.endswith(".ipynb")]
    folders = [a for a in args if not a.endswith(".ipynb")]
    for p in main(Path(folders[0]) if folders else HERE, run=run, names=wanted or None):
        print(p)
