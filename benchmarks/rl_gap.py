"""The RL contract on a real ``trl.GRPOTrainer`` (``use_vllm=False``, a real reward function, the
tiny LLaVA): the gap of the first generations before and after "match", per setup.

Setups: ``lora`` (a bf16 base, adapters as after some training: ``init_lora_weights=False``) and
``full`` (an fp32 model, bf16 autocast). Arms: ``measure`` (``PrecisionGuardCallback(rl=
"measure")``: TRL's own numerics, the gap read) and ``match`` (``rl="match"``: ``generate``
under the trainer's autocast). Each run prints the contract table and its ``rl_gap`` record;
``--out`` writes them as JSON. Not a timing: one process, about a minute on a GPU, a few on a
CPU::

    PYTHONPATH=. python3 -m benchmarks.rl_gap --device cuda --steps 2 --out rl_gap.json

The lent GPU image has torch, transformers, peft and accelerate; carry the wheels of ``trl``
(1.16), ``datasets`` and its dependencies (``pyarrow``, ``dill``, ``multiprocess``, ``xxhash``,
``fsspec``, ``pandas``) and ``pillow`` when absent. ``docs/rl.md`` shows the CPU output.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import warnings
from typing import Any

import torch


def run_one(setup: str, rl: str, *, device: str, steps: int, tokens: int) -> dict[str, Any]:
    """One GRPO run of ``steps`` steps (one generation each); its contract and gap."""
    from peft import LoraConfig

    from hf_precision import PrecisionGuardCallback
    from hf_precision.tiny import tiny_llava
    from hf_precision.tiny.rl import image_prompts, tiny_grpo

    torch.manual_seed(0)
    model = tiny_llava(torch.bfloat16 if setup == "lora" else torch.float32)
    peft = LoraConfig(
        r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)", init_lora_weights=False
    )
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cb = PrecisionGuardCallback(rl=rl)
        trainer = tiny_grpo(
            out,
            model,
            callbacks=[cb],
            peft_config=peft if setup == "lora" else None,
            train_dataset=image_prompts(4),
            use_cpu=device == "cpu",
            per_device_train_batch_size=4,
            max_completion_length=tokens,
            max_steps=steps,
            seed=0,
        )
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    assert cb.guard is not None
    return {
        "setup": setup,
        "rl": rl,
        "device": device,
        "seconds": round(seconds, 2),
        "contract": cb.guard.sections.get("rl_contract"),
        "rl_gap": cb.guard.sections.get("rl_gap"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--setups", default="lora,full")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = []
    for setup in a.setups.split(","):
        for rl in ("measure", "match"):
            r = run_one(setup, rl, device=a.device, steps=a.steps, tokens=a.tokens)
            gap = {"mean_abs": float("nan"), "max_abs": float("nan"), "k3": float("nan")}
            gap.update(r["rl_gap"] or {})
            print(
                f"RESULT {setup:<5} {rl:<8} mean|δ| {gap['mean_abs']:.3g} "
                f"max|δ| {gap['max_abs']:.3g} k3 {gap['k3']:.3g} "
                f"masked {gap.get('corrected_share')} tokens {gap.get('tokens')} ({r['seconds']} s)"
            )
            results.append(r)
    versions = {}
    for name in ("torch", "transformers", "peft", "trl", "accelerate"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"versions": versions, "runs": results}, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
