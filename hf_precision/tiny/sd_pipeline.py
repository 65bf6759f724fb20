"""A tiny Stable Diffusion pipeline saved to disk from configs, and a tiny image dataset, so the
diffusers example training scripts run unmodified on CPU (``--pretrained_model_name_or_path``,
``--train_data_dir`` / ``--instance_data_dir``).

The pipeline is ``StableDiffusionPipeline`` with the tiny UNet, VAE and one-layer CLIP text
encoder of :mod:`.diffusion`, a ``DDPMScheduler`` and a CLIP tokenizer over a 56-token vocabulary
(letters, no merges): 32×32 images <-> 4×16×16 latents. No safety checker.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from .vlm import fragment_kwargs

_SPECIAL = ("<|startoftext|>", "<|endoftext|>")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _tokenizer(folder: Path, max_length: int = 8) -> Any:
    from transformers import CLIPTokenizer

    vocab = {tok: i for i, tok in enumerate(_SPECIAL)}
    for c in _LETTERS:
        vocab[c] = len(vocab)
        vocab[f"{c}</w>"] = len(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(
        str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=max_length
    )


def save_tiny_sd_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny ``StableDiffusionPipeline`` (fp32, ~60k parameters) under ``path``."""
    from diffusers import DDPMScheduler, StableDiffusionPipeline
    from transformers import CLIPTextConfig, CLIPTextModel

    from .diffusion import tiny_unet, tiny_vae

    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = _tokenizer(Path(tmp))
    torch.manual_seed(seed)
    config = CLIPTextConfig(**{**fragment_kwargs("clip_text_16"), "vocab_size": 64})
    pipe: Any = StableDiffusionPipeline(
        vae=tiny_vae(seed).requires_grad_(True),
        text_encoder=CLIPTextModel(config),
        tokenizer=tokenizer,
        unet=tiny_unet(seed=seed).requires_grad_(True),
        scheduler=DDPMScheduler(num_train_timesteps=1000),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(path)
    return path


def save_tiny_sd_inpainting_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny SD 1.5 *inpainting* pipeline (fp32) under ``path``, in diffusers' format, as
    trainers that expect SD 1.5's shapes load it (OneTrainer's ``STABLE_DIFFUSION_15_INPAINTING``):
    a 9-channel UNet input (latents, mask, masked-image latents), a VAE with SD's four blocks
    (64×64 RGB <-> 4×8×8 latents: the factor 8 trainers hard-code), a ``DDIMScheduler`` and a
    one-layer CLIP text encoder with 77 positions (tokenizer padding to SD's length)."""
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionInpaintPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        _tokenizer(Path(tmp))
        tokenizer = CLIPTokenizer(
            str(Path(tmp) / "vocab.json"), str(Path(tmp) / "merges.txt"), model_max_length=77
        )
    torch.manual_seed(seed)
    text = {**fragment_kwargs("clip_text_16"), "vocab_size": 64, "max_position_embeddings": 77}
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=9,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=4,
    )
    vae = AutoencoderKL(
        latent_channels=4,
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=64,
    )
    pipe: Any = StableDiffusionInpaintPipeline(
        vae=vae,
        text_encoder=CLIPTextModel(CLIPTextConfig(**text)),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(num_train_timesteps=1000, steps_offset=1),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(path)
    return path


#: Stable Diffusion 1.5's UNet layout (four levels, two resnets a level, cross-attention in the
#: first three, 32 norm groups, 8 heads) at widths a CPU trains in seconds
SD15_BLOCK_OUT_CHANNELS = (32, 32, 64, 64)


def save_tiny_sd15_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny ``StableDiffusionPipeline`` with SD 1.5's layout (fp32, ~1M parameters) under
    ``path``: its UNet is SD 1.5's (:data:`SD15_BLOCK_OUT_CHANNELS` wide), its VAE downsamples by
    8 (64×64 images <-> 4×8×8 latents), its one-layer CLIP text encoder is 32 wide with SD's
    77 positions, and its tokenizer (``tokenizer/``) pads to 77. Trainers that rebuild SD 1.5's
    UNet from module constants (kohya's ``library.original_unet``) set those to the widths in
    ``unet/config.json``."""
    from diffusers import (
        AutoencoderKL,
        DDPMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = _tokenizer(Path(tmp), max_length=77)
    torch.manual_seed(seed)
    text = CLIPTextConfig(
        **{
            **fragment_kwargs("clip_text_16"),
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "projection_dim": 32,
            "max_position_embeddings": 77,
        }
    )
    unet = UNet2DConditionModel(
        sample_size=8,
        block_out_channels=SD15_BLOCK_OUT_CHANNELS,
        cross_attention_dim=32,
        attention_head_dim=8,
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=8,
        layers_per_block=1,
        sample_size=64,
    )
    pipe: Any = StableDiffusionPipeline(
        vae=vae,
        text_encoder=CLIPTextModel(text),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDPMScheduler(
            num_train_timesteps=1000,
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            steps_offset=1,
            clip_sample=False,
        ),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(path)
    _tokenizer(path / "tokenizer", max_length=77)  # vocab.json + merges.txt: slow tokenizers too
    return path


def save_tiny_image_folder(path: str | Path, n: int = 4, size: int = 32, seed: int = 0) -> Path:
    """``n`` random RGB PNGs and a ``metadata.jsonl`` (``file_name``, ``text``): what
    ``datasets``' ``imagefolder`` reads (``--train_data_dir``; DreamBooth's
    ``--instance_data_dir`` reads the images alone)."""
    from PIL import Image

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(n):
        pixels = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(path / f"{i}.png")
        lines.append(json.dumps({"file_name": f"{i}.png", "text": "a cat"}))
    (path / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return path


__all__ = [
    "SD15_BLOCK_OUT_CHANNELS",
    "save_tiny_image_folder",
    "save_tiny_sd15_pipeline",
    "save_tiny_sd_inpainting_pipeline",
    "save_tiny_sd_pipeline",
]
