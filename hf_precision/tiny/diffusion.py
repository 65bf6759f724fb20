"""A tiny OneTrainer-style denoiser and collator reproducing two fp16 failures offline.

1. The sinusoidal timestep embedding is computed in fp32 (``torch.exp`` over an fp32 arange, as
   diffusers ``get_timestep_embedding``) and fed to ``time_embedding`` with no cast (diffusers
   casts ``t_emb.to(sample.dtype)``; this model, like the seed, does not), so half weights fail:
   ``mat1 and mat2 must have the same dtype, but got Float and Half`` (class F).
2. ``collate_onetrainer`` builds ``latent_mask`` with ``torch.ones(...)`` (fp32, OneTrainer's
   GenerateImageLike) while latents arrive in the model dtype; ``torch.cat`` promotes the conv
   input to fp32: ``Input type (float) and bias type (c10::Half) should be the same`` (class A).

fp16 runs on CPU in torch 2.13 for every op used here (conv2d, group_norm, silu, linear, mse),
so both failures reproduce with ``torch.float16`` on CPU (bf16 gives the same messages with
``BFloat16``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .vlm import fragment_kwargs

LATENT_CHANNELS, LATENT_SIZE = 4, 8


def get_timestep_embedding(
    timesteps: torch.Tensor, embedding_dim: int, max_period: int = 10000
) -> torch.Tensor:
    """diffusers-style sinusoidal embedding; always fp32 whatever the model dtype."""
    half = embedding_dim // 2
    exponent = (
        -math.log(max_period)
        * torch.arange(half, dtype=torch.float32, device=timesteps.device)
        / half
    )
    emb = timesteps[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)


@dataclass
class DenoiserOutput:
    sample: torch.Tensor
    loss: torch.Tensor | None = None


class OneTrainerTiny(nn.Module):
    """UNet-ish denoiser: ``conv_in`` on ``cat([latents, latent_mask])``, ``time_embedding``,
    one residual block with a time projection, ``conv_out``. Predicts the noise; MSE loss
    against ``target`` when given (computed in fp32)."""

    def __init__(self, dtype: torch.dtype | None = None, seed: int = 0, channels: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.channels = channels
        self.conv_in = nn.Conv2d(LATENT_CHANNELS + 1, channels, 3, padding=1)
        self.time_embedding = nn.Sequential(
            nn.Linear(channels, 2 * channels), nn.SiLU(), nn.Linear(2 * channels, 2 * channels)
        )
        self.time_emb_proj = nn.Linear(2 * channels, channels)
        self.norm = nn.GroupNorm(4, channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv_out = nn.Conv2d(channels, LATENT_CHANNELS, 3, padding=1)
        self.eval()
        if dtype is not None:
            self.to(dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_in.weight.dtype

    def forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        latent_mask: torch.Tensor,
        target: torch.Tensor | None = None,
    ) -> DenoiserOutput:
        # As diffusers, time embedding before conv_in; unlike diffusers, no cast to the dtype.
        temb = self.time_embedding(get_timestep_embedding(timesteps, self.channels))
        h = self.conv_in(torch.cat([latents, latent_mask], dim=1))
        h = h + self.conv(F.silu(self.norm(h))) + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        sample = self.conv_out(F.silu(h))
        loss = None if target is None else F.mse_loss(sample.float(), target.float())
        return DenoiserOutput(sample=sample, loss=loss)


def onetrainer_examples(
    n: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Dataset items as OneTrainer caches them: latents (already in the train dtype), noise,
    timestep."""
    g = torch.Generator().manual_seed(seed)
    shape = (LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE)
    return [
        {
            "latent": torch.randn(shape, generator=g).to(dtype),
            "noise": torch.randn(shape, generator=g).to(dtype),
            "timestep": torch.randint(0, 1000, (), generator=g),
        }
        for _ in range(n)
    ]


def collate_onetrainer(examples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack examples; noisy ``latents`` keep the examples' dtype, ``latent_mask`` is fp32."""
    latents = torch.stack([e["latent"] for e in examples])
    noise = torch.stack([e["noise"] for e in examples])
    timesteps = torch.stack([e["timestep"] for e in examples]).long()
    alpha = torch.cos(timesteps.float() / 1000 * math.pi / 2)[:, None, None, None]
    noisy = (alpha * latents + (1 - alpha**2).sqrt() * noise).to(latents.dtype)
    # The GenerateImageLike bug: no dtype=, so the mask is fp32 whatever the latents are.
    latent_mask = torch.ones(latents.shape[0], 1, *latents.shape[2:])
    return {"latents": noisy, "timesteps": timesteps, "latent_mask": latent_mask, "target": noise}


def onetrainer_batch(
    batch_size: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A collated batch: latents/target in ``dtype``, ``latent_mask`` fp32, ``timesteps`` int64."""
    return collate_onetrainer(onetrainer_examples(batch_size, dtype, seed))


# ------------------------------------------------------------------ tiny diffusers components
# (diffusers is imported lazily: it is an optional dependency, from the `recipes` extra).
# ``seed=None`` draws the weights from the global generator as it stands: several parts built
# in turn after one ``torch.manual_seed`` (a pipeline, the diffusion recipe).


def _seed(seed: int | None) -> None:
    if seed is not None:
        torch.manual_seed(seed)


def tiny_unet(in_channels: int = 4, seed: int | None = 0, sample_size: int = 8) -> Any:
    """A frozen ~20k-parameter ``UNet2DConditionModel`` (``sample_size``² latents, 8×8 by
    default; 16-dim text states)."""
    from diffusers import UNet2DConditionModel

    _seed(seed)
    unet: Any = UNet2DConditionModel(
        sample_size=sample_size,
        in_channels=in_channels,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=4,
    )
    return unet.requires_grad_(False)


def tiny_vae(seed: int | None = 0, sample_size: int = 16) -> Any:
    """A frozen tiny ``AutoencoderKL`` (``sample_size``² RGB <-> 4 latent channels at half the
    size: 16×16 <-> 4×8×8 by default)."""
    from diffusers import AutoencoderKL

    _seed(seed)
    vae: Any = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=sample_size,
    )
    return vae.requires_grad_(False)


def tiny_text_encoder(cls: Any = None, seed: int | None = 0, **config_overrides: Any) -> Any:
    """A frozen one-layer CLIP text encoder (16-dim states); ``cls`` picks e.g.
    ``CLIPTextModelWithProjection``; ``config_overrides`` change its ``CLIPTextConfig``
    (``vocab_size=64``)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    _seed(seed)
    config = CLIPTextConfig(**{**fragment_kwargs("clip_text_16"), **config_overrides})
    return (cls or CLIPTextModel)(config).requires_grad_(False)
