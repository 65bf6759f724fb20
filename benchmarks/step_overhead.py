"""Training-step overhead of the guards on CPU: boundary guards, and leaf guards everywhere.

One ~107M-parameter LLaVA-shaped model (6-layer CLIP ViT/16 + 6-layer Llama, 32k vocab) built
from config, trained in full (AdamW) on a batch of 2 rows of 49 image tokens + 32 text tokens.
The same model and optimizer take turns under three arms, rotated every repetition:

* ``none`` — no hook at all (the model, batch and policy agree, so nothing needs a cast);
* ``boundary`` — what ``PrecisionGuardCallback`` installs by default: the batch hook and one hook
  per group entry;
* ``leaf`` — ``leaf_guards="on"``: a hook on every module with its own weights as well.

Because every dtype already matches, the guarded arms pay exactly the per-call checks, which is
what a healthy run pays on every step.

>>> from benchmarks.step_overhead import run
>>> figures = run(quick=True)  # doctest: +SKIP
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from hf_precision import PrecisionPolicy, enforce_policy, install_guards, remove_guards
from hf_precision.engine.hooks import guard_targets, installed_guards

from .common import Figure, finished, interleave, param_count, ratio_figure
from .models import build, llava_100m_config, quick_llava_config, vlm_batch

FAMILY = "step"


def _guarded_calls(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], policy: PrecisionPolicy, report: Any
) -> int:
    """How many guard hooks fire in one forward under ``policy``."""
    remove_guards(model)
    install_guards(model, policy, report)
    fired = [0]

    def count(*_: Any) -> None:
        fired[0] += 1

    handles = [
        model.get_submodule(path).register_forward_pre_hook(count) for path in guard_targets(model)
    ]
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    remove_guards(model)
    return fired[0]


def _hook_cost(calls: int = 20000) -> float:
    """Seconds one guard adds to a module call whose input already matches (the common case):
    a small Linear called with and without its leaf guard, best of five."""
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(2, 16)
    policy = PrecisionPolicy.from_preset("fp32", leaf_guards="on")

    def loop() -> None:
        for _ in range(calls):
            lin(x)

    def best() -> float:
        out = []
        for _ in range(5):
            t0 = time.process_time()
            loop()
            out.append(time.process_time() - t0)
        return min(out)

    with torch.no_grad():
        plain = best()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a bare Linear has no groups: all leaves guarded
            install_guards(torch.nn.Sequential(lin), policy)
        guarded = best()
        remove_guards(lin)
    return max(0.0, (guarded - plain) / calls)


def run(quick: bool = False, reps: int | None = None) -> list[Figure]:
    start = time.perf_counter()
    config = quick_llava_config() if quick else llava_100m_config()
    model = build(config)
    model.train()
    batch = vlm_batch(config, batch_size=2, text_len=8 if quick else 32)
    boundary = PrecisionPolicy.from_preset("fp32")
    leaf = PrecisionPolicy.from_preset("fp32", leaf_guards="on")
    report = enforce_policy(model, boundary)
    if report.changes:  # the comparison is only fair when the guards have nothing to cast
        raise RuntimeError(f"benchmark model does not match its policy: {report.summary()}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)

    def step() -> None:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    counts: dict[str, int] = {}

    def guard(policy: PrecisionPolicy | None, arm: str) -> None:
        remove_guards(model)
        if policy is not None:
            install_guards(model, policy, report)
        counts[arm] = installed_guards(model)

    calls = {
        arm: _guarded_calls(model, batch, policy, report)
        for arm, policy in (("boundary", boundary), ("leaf", leaf))
    }
    per_call = _hook_cost()
    runs = interleave(
        {"none": step, "boundary": step, "leaf": step},
        setup={
            "none": lambda: guard(None, "none"),
            "boundary": lambda: guard(boundary, "boundary"),
            "leaf": lambda: guard(leaf, "leaf"),
        },
        reps=reps or (2 if quick else 7),
        warmup=1,
    )
    remove_guards(model)
    shape: dict[str, Any] = {
        "params_M": round(param_count(model) / 1e6, 1),
        "batch": f"{tuple(batch['input_ids'].shape)} tokens, pixel_values "
        f"{tuple(batch['pixel_values'].shape)}",
        "optimizer": "AdamW (foreach), full fine-tune, fp32",
    }
    none_s = runs.median("none")
    figures = [
        ratio_figure(
            f"step_{arm}",
            title,
            runs,
            arm,
            "none",
            target,
            hooks=counts[arm],
            hooked_calls_per_step=calls[arm],
            hook_cost_us=round(per_call * 1e6, 2),
            estimated_ratio=round(1 + calls[arm] * per_call / none_s, 5),
            **shape,
        )
        for arm, title, target in (
            ("boundary", "training step, boundary guards ÷ none (CPU, ~100M LLaVA)", 1.01),
            ("leaf", "training step, leaf guards everywhere ÷ none", 1.03),
        )
    ]
    return finished(figures, start, quick)
