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


def _save(pipeline_cls: Any, path: str | Path, **parts: Any) -> Path:
    """``pipeline_cls(**parts)`` without a safety checker, saved under ``path``."""
    pipe: Any = pipeline_cls(
        **parts, safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )
    pipe.save_pretrained(path)
    return Path(path)


def _sd_vae(norm_num_groups: int) -> Any:
    """An ``AutoencoderKL`` with SD's four blocks, 8 wide: 64×64 RGB <-> 4×8×8 latents (the
    factor 8 trainers hard-code); weights from the global generator as it stands."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        latent_channels=4,
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=norm_num_groups,
        layers_per_block=1,
        sample_size=64,
    )


def save_tiny_sd_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny ``StableDiffusionPipeline`` (fp32, ~60k parameters) under ``path``."""
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    from .diffusion import tiny_text_encoder, tiny_unet, tiny_vae

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = _tokenizer(Path(tmp))
    torch.manual_seed(seed)
    return _save(
        StableDiffusionPipeline,
        path,
        vae=tiny_vae(seed),
        text_encoder=tiny_text_encoder(seed=None, vocab_size=64),  # drawn after the VAE's
        tokenizer=tokenizer,
        unet=tiny_unet(seed=seed),
        scheduler=DDPMScheduler(num_train_timesteps=1000),
    )


def save_tiny_sd_inpainting_pipeline(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny SD 1.5 *inpainting* pipeline (fp32) under ``path``, in diffusers' format, as
    trainers that expect SD 1.5's shapes load it (OneTrainer's ``STABLE_DIFFUSION_15_INPAINTING``):
    a 9-channel UNet input (latents, mask, masked-image latents), a VAE with SD's four blocks
    (64×64 RGB <-> 4×8×8 latents: the factor 8 trainers hard-code), a ``DDIMScheduler`` and a
    one-layer CLIP text encoder with 77 positions (tokenizer padding to SD's length)."""
    from diffusers import DDIMScheduler, StableDiffusionInpaintPipeline

    from .diffusion import tiny_text_encoder, tiny_unet

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = _tokenizer(Path(tmp), max_length=77)
    torch.manual_seed(seed)
    unet = tiny_unet(in_channels=9, seed=None)
    vae = _sd_vae(norm_num_groups=4)
    return _save(
        StableDiffusionInpaintPipeline,
        path,
        vae=vae,
        text_encoder=tiny_text_encoder(seed=None, vocab_size=64, max_position_embeddings=77),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(num_train_timesteps=1000, steps_offset=1),
    )


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
    from diffusers import DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    from .diffusion import tiny_text_encoder

    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = _tokenizer(Path(tmp), max_length=77)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8,
        block_out_channels=SD15_BLOCK_OUT_CHANNELS,
        cross_attention_dim=32,
        attention_head_dim=8,
    )
    vae = _sd_vae(norm_num_groups=8)
    text_encoder = tiny_text_encoder(
        seed=None,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        projection_dim=32,
        max_position_embeddings=77,
    )
    _save(
        StableDiffusionPipeline,
        path,
        vae=vae,
        text_encoder=text_encoder,
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
    )
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
