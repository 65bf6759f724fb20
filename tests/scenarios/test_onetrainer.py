"""Scenario (seed 004, OneTrainer): training and sampling with fp16 weights fail with dtype
mismatches between the UNet, the VAE and tensors the data pipeline makes.

Each test writes the training or sampling code once, runs it without the guard and records the
exact error, then adds the guard and runs the same code, unedited. fp16 ``conv2d``, ``linear``,
``group_norm`` and scaled-dot-product attention all have CPU kernels in torch 2.13, so every
failure reproduces with ``torch.float16`` on CPU (no bf16 stand-in). The seed's CUDA wordings and
the CPU ones recorded here:

1. UNet timestep-embedding Linear fed fp32 with fp16 weights (class A: fp32 latents; diffusers
   casts the embedding to ``sample.dtype``): ``mat1 and mat2 must have the same dtype, but got
   Float and Half`` (same text on CPU).
2. A conv in sampling: OneTrainer's inpainting sampler builds an fp32 erode ``nn.Conv2d`` (no
   bias) *on every call* and feeds it the mask in the train dtype, fp16 (class F: a module made
   after any guard was installed). CUDA says ``Input type (torch.cuda.HalfTensor) and weight
   type (torch.cuda.FloatTensor) should be the same`` (the seed's text), the CPU ``expected
   scalar type Half but found Float``; OneTrainer catches it and trains on with no samples. A
   guard installed on the models cannot reach it; the launcher scopes torch's global forward
   pre-hook to the sampler call (``hf_precision.integrations.onetrainer.reach_new_modules``).
   (fp16 latents into a VAE kept in fp32, class B, is a failure of its own, tested below too:
   ``Input type (c10::Half) and bias type (float) should be the same`` on CPU and CUDA.)
3. VAE decoder, fp32 latents (scheduler math) into the fp16 VAE (class A): ``Input type (float)
   and bias type (c10::Half) should be the same`` (``struct c10::Half`` in the seed: MSVC).
4. ``latent_mask`` made fp32 by GenerateImageLike and concatenated with fp16 latents (class A):
   the concatenation is fp32, so the UNet fails as in 1; in OneTrainer's own layout (the time
   embedding also built in fp32 inside ``forward``, class F) leaf guards are needed too.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("diffusers")
from diffusers import (
    DDPMScheduler,
    StableDiffusionPipeline,
)

from hf_precision import PrecisionCollator, PrecisionGuardPlugin, PrecisionPolicy
from hf_precision.frontends.diffusion import guard_diffusion
from hf_precision.tiny import OneTrainerTiny
from hf_precision.tiny.diffusion import (
    collate_onetrainer,
    onetrainer_examples,
    tiny_text_encoder,
    tiny_unet,
    tiny_vae,
)

ROOT = Path(__file__).resolve().parents[2]
HALF = torch.float16
MAT = "mat1 and mat2 must have the same dtype, but got Float and Half"
ERODE_CPU = "expected scalar type Half but found Float"
HALF_INTO_FP32 = r"Input type \(c10::Half\) and bias type \(float\) should be the same"
FP32_INTO_HALF = r"Input type \(float\) and bias type \(c10::Half\) should be the same"


@pytest.fixture
def accelerator() -> Iterator[object]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield Accelerator(cpu=True, mixed_precision="fp16")  # on CPU: no autocast, no scaler
    AcceleratorState._reset_state(True)


def test_1_unet_time_embedding_linear_fed_fp32(accelerator: object) -> None:
    from peft import LoraConfig

    unet = tiny_unet().to(HALF)  # weight dtype fp16
    unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]))
    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-3)
    batch = {
        "latents": torch.randn(2, 4, 8, 8),
        "noise": torch.randn(2, 4, 8, 8),  # cached fp32
        "timesteps": torch.tensor([10, 700]),
        "encoder_hidden_states": torch.randn(2, 5, 16, dtype=HALF),
    }

    def train_step(unet: nn.Module) -> torch.Tensor:
        pred = unet(batch["latents"], batch["timesteps"], batch["encoder_hidden_states"]).sample
        loss = F.mse_loss(pred.float(), batch["noise"].float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    with pytest.raises(RuntimeError, match=MAT):
        train_step(unet)
    guard = PrecisionGuardPlugin("fp16-vae32", report=False)
    unet, optimizer = guard.prepare(accelerator, unet, optimizer)
    loss = train_step(unet)
    assert bool(torch.isfinite(loss))
    lora = [p for n, p in unet.named_parameters() if "lora_" in n]
    assert lora and {p.dtype for p in lora} == {torch.float32}  # GradScaler-safe
    assert unet.conv_in.weight.dtype == HALF and guard.steps == 1


def _erode(mask: torch.Tensor) -> torch.Tensor:
    """OneTrainer's sampler step, as its code reads: a new fp32 conv per call."""
    kernel = nn.Conv2d(1, 1, kernel_size=5, bias=False, padding_mode="replicate", padding=2)
    kernel.weight.data = torch.ones(1, 1, 5, 5) / 25
    kernel.requires_grad_(False)
    return (kernel(mask) > 0.5).float()


def test_2_the_sampler_builds_an_fp32_erode_conv_per_call() -> None:
    from hf_precision.integrations.onetrainer import reach_new_modules

    unet, vae = tiny_unet().to(HALF), tiny_vae().to(HALF)
    guard = guard_diffusion({"unet": unet, "vae": vae}, "fp16")
    mask = (torch.rand(1, 16, 16) > 0.5).to(HALF)  # the mask in train_dtype, as OneTrainer
    with pytest.raises(RuntimeError, match=ERODE_CPU):
        _erode(mask)  # the models' guards cannot reach a module built after them
    known = {id(m): m for part in (unet, vae) for m in part.modules()}
    with reach_new_modules(known, set()):
        eroded = _erode(mask)
    assert eroded.dtype == torch.float32 and eroded.shape == (1, 16, 16)
    guard.remove()


def test_fp16_latents_into_a_vae_kept_in_fp32() -> None:
    vae = tiny_vae()  # kept in fp32, as OneTrainer's separate VAE dtype allows
    unet, text_encoder = tiny_unet().to(HALF), tiny_text_encoder().to(HALF)
    pipe: Any = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=None,
        unet=unet,
        scheduler=DDPMScheduler(num_train_timesteps=100, steps_offset=1, clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    prompt = text_encoder(torch.tensor([[0, 5, 6, 7, 1]]))[0]

    def sample() -> torch.Tensor:  # diffusers' own sampling code
        return pipe(
            prompt_embeds=prompt,
            num_inference_steps=2,
            guidance_scale=1.0,
            height=16,
            width=16,
            output_type="pt",
        ).images

    with pytest.raises(RuntimeError, match=HALF_INTO_FP32):
        sample()
    guard = guard_diffusion(pipe, "fp16-vae32")
    assert set(guard.reports) == {"unet", "vae", "text_encoder"}
    image = sample()
    assert image.shape == (1, 3, 16, 16) and bool(torch.isfinite(image).all())
    assert {p.dtype for p in vae.parameters()} == {torch.float32}


@pytest.mark.parametrize(("preset", "vae_dtype"), [("fp16", HALF), ("fp16-vae32", torch.float32)])
def test_3_vae_decoder_gets_fp32_latents(preset: str, vae_dtype: torch.dtype) -> None:
    vae = tiny_vae().to(HALF)  # weight dtype fp16 for the VAE too
    scheduler: Any = DDPMScheduler(num_train_timesteps=100)
    scheduler.set_timesteps(2)
    latents = torch.randn(1, 4, 8, 8)
    pred = torch.randn(1, 4, 8, 8, dtype=HALF)

    def decode_last_step() -> torch.Tensor:
        t = scheduler.timesteps[-1]
        latents_out = scheduler.step(pred, t, latents).prev_sample  # fp32 scheduler math
        return vae.decode(latents_out / 0.18215).sample

    with pytest.raises(RuntimeError, match=FP32_INTO_HALF):
        decode_last_step()
    guard_diffusion({"vae": vae}, preset)
    image = decode_last_step()
    assert image.dtype == vae_dtype and bool(torch.isfinite(image).all())


class MaskedUNet(nn.Module):
    """OneTrainer's layout: the model call concatenates latents and ``latent_mask``."""

    def __init__(self, unet: Any) -> None:
        super().__init__()
        self.unet = unet

    def forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        latent_mask: torch.Tensor,
    ) -> torch.Tensor:
        sample = torch.cat([latents, latent_mask], dim=1)
        return self.unet(sample, timesteps, encoder_hidden_states).sample


def test_4_fp32_latent_mask_concatenated_with_fp16_latents() -> None:
    model = MaskedUNet(tiny_unet(in_channels=5).to(HALF))
    latents = torch.randn(2, 4, 8, 8, dtype=HALF)  # cached in the weight dtype
    latent_mask = torch.ones(2, 1, 8, 8)  # GenerateImageLike: no dtype=, so fp32
    hidden = torch.randn(2, 5, 16, dtype=HALF)
    assert torch.cat([latents, latent_mask], 1).dtype == torch.float32  # the root cause

    def predict() -> torch.Tensor:
        return model(latents, torch.tensor([5, 50]), hidden, latent_mask)

    with pytest.raises(RuntimeError, match=MAT):  # the fp32 sample reaches time_embedding
        predict()
    guard = guard_diffusion(model, "fp16-vae32")
    assert guard.groups["model"].rule == "diffusion_components"
    assert predict().dtype == HALF


def test_4b_onetrainer_layout_needs_batch_and_leaf_guards() -> None:
    model = OneTrainerTiny(dtype=HALF).requires_grad_(False)
    examples = onetrainer_examples(2, dtype=HALF)

    def train_forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = model(**batch)
        assert out.loss is not None
        return out.loss

    batch = collate_onetrainer(examples)
    assert batch["latent_mask"].dtype == torch.float32
    with pytest.raises(RuntimeError, match=MAT):
        train_forward(batch)
    # Batch and boundary casting alone fix the mask, not the embedding made inside forward.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard_diffusion(model, PrecisionPolicy.from_preset("fp16-vae32", leaf_guards="off"))
    with pytest.raises(RuntimeError, match=MAT):
        train_forward(batch)
    guard_diffusion(model, "fp16-vae32")  # leaf guards on, as the preset has them
    assert bool(torch.isfinite(train_forward(batch)))
    # At the source instead: the collator casts the mask where the batch is made.
    fixed = PrecisionCollator(collate_onetrainer, "fp16-vae32")(examples)
    assert fixed["latent_mask"].dtype == HALF and fixed["timesteps"].dtype == torch.int64


def test_recipe_training_code_fails_without_the_guard(tmp_path: Path) -> None:
    """The recipe's loop (no dtype casts) with fp16 weights and --no_guard: the VAE encoder
    gets the fp32 images. tests/frontends/test_diffusion.py trains the same loop with the guard."""
    from accelerate.state import AcceleratorState

    spec = importlib.util.spec_from_file_location(
        "recipe_lora_diffusion_scenario", ROOT / "recipes" / "lora_diffusion.py"
    )
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe
    spec.loader.exec_module(recipe)
    AcceleratorState._reset_state(True)
    try:
        with pytest.raises(RuntimeError, match=FP32_INTO_HALF):
            recipe.main(
                [
                    "--config",
                    str(ROOT / "recipes/configs/diffusion/tiny.yaml"),
                    "--output_dir",
                    str(tmp_path),
                    "--max_steps",
                    "1",
                    "--no_guard",
                ]
            )
    finally:
        AcceleratorState._reset_state(True)
