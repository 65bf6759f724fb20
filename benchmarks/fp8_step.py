"""The guard's cost on an fp8 training step, measured side by side in one run.

Two copies of one LLaVA-shaped model (same seed), each converted by torchao's
``convert_to_float8_training`` with the same filter
(``hf_precision.engine.fp8.converters.module_filter``: the vision side, projector and head stay
out). One is guarded (``PrecisionGuardPlugin.setup``: the fp8 check, the manifest, the
guards), the other is not; their steps take turns. Then the guard is taken off and the two are
timed again: two instances of one model differ by a few percent on their own (on this CPU an
unguarded pair read up to 1.035), so the figure is guard ÷ none over that floor
(``guard_over_floor``; ``ratio`` and ``instance_floor`` are beside it).

- CPU (default): emulated fp8 (``Float8LinearConfig(emulate=True)``), fp32 weights, full
  training; target guard_over_floor <= 1.01.
- GPU (``--gpu``): real fp8 kernels, bf16 frozen base + LoRA adapters (out of fp8 by the
  policy), ``torch.compile``; target <= 1.01, and the manifest must match the modules that ran
  (every ``Float8Linear`` in the model, no adapter among them).

    python -m benchmarks.fp8_step [--quick] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from typing import Any

import torch


def _models(gpu: bool, quick: bool) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from hf_precision.engine.fp8.converters import module_filter

    from .models import build, llava_100m_config, quick_llava_config, vlm_batch

    config = quick_llava_config() if quick or not gpu else llava_100m_config()
    device = "cuda" if gpu else "cpu"
    out = []
    for _ in range(2):
        model = build(config, device)
        if gpu:
            from peft import LoraConfig, get_peft_model

            model = model.to(torch.bfloat16)
            lm = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
            model = get_peft_model(model, LoraConfig(r=16, target_modules=lm))
        fp8 = Float8LinearConfig(emulate=not gpu)
        convert_to_float8_training(model, config=fp8, module_filter_fn=module_filter(model))
        out.append(model)
    # the backward's inner dimension (the batch's tokens) must be a multiple of 16 for
    # torch._scaled_mm (the shape gate refuses 2 x (49 + 32) = 162): the text is made long
    # enough for that, whatever the config's image tokens (2 x (49 + 39) = 176 on the GPU model)
    vc = config.vision_config
    image_tokens = (vc.image_size // vc.patch_size) ** 2
    text = next(t for t in range(32, 48) if 2 * (image_tokens + t) % 16 == 0)
    batch = vlm_batch(config, 2, text, device=device)
    if gpu:
        batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
    return out[0], out[1], batch


def _stepper(model: Any, batch: dict[str, torch.Tensor], compile_: bool) -> Any:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    forward = torch.compile(model) if compile_ else model

    def step() -> None:
        loss = forward(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    return step


def _timed(arms: dict[str, Any], reps: int) -> dict[str, list[float]]:
    """Each arm's step times, warmed (and compiled) first, the order alternated every rep."""
    for fn in arms.values():
        fn()
        fn()
    times: dict[str, list[float]] = {n: [] for n in arms}
    for rep in range(reps):
        for name in list(arms) if rep % 2 == 0 else list(arms)[::-1]:
            t0 = time.perf_counter()
            arms[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def run(quick: bool = False, gpu: bool = False, reps: int | None = None) -> dict[str, Any]:
    from hf_precision import PrecisionGuardPlugin
    from hf_precision.model import fp8

    warnings.simplefilter("ignore")
    guarded, bare, batch = _models(gpu, quick)
    plugin = PrecisionGuardPlugin("bf16" if gpu else "fp32", report=False)
    plugin.setup(guarded)
    arms = {"guard": _stepper(guarded, batch, gpu), "none": _stepper(bare, batch, gpu)}
    reps = reps or (4 if quick else 15 if gpu else 60)
    times = _timed(arms, reps)
    ratio = statistics.median(times["guard"]) / statistics.median(times["none"])
    man = fp8.manifest(guarded.named_modules())
    ran = sorted(n for n, m in guarded.named_modules() if type(m).__name__ == "Float8Linear")
    section = plugin.guards[0].sections.get("fp8", {})
    # the floor: the same two instances with the guard taken off (two model instances differ
    # by a few percent on their own: memory layout; on CPU the floor read up to 1.035)
    plugin.remove()
    floor_times = _timed(arms, reps)
    floor = statistics.median(floor_times["guard"]) / statistics.median(floor_times["none"])
    return {
        "device": "cuda" if gpu else "cpu",
        "ratio": round(ratio, 4),
        "instance_floor": round(floor, 4),
        "guard_over_floor": round(ratio / floor, 4),
        "target": 1.01,
        "ok": ratio / floor <= 1.01,
        "step_s": {n: round(statistics.median(t), 5) for n, t in times.items()},
        "manifest": man.lines(),
        "manifest_matches": sorted(man.modules) == ran and section.get("lines") == man.lines(),
        "adapters_in_fp8": [n for n in ran if ".lora_" in n],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args(argv)
    out = run(quick=args.quick, gpu=args.gpu)
    print(json.dumps(out, indent=2))
    return 0 if out["manifest_matches"] and not out["adapters_in_fp8"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
