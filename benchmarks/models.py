"""Model shapes the benchmarks build from configs (nothing is downloaded).

Real checkpoints' configs are written out here with their published sizes
(``llava-hf/llava-1.5-7b-hf``, ``Qwen/Qwen2-VL-72B-Instruct``); the smaller CPU/GPU shapes are
LLaVA-shaped models scaled to the parameter counts the figures ask for.

>>> from benchmarks.models import build_meta, llava15_7b_config
>>> model = build_meta(llava15_7b_config())
>>> round(sum(p.numel() for p in model.parameters()) / 1e9, 2)
7.06
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

#: Token id the LLaVA-shaped configs use for image placeholders (last id of a 32k vocab).
IMAGE_TOKEN = 31999


def llava_config(
    *,
    vision: dict[str, Any],
    text: dict[str, Any],
    image_token_index: int = IMAGE_TOKEN,
    **kwargs: Any,
) -> Any:
    from transformers import LlavaConfig

    return LlavaConfig(
        vision_config={"model_type": "clip_vision_model", **vision},
        text_config={"model_type": "llama", **text},
        image_token_index=image_token_index,
        **kwargs,
    )


def llava15_7b_config(layer_scale: float = 1.0) -> Any:
    """LLaVA-1.5-7B (CLIP ViT-L/14-336 + Llama-2-7B); ``layer_scale`` multiplies both depths."""
    return llava_config(
        vision=dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=round(24 * layer_scale),
            num_attention_heads=16,
            image_size=336,
            patch_size=14,
            projection_dim=768,
        ),
        text=dict(
            vocab_size=32064,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=round(32 * layer_scale),
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
        ),
        image_token_index=32000,
        vision_feature_layer=-2,
    )


def qwen2_vl_72b_config() -> Any:
    """Qwen2-VL-72B-Instruct (675M-parameter ViT + 72B Qwen2 LM)."""
    from transformers import Qwen2VLConfig

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
    return Qwen2VLConfig(
        vision_config=dict(
            depth=32,
            embed_dim=1280,
            hidden_size=8192,
            hidden_act="quick_gelu",
            mlp_ratio=4,
            num_heads=16,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        text_config=dict(
            vocab_size=152064,
            hidden_size=8192,
            intermediate_size=29568,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters=rope,
            tie_word_embeddings=False,
        ),
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=False,
    )


def llava_100m_config(image_size: int = 112) -> Any:
    """~107M parameters: a 6-layer 512-wide CLIP ViT/16 and a 6-layer 768-wide Llama, 32k vocab."""
    return llava_config(
        vision=dict(
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=6,
            num_attention_heads=8,
            image_size=image_size,
            patch_size=16,
        ),
        text=dict(
            vocab_size=32000,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=6,
            num_attention_heads=12,
            num_key_value_heads=4,
            max_position_embeddings=1024,
        ),
    )


def llava_500mb_config() -> Any:
    """~127M parameters, ~510 MB in fp32: :func:`llava_100m_config` with 9 text layers."""
    cfg = llava_100m_config()
    cfg.text_config.num_hidden_layers = 9
    return cfg


def vlm_1b_config() -> Any:
    """~0.96B parameters: CLIP ViT-L/14-336 (303M) + a 22-layer 1536-wide Llama (650M)."""
    return llava_config(
        vision=dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=336,
            patch_size=14,
            projection_dim=768,
        ),
        text=dict(
            vocab_size=32064,
            hidden_size=1536,
            intermediate_size=4096,
            num_hidden_layers=22,
            num_attention_heads=12,
            num_key_value_heads=4,
            max_position_embeddings=4096,
        ),
        image_token_index=32000,
        vision_feature_layer=-2,
    )


def build(config: Any, device: str | torch.device = "cpu", seed: int = 0) -> Any:
    """Instantiate the ``*ForConditionalGeneration`` class of ``config`` on ``device``."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device(device):
            return AutoModelForImageTextToText.from_config(config)


def build_meta(config: Any) -> Any:
    """Full-size model on the meta device: real module tree, no memory."""
    return build(config, "meta")


def image_text_to_text_types() -> list[str]:
    """Every ``model_type`` transformers maps to ``AutoModelForImageTextToText``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def default_config(model_type: str) -> Any:
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoConfig.for_model(model_type)


def vlm_batch(
    config: Any, batch_size: int, text_len: int, device: str | torch.device = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """A fp32 LLaVA batch: ``[image placeholders] + text`` per row, labels on the text only."""
    g = torch.Generator().manual_seed(seed)
    vc = config.vision_config
    n_img = (vc.image_size // vc.patch_size) ** 2  # "default" strategy drops CLS
    vocab = config.text_config.vocab_size
    text = torch.randint(
        4, min(vocab, config.image_token_index) - 1, (batch_size, text_len), generator=g
    )
    img = torch.full((batch_size, n_img), config.image_token_index)
    ids = torch.cat([img, text], dim=1)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(batch_size, 3, vc.image_size, vc.image_size, generator=g),
        "labels": torch.cat([torch.full_like(img, -100), text], dim=1),
    }
    return {k: v.to(device) for k, v in batch.items()}


def quick_llava_config() -> Any:
    """A small LLaVA config for the `--quick` smoke runs of the step and GPU families."""
    return llava_config(
        vision=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        ),
        text=dict(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        ),
        image_token_index=999,
    )
