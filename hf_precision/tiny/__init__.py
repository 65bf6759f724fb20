"""Tiny offline models for tests, recipes, notebooks and benchmarks (nothing is downloaded).

- :mod:`.vlm`: native transformers VLMs from tiny configs, ``tiny_batch``, an offline processor.
- :mod:`.remote_layouts`: plain-torch copies of remote-code layouts (MiniCPM-V 2.x, OmniLMM,
  InternLM-XComposer, InternVL-Chat) with their real dtype bugs.
- :mod:`.diffusion`: a OneTrainer-style denoiser and its fp32-mask collator.

Attributes load lazily (PEP 562) so ``import hf_precision.tiny`` stays cheap; nothing here
imports wandb.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .diffusion import (
        OneTrainerTiny,
        collate_onetrainer,
        get_timestep_embedding,
        onetrainer_batch,
        onetrainer_examples,
    )
    from .remote_layouts import (
        CONV_DTYPE_ERROR,
        MATMUL_DTYPE_ERROR,
        REMOTE_LAYOUTS,
        InternVLTiny,
        MiniCPMV2Tiny,
        OmniLMMTiny,
        Resampler,
        XComposerTiny,
        get_2d_sincos_pos_embed,
        remote_batch,
    )
    from .vlm import (
        TINY_CONFIGS,
        build_tiny,
        num_image_tokens,
        tiny_batch,
        tiny_blip2,
        tiny_config,
        tiny_idefics2,
        tiny_idefics3,
        tiny_kosmos2,
        tiny_llava,
        tiny_llava_next,
        tiny_llava_processor,
        tiny_minicpmv4_6,
        tiny_paligemma,
        tiny_qwen2_vl,
        tiny_text_llama,
    )

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        (
            "TINY_CONFIGS", "build_tiny", "num_image_tokens", "tiny_batch", "tiny_blip2",
            "tiny_config", "tiny_idefics2", "tiny_idefics3", "tiny_kosmos2", "tiny_llava",
            "tiny_llava_next", "tiny_llava_processor", "tiny_minicpmv4_6", "tiny_paligemma",
            "tiny_qwen2_vl", "tiny_text_llama",
        ),
        "vlm",
    ),
    **dict.fromkeys(
        (
            "CONV_DTYPE_ERROR", "MATMUL_DTYPE_ERROR", "REMOTE_LAYOUTS", "InternVLTiny",
            "MiniCPMV2Tiny", "OmniLMMTiny", "Resampler", "XComposerTiny",
            "get_2d_sincos_pos_embed", "remote_batch",
        ),
        "remote_layouts",
    ),
    **dict.fromkeys(
        (
            "OneTrainerTiny", "collate_onetrainer", "get_timestep_embedding", "onetrainer_batch",
            "onetrainer_examples",
        ),
        "diffusion",
    ),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
