"""The support matrix of ``docs/matrix.md``: for each tiny family and each setup, does a training
step (forward + backward) and a ``generate()`` fail without the guard, with which error, and what
the guard does (casts, hooks only, nothing needed).

Regenerate the installed transformers' column (the other column is kept as it is)::

    PYTHONPATH=. python -m hf_precision.tiny.matrix            # writes docs/matrix.md
    PYTHONPATH=. python -m hf_precision.tiny.matrix --check    # exit 1 when the column is stale

Run it once per transformers line (``make test`` venv: 5.x; ``.venv-tf4``: 4.57);
``tests/tiny/test_matrix.py`` fails while the installed version's column differs from the file.

Each cell runs the same step three ways on fresh tiny models (CPU, no autocast, so a dtype
mismatch is not hidden): without the guard; with the guard's casts but no hooks (to tell what the
hooks add); with the guard (:class:`~hf_precision.engine.guard.PrecisionGuard`: casts, then
hooks), its policy inferred as ``PrecisionGuardCallback()`` infers it (no flag: what was loaded
is kept; ``fp16``: the ``fp16`` preset).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: The families (rows): native transformers models, then the remote-code layouts of
#: :mod:`hf_precision.tiny.remote_layouts`.
NATIVE = ("llava", "qwen2_vl", "idefics2", "idefics3", "paligemma", "minicpmv4_6")
REMOTE = ("minicpmv", "omnilmm", "internlmxcomposer2", "internvl_chat", "xtuner_llava")


@dataclass(frozen=True)
class Setup:
    """One way people load and train a model (the rows under each family)."""

    name: str
    what: str
    policy: str | None = None  # the preset the flags give; None: no flag (inferred)
    families: tuple[str, ...] | None = None  # where it runs (None: every family)
    generate: bool = True


_CHEAP = ("llava", "qwen2_vl")  # the setups that need a Trainer or a library run on these

SETUPS = (
    Setup(
        "bf16",
        "the whole model loaded in bf16, the projector (or resampler) trained; no flag: only the "
        "batch is fp32 (class A)",
    ),
    Setup(
        "split",
        "vision encoder loaded fp32 (another checkpoint), the rest bf16; the projector (or "
        "resampler) trained; no precision flag",
    ),
    Setup(
        "fp32 projector",
        "bf16 model, the projector (or resampler) trained in fp32; no flag",
    ),
    Setup(
        "fp32 norms",
        "bf16 model, every normalization layer's weights fp32 (LLaMA-Factory's "
        "`upcast_layernorm`, PEFT's `prepare_model_for_kbit_training`); projector trained; no flag",
    ),
    Setup(
        "fp16 + GradScaler",
        "fp16 model, projector trained as loaded (fp16); `fp16=True`: one "
        "`torch.amp.GradScaler('cpu')` step (on CPU transformers runs neither autocast nor a "
        "scaler, so the scaler is called directly; no generate)",
        policy="fp16",
        generate=False,
    ),
    Setup(
        "bf16_full_eval",
        "bf16 model, projector trained in fp32; `Trainer(bf16_full_eval=True).evaluate()` "
        "(transformers casts the whole model to bf16 in place for it), then a training step",
        families=_CHEAP,
    ),
    Setup(
        "int8 (torchao)",
        "bf16 model, the language model's linears int8 weight-only (torchao `quantize_`), "
        "projector trained in fp32; no flag",
        families=_CHEAP,
    ),
)

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_LOST = "evaluate() left"


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = _ADDRESS.sub("", text).replace("|", "/")
    return text if len(text) <= 90 else text[:87] + "..."


# ---------------------------------------------------------------------------- models
def _build(family: str, dtype: torch.dtype) -> nn.Module:
    if family in REMOTE:
        from .remote_layouts import REMOTE_LAYOUTS

        return REMOTE_LAYOUTS[family](dtype)
    from .vlm import build_tiny

    return build_tiny(family, dtype)


def _batch(model: nn.Module) -> dict[str, torch.Tensor]:
    if type(model).__module__ == f"{__package__}.remote_layouts":
        from .remote_layouts import remote_batch

        return remote_batch(model)  # type: ignore[arg-type]
    from .vlm import tiny_batch

    return tiny_batch(model)


def _trained(model: nn.Module) -> nn.Module:
    """The projector (else the resampler) of the model: the part these setups train."""
    from ..rules.groups.module_groups import find_module_groups

    groups = find_module_groups(model)
    for group in ("projector", "resampler"):
        mods = groups.modules(group)
        if mods:
            return mods[0]
    raise LookupError(f"{type(model).__name__}: no projector or resampler group")


def _prepare(family: str, setup: Setup) -> nn.Module:
    """A fresh model loaded the way ``setup`` says, only its projector trainable."""
    from ..rules.groups.module_groups import find_module_groups

    dtype = torch.float16 if setup.policy == "fp16" else torch.bfloat16
    model = _build(family, dtype)
    model.requires_grad_(False)
    trained = _trained(model)
    if setup.name == "split":
        for tower in find_module_groups(model).modules("vision_encoder"):
            tower.float()
    elif setup.name in ("fp32 projector", "bf16_full_eval", "int8 (torchao)"):
        trained.float()
    elif setup.name == "fp32 norms":
        for mod in model.modules():
            if "norm" in type(mod).__name__.lower():
                mod.float()
    if setup.name == "int8 (torchao)":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        for lm in find_module_groups(model).modules("language_model"):
            quantize_(lm, Int8WeightOnlyConfig())
    trained.requires_grad_(True)
    return model


# ---------------------------------------------------------------------------- one run
def _full_eval(model: nn.Module, batch: dict[str, torch.Tensor], callbacks: list[Any]) -> str:
    """``Trainer(bf16_full_eval=True).evaluate()``; what it left of the trained weights."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    before = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            use_cpu=True,
            bf16_full_eval=True,
            per_device_eval_batch_size=1,
            report_to=[],
        )
        trainer = Trainer(
            model=model,
            args=args,
            eval_dataset=[batch],  # the whole batch is one item (Qwen2-VL's patches are flat)
            data_collator=_first,
            callbacks=callbacks,
        )
        trainer.evaluate()
    rounded = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype != before[n]]
    return f"{_LOST} {len(rounded)} trained fp32 weight(s) in bf16" if rounded else ""


def _where(err: BaseException) -> str:
    """`` in Class.method`` of the deepest frame of the model's code (not torch's, not the
    guard's) the error went through."""
    tb, where = err.__traceback__, ""
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        ours = "/hf_precision/" in path and not path.endswith("/tiny/remote_layouts.py")
        if "/torch/" not in path and not ours:
            where = tb.tb_frame.f_code.co_qualname
        tb = tb.tb_next
    return f" in `{where}`" if where else ""


def _first(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return items[0]


def _step(model: nn.Module, setup: Setup, callbacks: list[Any] | None = None) -> str | None:
    """The setup's run: a training step and a short ``generate()`` (after an ``evaluate()`` for
    ``bf16_full_eval``); the first error as ``phase `message```, or a loss of precision."""
    batch = _batch(model)
    phase, lost = "forward", ""
    try:
        if setup.name == "bf16_full_eval":
            phase = "evaluate"
            lost = _full_eval(model, batch, callbacks or [])
            phase = "forward"
        model.train()
        loss = model(**batch).loss
        phase = "backward"
        params = [p for p in model.parameters() if p.requires_grad]
        optim = torch.optim.SGD(params, lr=1e-3)
        if setup.policy == "fp16":
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(loss).backward()
            phase = "scaler step"
            scaler.step(optim)
            scaler.update()
        else:
            loss.backward()
            optim.step()
        if setup.generate:
            phase = "generate"
            model.eval()
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            with torch.no_grad():
                model.generate(**inputs, max_new_tokens=2)  # type: ignore[operator]
    except Exception as err:  # the cell records it
        return f"{phase} `{_first_line(err)}`{_where(err)}"
    return lost or None


def _policy(model: nn.Module, setup: Setup) -> Any:
    from ..rules.policy.precision_policy import PrecisionPolicy

    if setup.policy is not None:
        return PrecisionPolicy.from_preset(setup.policy)
    return PrecisionPolicy.from_model(model)


class _HookProbe:
    """Counts the guarded modules whose hook changed an input's dtype: a probe hook before and
    one after the guard's own on each module the guard hooked."""

    def __init__(self, model: nn.Module, paths: list[str]) -> None:
        self.cast: set[str] = set()
        self.handles: list[Any] = []
        for path in dict.fromkeys(paths):
            try:
                mod = model.get_submodule(path)
            except AttributeError:  # held outside the module tree (OmniLMM's tower)
                continue
            seen: list[tuple[torch.dtype, ...]] = []
            self.handles.append(
                mod.register_forward_pre_hook(self._before(seen), with_kwargs=True, prepend=True)
            )
            self.handles.append(
                mod.register_forward_pre_hook(self._after(seen, path), with_kwargs=True)
            )

    @staticmethod
    def _dtypes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.dtype, ...]:
        values = [*args, *kwargs.values()]
        return tuple(v.dtype for v in values if isinstance(v, torch.Tensor))

    def _before(self, seen: list[tuple[torch.dtype, ...]]) -> Any:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen.append(self._dtypes(args, kwargs))

        return hook

    def _after(self, seen: list[tuple[torch.dtype, ...]], path: str) -> Any:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if seen and seen.pop() != self._dtypes(args, kwargs):
                self.cast.add(path or "<model>")

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _guarded(family: str, setup: Setup) -> tuple[str | None, list[str]]:
    """The setup's run with the guard: its error (or loss) and what the guard did."""
    from ..engine.guard import PrecisionGuard

    model = _prepare(family, setup)
    if setup.name == "bf16_full_eval":  # the callback is the guard: it restores after evaluate()
        from ..frontends.callback import PrecisionGuardCallback

        cb = PrecisionGuardCallback(report=False)
        result = _step(model, setup, [cb])
        casts = cb.events[0][1] if cb.events else 0
        restored = [f"restores {cb.restored} after evaluate()"] if cb.restored else []
        if cb.guard is not None:
            cb.guard.teardown()
        return result, ([f"casts {casts} tensor(s)"] if casts else []) + restored
    guard = PrecisionGuard(model, _policy(model, setup), claim=False)
    casts = len(guard.verify("setup").changes)
    handle = guard.handle
    paths = [*handle.batch, *handle.boundary, *handle.leaf] if handle is not None else []
    probe = _HookProbe(model, paths)
    result = _step(model, setup)
    probe.remove()
    guard.teardown()
    did = [f"casts {casts} tensor(s)"] if casts else []
    if probe.cast:
        did.append(f"hooks cast inputs at {len(probe.cast)} module(s)")
    return result, did


def cell(family: str, setup: Setup) -> str:
    """One cell: what happens without the guard, then what the guard does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            bare = _step(_prepare(family, setup), setup)
        except ImportError as err:  # a family (or library) this environment does not have
            missing = "torchao not installed" if "torchao" in str(err) else "not in this version"
            return f"n/a ({missing})"
        guarded, did = _guarded(family, setup)

    def said(result: str | None) -> str:
        if result is None:
            return "runs"
        lost = result.startswith(_LOST)
        return f"**{'loses precision' if lost else 'fails'}**: {result}"

    if guarded is not None:
        return f"{said(bare)} → **still {said(guarded)[2:]}"
    return f"{said(bare)} → {', '.join(did) if did else 'watches (nothing to do)'}"


# ---------------------------------------------------------------------------- the document
HEADER = """# Where the guard matters: the support matrix

<!-- generated by `PYTHONPATH=. python -m hf_precision.tiny.matrix`, once per transformers line
(the main venv for 5.x, .venv-tf4 for 4.57; each run fills its own column and keeps the other);
tests/tiny/test_matrix.py fails while the installed version's column is stale. Do not edit the
tables by hand. -->

Each cell runs one training step (forward, backward, optimizer step) and a two-token `generate()`
on a tiny model (CPU, so no autocast hides a mismatch; the batch fp32, as collators build it),
first without the guard, then with it (`PrecisionGuard`, its policy inferred as
`PrecisionGuardCallback()` infers it: no flag keeps what was loaded, `fp16=True` gives `fp16`).

- before the arrow, without the guard: `runs`, or **fails**: the phase, the error's first line
  and the model code it was raised in; **loses precision**: what an evaluation left rounded;
- after it, what the guard did: `casts N tensor(s)` (before the run, by its plan), `hooks cast
  inputs at K module(s)` (modules whose inputs its hooks changed during the run), `restores N
  after evaluate()`, or `watches (nothing to do)`; **still fails** when the guard did not rescue
  the run (a gap, listed as found).

Reading it honestly: transformers' own VLMs (5.x and 4.57 alike for these families) cast
`pixel_values` and the image features at their boundaries, so a whole model loaded in bf16 with
an fp32 batch runs without the guard (`bf16` rows: `runs`); there the guard's casts are the
rotary tables a `model.to(bf16)` rounded (recomputed in float32) and the batch. What fails
without it is a model whose parts differ: a trained projector or norms held in float32, a
vision tower in another dtype (the remote-code layouts, which cast nothing themselves), fp16
trainables under the GradScaler, and what `*_full_eval` rounds.
"""


def _setups_text() -> str:
    return "\n".join(f"- **{s.name}**: {s.what}." for s in SETUPS)


def rows(families: tuple[str, ...] = NATIVE + REMOTE) -> dict[tuple[str, str], str]:
    """Every cell of the installed transformers' column."""
    return {
        (f, s.name): cell(f, s)
        for f in families
        for s in SETUPS
        if s.families is None or f in s.families
    }


def column_key() -> str:
    import transformers

    major = transformers.__version__.split(".")[0]
    return f"transformers {'4.57' if major == '4' else '5.x'}"


COLUMNS = ("transformers 5.x", "transformers 4.57")


def render(cells: dict[str, dict[tuple[str, str], str]], versions: dict[str, str]) -> str:
    keys = sorted({k for col in cells.values() for k in col}, key=_order)
    head = " | ".join(f"{c} ({versions.get(c, 'not run')})" for c in COLUMNS)
    lines = [
        HEADER,
        "## Summary\n",
        *(_summary(c, cells.get(c, {})) for c in COLUMNS),
        "",
        "## Setups\n",
        _setups_text(),
        "",
        "## The matrix\n",
        f"| family | setup | {head} |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for family, setup in keys:
        vals = " | ".join(cells.get(c, {}).get((family, setup), "not run") for c in COLUMNS)
        lines.append(f"| {family} | {setup} | {vals} |")
    return "\n".join(lines) + "\n"


def _summary(column: str, cells: dict[tuple[str, str], str]) -> str:
    """One line per column, counted from its cells."""
    ran = [v for v in cells.values() if not v.startswith("n/a")]
    if not ran:
        return f"- {column}: not run."
    bare = [v.split(" → ")[0] for v in ran]
    failing = sum(1 for b in bare if b != "runs")
    still = sum(1 for v in ran if "**still" in v)
    watches = sum(1 for v in ran if v.endswith("watches (nothing to do)"))
    changed = sum(1 for b, v in zip(bare, ran, strict=True) if b == "runs" and "watches" not in v)
    return (
        f"- {column}: {len(ran)} runs; {failing} fail or lose precision without the guard, "
        f"{failing - still} of them rescued by it, {still} still failing; of the "
        f"{len(ran) - failing} that run without it, the guard only watches {watches} and "
        f"changes dtypes in {changed}."
    )


def _order(key: tuple[str, str]) -> tuple[int, int]:
    families = NATIVE + REMOTE
    names = [s.name for s in SETUPS]
    return (
        families.index(key[0]) if key[0] in families else len(families),
        names.index(key[1]) if key[1] in names else len(names),
    )


_ROW = re.compile(r"^\| ([^|]+) \| ([^|]+) \| (.*) \|$")


def parse(text: str) -> tuple[dict[str, dict[tuple[str, str], str]], dict[str, str]]:
    """The cells and versions of an existing docs/matrix.md (its columns by name)."""
    cells: dict[str, dict[tuple[str, str], str]] = {c: {} for c in COLUMNS}
    versions: dict[str, str] = {}
    head = re.search(r"^\| family \| setup \| (.*) \|$", text, flags=re.M)
    if head is None:
        return cells, versions
    names = []
    for h in head.group(1).split(" | "):
        m = re.match(r"(transformers [^ ]+) \((.*)\)$", h)
        names.append(m.group(1) if m else h)
        if m and m.group(2) != "not run":
            versions[m.group(1)] = m.group(2)
    for line in text.splitlines():
        m = _ROW.match(line)
        if not m or m.group(1) in ("family", "---"):
            continue
        vals = m.group(3).split(" | ")
        for name, val in zip(names, vals, strict=False):
            if name in cells and val != "not run":
                cells[name][(m.group(1), m.group(2))] = val
    return cells, versions


def generate(path: Path) -> tuple[str, str]:
    """(new text, old text) of ``path`` with the installed transformers' column run again."""
    import transformers

    old = path.read_text() if path.exists() else ""
    cells, versions = parse(old)
    key = column_key()
    cells[key] = rows()
    versions[key] = transformers.__version__
    return render(cells, versions), old


def stale(new: str, old: str) -> list[str]:
    """The cells of the installed transformers' column that differ between two documents."""
    key = column_key()
    fresh, kept = parse(new)[0][key], parse(old)[0][key]
    return [
        f"{family} / {setup}: {kept.get((family, setup))!r} -> now {fresh.get((family, setup))!r}"
        for family, setup in sorted(fresh.keys() | kept.keys(), key=_order)
        if fresh.get((family, setup)) != kept.get((family, setup))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_precision.tiny.matrix")
    parser.add_argument("--path", default="docs/matrix.md")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when this version's column is stale"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    new, old = generate(Path(args.path))
    took = time.perf_counter() - start
    if args.check:
        changed = stale(new, old)
        if changed:
            print(
                f"{args.path} is stale for {column_key()} in {len(changed)} cell(s):\n  "
                + "\n  ".join(changed)
                + "\nFix: PYTHONPATH=. python -m hf_precision.tiny.matrix (in this venv)",
                file=sys.stderr,
            )
            return 1
        print(f"{args.path}: {column_key()} is current ({took:.0f} s)")
        return 0
    Path(args.path).write_text(new)
    print(f"wrote {args.path} ({column_key()}, {took:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
