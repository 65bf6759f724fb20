"""What the RL contract checks cost on CPU: a real ``trl.GRPOTrainer`` step (generation, rewards,
loss, backward) on a text LLaMA of ~20M parameters, timed in fp32 (``bf16=False``: bf16 matmuls
are slow on CPUs without bf16 units; the watch's cost is one re-score forward while it measures,
whatever the dtype). Arms, rotated every repetition:

* ``none`` — the step with no watch (``PrecisionGuardCallback(rl="off")``);
* ``watching`` — the step while :class:`~hf_precision.integrations.trl_rl.RLWatch` measures it
  (``generate`` asked for its logits, the completions re-scored by TRL's own scoring); paid on
  the first 2 generations of a run only;
* ``idle`` — the step once the watch is done (its wrappers taken off): target ≤ 1.01.

>>> from benchmarks.rl_cost import run
>>> figures = run(quick=True)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import tempfile
import time
import warnings
from typing import Any

from .common import Figure, finished, interleave, param_count, ratio_figure

FAMILY = "rl"


def _trainer(quick: bool, out: str) -> Any:
    from hf_precision.tiny.rl import rl_llama, text_prompts, tiny_grpo

    size = 32 if quick else 384
    model, tok = rl_llama(
        None,  # fp32
        hidden_size=size,
        intermediate_size=4 * size,
        num_hidden_layers=2 if quick else 8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    return tiny_grpo(
        out,
        model,
        train_dataset=text_prompts(8),
        processing_class=tok,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4 if quick else 16,
        max_steps=-1,
    )


def run(quick: bool = False, reps: int | None = None) -> list[Figure]:
    from hf_precision.integrations.trl_rl import RLWatch

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(quick, out)
        rows = [{"prompt": p} for p in ["a red square"] * 4]
        trainer.current_gradient_accumulation_steps = 1  # set by train() otherwise
        watches: list[RLWatch] = []

        def step() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                batch = trainer._generate_and_score_completions(rows)
                trainer.compute_loss(trainer.model, batch).backward()
            trainer.model.zero_grad(set_to_none=True)

        def arm(kind: str) -> None:
            for w in watches:
                w.detach()
            watches.clear()
            if kind == "watching":  # measures every call
                watches.append(RLWatch(trainer, steps=10**9).attach())
            elif kind == "idle":  # attached, then done: its wrappers come off
                w = RLWatch(trainer, steps=1).attach()
                w.finish()
                watches.append(w)

        runs = interleave(
            {"none": step, "watching": step, "idle": step},
            setup={k: functools.partial(arm, k) for k in ("none", "watching", "idle")},
            reps=reps or (2 if quick else 7),
            warmup=1,
        )
        arm("none")
        shape = {
            "params_M": round(param_count(trainer.model) / 1e6, 1),
            "completions": 4,
            "tokens": trainer.args.max_completion_length,
            "trainer": "trl.GRPOTrainer, use_vllm=False, fp32",
        }
    figures = [
        ratio_figure(
            "rl_watching",
            "GRPO step while the RL watch measures ÷ none (first 2 generations only)",
            runs,
            "watching",
            "none",
            None,
            **shape,
        ),
        ratio_figure(
            "rl_idle",
            "GRPO step once the RL watch is done / rl='off' ÷ none",
            runs,
            "idle",
            "none",
            1.01,
            **shape,
        ),
    ]
    return finished(figures, start, quick)
