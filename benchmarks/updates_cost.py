"""What the silent-loss checks cost on CPU: the lost-update sample, the memory account and the
provenance record.

The ~107M-parameter LLaVA-shaped model of ``step_overhead`` (fp32, full AdamW fine-tune; timed in
fp32 because bf16 matmuls are slow on CPUs without bf16 units: the sample's cost does not depend
on the weights' dtype, only on the number of trainable tensors). Arms, rotated every repetition:

* ``none`` — a plain training step;
* ``watching`` — the step while the lost-update check watches it (its step pre/post hooks: a
  fixed sample of at most 4096 elements per trainable tensor copied before and compared after);
  this is paid on the first 3 optimizer steps of a run only;
* ``after`` — the step once the check is done (hooks removed; the same as
  ``lost_updates="off"``): target ≤ 1.01.

The memory account and the provenance record run once per guard event, not per step: their
figure is seconds per event on the same model.

>>> from benchmarks.updates_cost import run
>>> figures = run(quick=True)  # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hf_precision import PrecisionPolicy, enforce_policy
from hf_precision.engine.memory_account import memory_account
from hf_precision.watch.lost_updates import LostUpdateCheck
from hf_precision.watch.provenance import precision_provenance

from .common import Figure, finished, interleave, param_count, ratio_figure
from .models import build, llava_100m_config, quick_llava_config, vlm_batch

FAMILY = "updates"


def _event_cost(model: torch.nn.Module, report: Any, reps: int) -> float:
    args = type("Args", (), {"bf16": False, "fp16": False, "mixed_precision": "no"})()
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        memory_account(report, model)
        precision_provenance(args, model, environ={})
        best = min(best, time.process_time() - t0)
    return best


def run(quick: bool = False, reps: int | None = None) -> list[Figure]:
    start = time.perf_counter()
    config = quick_llava_config() if quick else llava_100m_config()
    model = build(config)
    model.train()
    batch = vlm_batch(config, batch_size=2, text_len=8 if quick else 32)
    report = enforce_policy(model, PrecisionPolicy.from_preset("fp32"), mode="audit")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    checks: list[LostUpdateCheck] = []

    def step() -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def arm_watch() -> None:
        for c in checks:
            c.detach()
        checks[:] = [LostUpdateCheck(model.named_parameters(), steps=1).attach(optimizer)]

    def arm_plain() -> None:
        for c in checks:
            c.detach()

    runs = interleave(
        {"none": step, "watching": step, "after": step},
        setup={"none": arm_plain, "watching": arm_watch, "after": arm_plain},
        reps=reps or (2 if quick else 7),
        warmup=1,
    )
    arm_plain()
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    shape = {
        "params_M": round(param_count(model) / 1e6, 1),
        "trainable_tensors": tensors,
        "sample_per_tensor": 4096,
        "optimizer": "AdamW (foreach), full fine-tune, fp32",
    }
    figures = [
        ratio_figure(
            "updates_watching",
            "step while the lost-update check samples ÷ none (first 3 steps only)",
            runs,
            "watching",
            "none",
            None,
            **shape,
        ),
        ratio_figure(
            "updates_off",
            "step after the check / lost_updates='off' ÷ none",
            runs,
            "after",
            "none",
            1.01,
            **shape,
        ),
        Figure(
            "updates_event_cost",
            "memory account + provenance, per guard event",
            round(_event_cost(model, report, 3 if quick else 7), 5),
            None,
            unit="s",
            detail=shape,
        ),
    ]
    return finished(figures, start, quick)
