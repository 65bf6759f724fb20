"""What the fp8 shape gate costs on CPU (``hf_precision.engine.fp8.shapes``).

A LLaMA-shaped text model (fp32, 4 layers, hidden 256) whose Linears (the LM head aside) are
torchao ``Float8Linear`` with ``emulate=True`` (what a CPU can run), full fine-tune with AdamW.
Arms, rotated every repetition:

* ``none`` — a plain emulated fp8 training step;
* ``gated`` — the same step with the gate's per-batch token check (one forward pre-hook per
  fp8 Linear: a token count read and one modulo): target ≤ 1.01. The hook alone is timed
  too (microseconds per call, times the fp8 Linears per step): on a shared CPU the step
  ratio's spread is wider than the hook's cost.

The per-layer check (dimensions against the recipe's rule, the FSDP shard count, the eligible
layers left out) runs once per guard event: its figure is seconds per event.

>>> from benchmarks.fp8_gate import run
>>> figures = run(quick=True)  # doctest: +SKIP
"""

from __future__ import annotations

import time

import torch

from hf_precision.engine.fp8.shapes import gate_shapes, remove_token_checks
from hf_precision.model.view import ModelView

from .common import Figure, finished, interleave, param_count, ratio_figure

FAMILY = "fp8_gate"


def _model(quick: bool) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hidden = 64 if quick else 256
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    model = LlamaForCausalLM(config)
    convert_to_float8_training(
        model,
        config=Float8LinearConfig(emulate=True),
        module_filter_fn=lambda mod, fqn: fqn != "lm_head",
    )
    return model.train()


def _hook_cost(model: torch.nn.Module, tokens: int, calls: int) -> float:
    """Seconds per call of the token check itself on one fp8 Linear (a passing count, grad
    on; the call's hook dispatch in ``nn.Module.__call__`` is not in it)."""
    gate_shapes(ModelView.of(model), "bench", "fix", lambda found: None)
    layer = next(m for m in model.modules() if type(m).__name__ == "Float8Linear")
    x = torch.randn(tokens, layer.in_features, requires_grad=True)
    hook = next(iter(layer._forward_pre_hooks.values()))
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(calls):
            hook(layer, (x,))
        best = min(best, (time.process_time() - t0) / calls)
    remove_token_checks(model)
    return best


def run(quick: bool = False, reps: int | None = None) -> list[Figure]:
    start = time.perf_counter()
    model = _model(quick)
    ids = torch.randint(0, 512, (2, 16 if quick else 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def arm_gated() -> None:
        gate_shapes(ModelView.of(model), "bench", "fix", lambda found: None)

    def arm_plain() -> None:
        remove_token_checks(model)

    runs = interleave(
        {"none": step, "gated": step},
        setup={"none": arm_plain, "gated": arm_gated},
        reps=reps or (2 if quick else 9),
        warmup=1,
    )
    arm_plain()
    best = float("inf")
    for _ in range(3 if quick else 7):
        t0 = time.process_time()
        arm_gated()
        best = min(best, time.process_time() - t0)
    arm_plain()
    per_call = _hook_cost(model, int(ids.numel()), 20 if quick else 20000)
    layers = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    shape = {
        "params_M": round(param_count(model) / 1e6, 1),
        "fp8_linears": layers,
        "tokens": int(ids.numel()),
        "recipe": "torchao tensorwise, emulate=True",
    }
    figures = [
        ratio_figure(
            "fp8_gate_step",
            "emulated fp8 step with the shape gate's token check ÷ none",
            runs,
            "gated",
            "none",
            1.01,
            **shape,
        ),
        Figure(
            "fp8_gate_hook",
            "token check per fp8 Linear call (the hook function alone)",
            round(per_call * 1e6, 2),
            None,
            unit="us",
            detail={**shape, "per_step_ms": round(per_call * layers * 1e3, 3)},
        ),
        Figure(
            "fp8_gate_event",
            "shape gate per guard event (dims, shards, eligible layers, hooks)",
            round(best, 5),
            None,
            unit="s",
            detail=shape,
        ),
    ]
    return finished(figures, start, quick)
