"""Training-step overhead of the launcher in a plain accelerate loop (diffusers' scripts).

The tiny ``UNet2DConditionModel`` of :mod:`hf_precision.tiny.diffusion` (~20k parameters, 8×8
latents) trained in full with AdamW in fp32, the loop of diffusers' ``train_text_to_image.py``
(noise, timesteps, UNet, MSE, ``accelerator.backward``, step). Two copies of the model, with the
same weights, take turns in one process, rotated every repetition:

* ``plain`` — ``accelerator.prepare`` unwrapped (what the script does without the launcher);
* ``launched`` — prepared through the launcher's wrapped ``Accelerator.prepare``
  (``HF_PRECISION_GUARD=auto``): the plugin's batch and boundary guards on the UNet and its
  dtype check before every optimizer step.

The tiny UNet's step is a few milliseconds, so the per-step costs of the guard (hooks, the step
pre-hook) weigh far more here than on a real UNet: an upper bound.

>>> from benchmarks.launcher_step import run
>>> figures = run(quick=True)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
import torch.nn.functional as F

from .common import Figure, finished, interleave, param_count, ratio_figure

FAMILY = "launcher"


def _loop(accelerator: Any, unet: Any, batch: int) -> Any:
    unet.requires_grad_(True)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-6)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(batch, 4, 8, 8, generator=g)
    states = torch.randn(batch, 8, 16, generator=g)

    def step() -> None:
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (batch,))
        pred = unet(latents + noise, t, encoder_hidden_states=states).sample
        accelerator.backward(F.mse_loss(pred.float(), noise.float()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def run(quick: bool = False, reps: int | None = None) -> list[Figure]:
    from accelerate import Accelerator

    from hf_precision.integrations import accelerate_hook
    from hf_precision.tiny.diffusion import tiny_unet

    start = time.perf_counter()
    old = os.environ.get("HF_PRECISION_GUARD")
    os.environ["HF_PRECISION_GUARD"] = "auto"
    patched = accelerate_hook.patch_accelerator(Accelerator)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="no")
        unet = tiny_unet().train()
        copy_ = copy.deepcopy(unet)
        plugin = accelerate_hook.plugin_for(accelerator)
        plugin.report = False  # files are written at events, not per step: keep none here
        launched = _loop(accelerator, unet, 2)
        accelerate_hook.unpatch_accelerator(Accelerator)
        plain = _loop(accelerator, copy_, 2)
        runs = interleave(
            {"plain": plain, "launched": launched}, reps=reps or (2 if quick else 15), warmup=2
        )
    finally:
        if patched:
            accelerate_hook.unpatch_accelerator(Accelerator)
        if old is None:
            os.environ.pop("HF_PRECISION_GUARD", None)
        else:
            os.environ["HF_PRECISION_GUARD"] = old
    fig = ratio_figure(
        "launcher_step_unet",
        "training step under hf-precision run ÷ plain (accelerate loop, tiny UNet, fp32)",
        runs,
        "launched",
        "plain",
        1.05,
        params_k=round(param_count(unet) / 1e3, 1),
        optimizer="AdamW, full fine-tune, fp32, batch 2 of 4×8×8 latents",
        optimizer_checks=plugin.steps,
    )
    return finished([fig], start, quick)
