"""The fp16 range check's cost and the headroom probe's (``python -m benchmarks --only fp16``;
on a CUDA machine ``python benchmarks/fp16_range.py [OUT.json]`` times the same on the GPU).

1. ``fp16_step_guard``: a training step (forward + backward) of a LLaVA held in float16
   (``fp16-true``), its fp32 ``pixel_values`` cast by the batch guard, whose range check runs at
   every step, ÷ the same step with the batch cast by hand and no guard; arms side by side in
   one run. The check runs on the device and is read at a site's first cast and every 64th
   (``hf_precision/engine/range_check.py``): no host read per step. On a GPU this is the figure
   that a sync per cast would blow up (wall clock there, after ``torch.cuda.synchronize()``).
2. ``headroom_probe``: :func:`~hf_precision.watch.headroom.probe_headroom` (one float32
   forward with a recording hook on every module, read once) ÷ one plain no-grad forward of the
   same float32 model.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import Figure, finished, interleave, param_count, ratio_figure  # noqa: E402
from benchmarks.models import build, llava_100m_config, quick_llava_config, vlm_batch  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fp16_step(quick: bool, reps: int | None, device: str) -> Figure:
    from hf_precision import enforce_policy, install_guards, remove_guards

    config = quick_llava_config() if quick or device == "cpu" else llava_100m_config()
    model = build(config, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = enforce_policy(model, "fp16-true")
    model.train()
    batch = vlm_batch(config, batch_size=2 if device == "cpu" else 8, text_len=16, device=device)
    by_hand = {**batch, "pixel_values": batch["pixel_values"].half()}

    def step(inputs: dict[str, torch.Tensor]) -> None:
        model(**inputs).loss.backward()
        model.zero_grad(set_to_none=True)
        _sync(device)

    runs = interleave(
        {"none": lambda: step(by_hand), "guard": lambda: step(batch)},
        setup={
            "none": lambda: remove_guards(model),
            "guard": lambda: install_guards(model, "fp16-true", report),
        },
        reps=reps or (2 if quick else 9),
        warmup=1,
    )
    remove_guards(model)
    clock = "wall" if device.startswith("cuda") else "cpu"
    return ratio_figure(
        "fp16_step_guard",
        f"fp16-true training step, guard (batch cast + range check) ÷ none ({device})",
        runs,
        "guard",
        "none",
        1.02 if device.startswith("cuda") else None,  # CPU: a 0.3M model, hooks vs ~20 ms
        clock=clock,
        params_M=round(param_count(model) / 1e6, 1),
        device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
    )


def probe_cost(quick: bool, reps: int | None, device: str) -> Figure:
    from hf_precision.watch.headroom import probe_headroom

    config = quick_llava_config() if quick else llava_100m_config()
    model = build(config, device=device).eval()
    batch = vlm_batch(config, batch_size=2, text_len=16, device=device)

    def forward() -> None:
        with torch.no_grad():
            model(**batch)
        _sync(device)

    result: list[Any] = []
    runs = interleave(
        {"forward": forward, "probe": lambda: result.append(probe_headroom(model, batch))},
        reps=reps or (2 if quick else 5),
        warmup=1,
    )
    return ratio_figure(
        "headroom_probe",
        "headroom probe (float32 forward + a hook per module) ÷ one forward",
        runs,
        "probe",
        "forward",
        None,
        clock="wall" if device.startswith("cuda") else "cpu",
        modules=len(result[-1].modules),
        params_M=round(param_count(model) / 1e6, 1),
    )


def run(quick: bool = False, reps: int | None = None, device: str = "cpu") -> list[Figure]:
    start = time.perf_counter()
    figures = [fp16_step(quick, reps, device), probe_cost(quick, reps, device)]
    return finished(figures, start, quick)


if __name__ == "__main__":
    where = "cuda" if torch.cuda.is_available() else "cpu"
    out = [f.to_dict() for f in run(device=where)]
    print(json.dumps(out, indent=1, default=str), flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1, default=str))
