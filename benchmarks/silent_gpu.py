"""The blame on a GPU (``python benchmarks/silent_gpu.py [OUT.json]`` on a CUDA machine):

1. a real fp16 overflow under ``Trainer(fp16=True)`` (autocast + GradScaler): the tiny LLaMA of
   ``tests/watch/test_blame.py``, every weight trained in fp32, layer 1's MLP made to pass 65504 in
   float16; the one-line callback must name ``model.layers.1.mlp.down_proj``;
2. the step cost on the GPU of the ~107M LLaVA-shaped model of ``benchmarks/step_overhead.py``
   (fp32 weights, bf16 autocast, AdamW): no blame, ``auto`` idle, armed; wall clock after
   ``torch.cuda.synchronize()``, arms rotated, median of per-round ratios.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_precision.watch.blame import NonFiniteBlame  # noqa: E402


def overflow_on_gpu() -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    from hf_precision import PrecisionGuardCallback
    from hf_precision.tiny import tiny_text_llama

    model = tiny_text_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(1000)
        model.model.layers[1].mlp.down_proj.weight.mul_(1e5)
    ids = torch.randint(4, 200, (4, 8), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i} for i in ids]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=4,
        per_device_train_batch_size=2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        fp16=True,
    )
    guard = PrecisionGuardCallback()
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[guard])
    trainer.train()
    found = [f.to_dict() for f in guard.blame.findings]
    return {"log": trainer.state.log_history[:3], "findings": found}


def step_cost(rounds: int = 15) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from benchmarks.models import build, llava_100m_config, vlm_batch

    config = llava_100m_config()
    model = build(config, device="cuda")
    model.train()
    batch = {k: v.cuda() for k, v in vlm_batch(config, batch_size=8, text_len=256).items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    blames: dict[str, Any] = {}

    def step(arm: str) -> float:
        blame = blames.get(arm)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logged = loss.item()  # what a loop logging every step reads anyway
        if blame is not None:
            blame.observe({"loss": logged}, step=0)
            if blame.armed:
                blame.collect(step=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    arms = ["none", "auto", "armed"]
    for arm in arms:
        if arm != "none":
            blames[arm] = None
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds + 3):
        order = arms[r % 3 :] + arms[: r % 3]
        for arm in order:
            for b in blames.values():
                if b is not None:
                    b.disarm()
            blames.clear()
            if arm == "auto":
                blames[arm] = NonFiniteBlame(model, "auto")
            elif arm == "armed":
                blames[arm] = NonFiniteBlame(model, "always")
            t = step(arm)
            if r >= 3:
                times[arm].append(t)
    ratios = {
        a: statistics.median(x / y for x, y in zip(times[a], times["none"])) for a in arms[1:]
    }
    return {
        "device": torch.cuda.get_device_name(),
        "step_s_none": statistics.median(times["none"]),
        "ratio_auto_idle": ratios["auto"],
        "ratio_armed": ratios["armed"],
        "modules": sum(1 for _ in model.modules()),
    }


if __name__ == "__main__":
    out = {"overflow": overflow_on_gpu()}
    print(json.dumps(out, indent=1, default=str), flush=True)
    out["cost"] = step_cost()
    print(json.dumps(out["cost"], indent=1), flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1, default=str))
