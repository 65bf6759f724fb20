"""Endurance: 1000 training steps with 100 evaluations through a real ``Trainer`` carrying
``PrecisionGuardCallback``, on a tiny LLaVA whose groups mix dtypes (so every step casts).

Checked over the run: the number of installed guards never changes, no hf-precision object
accumulates (instances by type, traced allocations in hf-precision files), resident memory and
Python objects stay flat after warm-up, and no warning repeats.
"""

from __future__ import annotations

import gc
import os
import time
import tracemalloc
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from transformers import Trainer, TrainerCallback

from hf_precision import PrecisionGuardCallback, PrecisionWarning
from hf_precision.engine.hooks import guard_targets, installed_guards
from hf_precision.tiny import tiny_batch, tiny_llava

STEPS, EVAL_EVERY, WARMUP = int(os.environ.get("SOAK_STEPS", 1000)), 10, 200
#: hf-precision's own bookkeeping: the callback's event list (an entry per event, 160 events
#: after warm-up, ~8 kB); a hook, handle or dtype map leaked per event or step is far larger.
HF_PRECISION_GROWTH_LIMIT = 64 * 1024
#: Everything Python allocated (Trainer's log history included) after warm-up.
PYTHON_GROWTH_LIMIT = 4 * 2**20
#: Resident memory after warm-up: allocator noise only.
RSS_GROWTH_LIMIT = 48 * 2**20
#: gc-tracked objects after warm-up (Trainer log history grows by a dict per log/eval).
OBJECT_GROWTH_LIMIT = 5000


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hf_precision_objects() -> Counter[str]:
    """Live instances of hf-precision's classes, by class name."""
    out: Counter[str] = Counter()
    for o in gc.get_objects():
        module = type(o).__dict__.get("__module__")
        if isinstance(module, str) and module.startswith("hf_precision"):
            out[type(o).__qualname__] += 1
    return out


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) for m in model.modules())


class Probe(TrainerCallback):
    """Samples the guard and memory state at warm-up end, after every evaluation and at the end."""

    def __init__(self) -> None:
        self.guards: list[int] = []
        self.hooks: list[int] = []
        self.targets: list[Any] = []  # distinct guard layouts seen (one expected)
        self.evaluations = 0
        self.samples: dict[str, dict[str, Any]] = {}

    def sample(self, name: str, model: torch.nn.Module) -> None:
        gc.collect()
        traced = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, "*hf_precision*")]
        )
        self.samples[name] = {
            "rss": _rss(),
            "objects": len(gc.get_objects()),
            "hf_objects": _hf_precision_objects(),
            "python": tracemalloc.get_traced_memory()[0],
            "hf_traced": sum(s.size for s in traced.statistics("filename")),
            "snapshot": traced,
        }

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == WARMUP:  # traced from here on: tracing doubles Python's cost
            tracemalloc.start()
            self.sample("warm", kwargs["model"])

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        self.evaluations += 1
        self.guards.append(installed_guards(model))
        self.hooks.append(_hooks(model))
        targets = dict(guard_targets(model))
        if targets not in self.targets:
            self.targets.append(targets)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.sample("end", kwargs["model"])


class Rows(torch.utils.data.Dataset):
    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        n = batch["input_ids"].shape[0]
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def _mixed_model() -> Any:
    """Vision tower and the first LM layer frozen (bf16 under the policy), the rest trained in
    fp32: the batch, boundary and leaf guards all have casts to make on every step."""
    model = tiny_llava()
    model.model.vision_tower.requires_grad_(False)
    model.model.language_model.embed_tokens.requires_grad_(False)
    model.model.language_model.layers[0].requires_grad_(False)
    return model


@pytest.mark.slow
def test_soak_1000_steps_100_evaluations(tiny_args: Any) -> None:
    model = _mixed_model()
    # Reports off: writing a dtype map per event costs ~0.15 s, 30 s for 200 events (the
    # reporter has its own tests); everything else runs as in a real fine-tune.
    guard = PrecisionGuardCallback(report=False)
    probe = Probe()
    args = tiny_args(
        bf16=True,
        max_steps=STEPS,
        eval_strategy="steps",
        eval_steps=EVAL_EVERY,
        logging_steps=50,
        per_device_train_batch_size=1,
        learning_rate=1e-4,
    )
    data = Rows(tiny_batch(model, batch_size=2))  # one eval batch per evaluation
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = Trainer(
                model=model,
                args=args,
                train_dataset=data,
                eval_dataset=data,
                callbacks=[guard, probe],
            )
            installed = installed_guards(model)
            trainer.train()
    finally:
        tracemalloc.stop()
    elapsed = time.perf_counter() - start

    # The run did what it says, with the guard active and casting.
    assert trainer.state.global_step == STEPS
    assert probe.evaluations == STEPS // EVAL_EVERY
    assert guard.last_report is not None and guard.last_report.mixed_groups, "leaf guards expected"
    kinds = Counter(kind for kind, _ in probe.targets[-1].values())
    assert kinds["batch"] == 1 and kinds["boundary"] >= 4 and kinds["leaf"] > 0, kinds
    assert {p.dtype for p in model.model.vision_tower.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS // 50 and all(torch.isfinite(torch.tensor(losses)))

    # Hooks: the same guards after every one of the 100 evaluations (installs are idempotent).
    assert set(probe.guards) == {installed}, Counter(probe.guards)
    assert len(set(probe.hooks)) == 1, Counter(probe.hooks)
    assert len(probe.targets) == 1, probe.targets

    # Memory: flat after warm-up.
    warm, end = probe.samples["warm"], probe.samples["end"]
    hf_objects = end["hf_objects"] - warm["hf_objects"]
    assert not hf_objects, f"hf-precision objects accumulated: {dict(hf_objects)}"
    hf_growth = end["hf_traced"] - warm["hf_traced"]
    top = end["snapshot"].compare_to(warm["snapshot"], "lineno")[:5]
    assert hf_growth < HF_PRECISION_GROWTH_LIMIT, "\n".join(map(str, top))
    assert end["python"] - warm["python"] < PYTHON_GROWTH_LIMIT
    assert end["objects"] - warm["objects"] < OBJECT_GROWTH_LIMIT
    assert end["rss"] - warm["rss"] < RSS_GROWTH_LIMIT

    # Warnings: the model matched its policy all along, and nothing repeats.
    ours = [w for w in caught if issubclass(w.category, PrecisionWarning)]
    assert not ours, [str(w.message) for w in ours]
    repeated = {m: n for m, n in Counter(str(w.message) for w in caught).items() if n > 1}
    assert not repeated, repeated
    print("\n".join(map(str, top)))
    print(
        f"\nsoak: {STEPS} steps, {probe.evaluations} evaluations in {elapsed:.1f} s; "
        f"{installed} guards; hf-precision traced growth {hf_growth} B; python growth "
        f"{end['python'] - warm['python']} B; objects {end['objects'] - warm['objects']:+d}; "
        f"rss {(end['rss'] - warm['rss']) / 2**20:+.1f} MiB"
    )
