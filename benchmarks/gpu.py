"""GPU: a bf16 LoRA training step with the guard ÷ without, on a ~1B-parameter VLM shape.

The model is LLaVA-shaped (CLIP ViT-L/14-336 + a 22-layer 1536-wide Llama, 0.96B parameters),
built from config directly on the GPU. LoRA (peft, r=16) on the language model's attention
projections; the ``bf16`` policy: frozen weights bf16, LoRA weights fp32, compute bf16 under
``torch.autocast`` — what ``Trainer(bf16=True)`` runs. Arms, rotated every repetition:

* ``none`` — no hook; the fp32 ``pixel_values`` are cast by autocast inside the patch conv;
* ``guard`` — ``install_guards`` as ``PrecisionGuardCallback`` does it (batch hook, boundary
  hooks; leaf hooks only in groups that mix dtypes, which LoRA adapters alone do not);
* ``leaf`` — ``leaf_guards="on"``: a hook on every module with weights (for reference: the
  issue's GPU target is the ``guard`` arm).

``guard_casts`` in the details counts the casts the guards make per step, by module.

Times are wall clock after ``torch.cuda.synchronize()`` (a GPU step is mostly waiting for the
device). Run it on a GPU machine, from the repository root::

    PYTHONPATH=. python3 -m benchmarks --gpu --out gpu_results.json
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from hf_precision import PrecisionPolicy, enforce_policy, install_guards, remove_guards
from hf_precision.engine.hooks import installed_guards
from hf_precision.rules.dtypes import dtype_name

from .common import Figure, finished, interleave, param_count, ratio_figure
from .models import build, quick_llava_config, vlm_1b_config, vlm_batch

FAMILY = "gpu"
LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"


def lora_model(config: Any, device: str) -> tuple[Any, Any]:
    """The model with LoRA adapters, cast by ``enforce_policy`` to the ``bf16`` policy."""
    from peft import LoraConfig, get_peft_model

    model = build(config, device)
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    )
    report = enforce_policy(model, PrecisionPolicy.from_preset("bf16"))
    return model, report


def count_casts(fn: Callable[[], None]) -> Counter[str]:
    """The casts the guards make while ``fn`` runs, as ``"where: src -> dst"`` counts (every
    cast goes through ``cast_tensor``, which the hooks and ``cast_batch`` look up at call time)."""
    casts: Counter[str] = Counter()
    modules = [sys.modules["hf_precision.engine.hooks"], sys.modules["hf_precision.engine.batch"]]
    original = modules[1].cast_tensor

    def counting(t: torch.Tensor, dtype: torch.dtype, *args: Any, **kwargs: Any) -> torch.Tensor:
        if t.is_floating_point() and t.dtype != dtype:
            where = re.sub(r"\.\d+\.", ".N.", str(kwargs.get("where", "")))
            casts[f"{where}: {dtype_name(t.dtype)} -> {dtype_name(dtype)}"] += 1
        return original(t, dtype, *args, **kwargs)

    for module in modules:
        module.cast_tensor = counting  # type: ignore[attr-defined]
    try:
        fn()
    finally:
        for module in modules:
            module.cast_tensor = original  # type: ignore[attr-defined]
    return casts


def run(quick: bool = False, reps: int | None = None, device: str | None = None) -> list[Figure]:
    """The GPU figures; ``quick=True`` exercises the same code on a tiny model (CPU allowed)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        return [
            Figure(
                "gpu_lora_guard",
                "GPU bf16 LoRA step, guard ÷ none",
                None,
                1.01,
                note="skipped: no CUDA device",
            )
        ]
    if device == "cpu" and not quick:
        return [
            Figure(
                "gpu_lora_guard",
                "GPU bf16 LoRA step, guard ÷ none",
                None,
                1.01,
                note="skipped: no CUDA device (run `python -m benchmarks --gpu` there)",
            )
        ]
    start = time.perf_counter()
    config = quick_llava_config() if quick else vlm_1b_config()
    model, report = lora_model(config, device)
    model.train()
    batch = vlm_batch(
        config, batch_size=2 if quick else 8, text_len=8 if quick else 256, device=device
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    if {p.dtype for p in trainable} != {torch.float32}:
        raise RuntimeError("LoRA weights should stay fp32 under the 'bf16' policy")
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    device_type = torch.device(device).type
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    losses: list[float] = []

    def step() -> None:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        losses.append(float(loss.detach()))

    guard = PrecisionPolicy.from_preset("bf16")
    leaf = PrecisionPolicy.from_preset("bf16", leaf_guards="on")
    counts: dict[str, int] = {}

    def arm(policy: PrecisionPolicy | None, name: str) -> None:
        remove_guards(model)
        if policy is not None:
            install_guards(model, policy, report)
        counts[name] = installed_guards(model)

    runs = interleave(
        {"none": step, "guard": step, "leaf": step},
        setup={
            "none": lambda: arm(None, "none"),
            "guard": lambda: arm(guard, "guard"),
            "leaf": lambda: arm(leaf, "leaf"),
        },
        # ~0.13 s a step on an H100; the first steps still tune kernels and grow the allocator
        reps=reps or (2 if quick else 40),
        warmup=5 if not quick else 1,
    )
    arm(guard, "guard")
    casts = count_casts(step)
    remove_guards(model)
    if not all(map(lambda v: v == v and abs(v) != float("inf"), losses)):
        raise RuntimeError(f"non-finite loss in the GPU benchmark: {losses}")
    detail: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device_type == "cuda" else device,
        "params_B": round(param_count(model) / 1e9, 3),
        "trainable_M": round(sum(p.numel() for p in trainable) / 1e6, 2),
        "tokens_per_step": int(batch["input_ids"].numel()),
        "mixed_groups": list(report.mixed_groups),
        "guard_casts_per_step": sum(casts.values()),
        "guard_casts": dict(casts.most_common(6)),
    }
    if device_type == "cuda":
        detail["peak_mem_GB"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    figures = [
        ratio_figure(
            "gpu_lora_guard",
            "GPU bf16 LoRA step, guard ÷ none (~1B VLM)",
            runs,
            "guard",
            "none",
            1.01,
            clock="wall",
            hooks=counts["guard"],
            **detail,
        ),
        ratio_figure(
            "gpu_lora_leaf",
            "GPU bf16 LoRA step, leaf guards everywhere ÷ none",
            runs,
            "leaf",
            "none",
            None,
            clock="wall",
            hooks=counts["leaf"],
        ),
    ]
    return finished(figures, start, quick)
