"""What the silent-loss watchers cost a training step on CPU: the non-finite blame (off, ``auto``
while idle, armed) and the activation dtype trace.

The ~107M-parameter LLaVA-shaped model of :mod:`benchmarks.step_overhead`, trained in full in
fp32 (bf16 matmuls are slow on this CPU) with AdamW, the same model and optimizer under every
arm, rotated every repetition:

* ``none`` — no blame, no trace;
* ``blame_off`` — ``NonFiniteBlame(model, "off")`` and the logged loss handed to it each step;
* ``blame_auto`` — ``"auto"`` while idle (the default): no hook; each step's loss is checked
  (what the callback's ``on_log`` does at every logging step);
* ``blame_armed`` — armed (``"always"``): a forward hook on every module, a full backward hook
  on every module holding parameters, and the step's collection;
* ``trace`` — one step whose forward is recorded module by module (``DtypeTrace``), with its
  result built.

>>> from benchmarks.silent_cost import run
>>> figures = run(quick=True)  # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hf_precision.watch.blame import NonFiniteBlame
from hf_precision.watch.trace import DtypeTrace

from .common import Figure, finished, interleave, param_count, ratio_figure
from .models import build, llava_100m_config, quick_llava_config, vlm_batch

FAMILY = "silent"


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._backward_hooks) for m in model.modules())


def observe_cost(mode: str, calls: int = 20000) -> float:
    """Seconds one ``observe`` of a finite loss tensor costs an idle blame (what the idle arms
    add to a step), best of five."""
    blame = NonFiniteBlame(torch.nn.Linear(2, 2), mode)  # type: ignore[arg-type]
    logs = {"loss": torch.tensor(1.5)}
    out = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(calls):
            blame.observe(logs, step=0)
        out.append(time.process_time() - t0)
    return min(out) / calls


def run(quick: bool = False, reps: int | None = None) -> list[Figure]:
    start = time.perf_counter()
    config = quick_llava_config() if quick else llava_100m_config()
    model = build(config)
    model.train()
    batch = vlm_batch(config, batch_size=2, text_len=8 if quick else 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    state: dict[str, Any] = {"blame": None, "trace": None}
    hooks: dict[str, int] = {}

    def step() -> Any:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def blamed() -> None:
        loss = step()
        blame = state["blame"]
        blame.observe({"loss": loss}, step=0)
        if blame.armed:
            blame.collect(step=0)

    def traced() -> None:
        step()
        state["trace"].result()

    def setup(arm: str) -> None:
        if state["blame"] is not None:
            state["blame"].disarm()
        mode = {"blame_off": "off", "blame_auto": "auto", "blame_armed": "always"}.get(arm)
        state["blame"] = NonFiniteBlame(model, mode) if mode else None  # type: ignore[arg-type]
        state["trace"] = DtypeTrace(model) if arm == "trace" else None
        hooks[arm] = _hooks(model)

    arms = {"none": step, "blame_off": blamed, "blame_auto": blamed}
    arms.update({"blame_armed": blamed, "trace": traced})
    runs = interleave(
        arms,
        setup={arm: (lambda arm=arm: setup(arm)) for arm in arms},
        reps=reps or (2 if quick else 5),
        warmup=1,
    )
    setup("none")
    shape: dict[str, Any] = {
        "params_M": round(param_count(model) / 1e6, 1),
        "modules": sum(1 for _ in model.modules()),
        "optimizer": "AdamW (foreach), full fine-tune, fp32",
    }
    none_s = runs.median("none")
    per_call = {
        arm: observe_cost(mode) for arm, mode in (("blame_off", "off"), ("blame_auto", "auto"))
    }
    estimates = {
        arm: {"observe_cost_us": round(c * 1e6, 2), "estimated_ratio": round(1 + c / none_s, 6)}
        for arm, c in per_call.items()
    }
    figures = [
        ratio_figure(
            f"silent_{arm}",
            title,
            runs,
            arm,
            "none",
            target,
            hooks=hooks[arm],
            **estimates.get(arm, {}),
            **shape,
        )
        for arm, title, target in (
            ("blame_off", "training step, blame='off' ÷ no blame (CPU, ~100M LLaVA)", 1.01),
            ("blame_auto", "training step, blame='auto' idle (the default) ÷ no blame", 1.01),
            ("blame_armed", "training step, blame armed (every module hooked) ÷ no blame", None),
            ("trace", "training step with its forward traced ÷ no trace", None),
        )
    ]
    return finished(figures, start, quick)
