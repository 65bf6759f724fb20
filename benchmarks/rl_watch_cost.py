"""What the RL watchers cost on CPU: one gap attribution and one sync-integrity check.

The ~107M-parameter LLaVA-shaped model of ``step_overhead`` (fp32 weights, a full fine-tune,
the trainer's numerics bf16 autocast). Figures:

* ``rl_attribution`` — seconds of one :func:`~hf_precision.watch.rl_attribution.attribute_gap`
  on a GRPO-sized batch (2 sequences, the image's tokens + 32 text tokens, the last 16 scored):
  the sampler and trainer passes plus one pass per group switched (lm_head, norms,
  vision_encoder, projector here), all under ``torch.no_grad``; its detail gives the ratio to
  one training step (forward, backward, AdamW) of the same batch. It runs once per run (the
  first batch whose gap passes the threshold), never per step;
* ``rl_sync_check`` — seconds of one sync-integrity check (the sample of every frozen tensor
  taken before and compared after a sync or a generation; 64 elements per tensor), with all
  weights frozen (the most it samples), and its ratio to the training step.

>>> from benchmarks.rl_watch_cost import run
>>> figures = run(quick=True)  # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hf_precision.engine.sync_integrity import SyncIntegrity
from hf_precision.watch.rl_attribution import attribute_gap, token_log_probs

from .common import Figure, finished, param_count
from .models import build, llava_100m_config, quick_llava_config, vlm_batch

FAMILY = "rl_watch"


def _best(fn: Any, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(quick: bool = False, reps: int | None = None) -> list[Figure]:
    start = time.perf_counter()
    reps = reps or (1 if quick else 3)
    config = quick_llava_config() if quick else llava_100m_config()
    model = build(config).train()
    batch = vlm_batch(config, batch_size=2, text_len=8 if quick else 32)
    labels = batch.pop("labels", None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    keep = 4 if quick else 16

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm up
    step_s = _best(step, reps)
    found: list[Any] = []
    attribution_s = _best(
        lambda: found.append(attribute_gap(model, batch, keep=keep, score=token_log_probs)), reps
    )
    model.requires_grad_(False)
    sync = SyncIntegrity(model)
    check_s = _best(lambda: sync.check("sync", sync.take(), sync._held()), reps)
    shape = {
        "params_M": round(param_count(model) / 1e6, 1),
        "step_s": round(step_s, 4),
        "scored_tokens": 2 * keep,
        "groups_switched": found[-1].modules if found else {},
        "frozen_tensors": len(sync.frozen),
    }
    figures = [
        Figure(
            "rl_attribution",
            "one gap attribution (sampler + trainer + one pass per group), once per run",
            round(attribution_s, 4),
            None,
            unit="s",
            detail={**shape, "ratio_to_step": round(attribution_s / step_s, 2)},
        ),
        Figure(
            "rl_sync_check",
            "one sync-integrity check (sample before + compare after), per sync/generation",
            round(check_s, 5),
            None,
            unit="s",
            detail={**shape, "ratio_to_step": round(check_s / step_s, 4)},
        ),
    ]
    return finished(figures, start, quick)
