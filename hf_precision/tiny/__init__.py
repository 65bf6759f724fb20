"""Tiny offline models for tests, recipes, notebooks and benchmarks (nothing is downloaded).

- :mod:`.vlm`: native transformers VLMs from tiny configs, ``tiny_batch``, an offline processor.
- :mod:`.remote_layouts`: plain-torch copies of remote-code layouts (MiniCPM-V 2.x, OmniLMM,
  InternLM-XComposer, InternVL-Chat, XTuner's LLaVA, DeepSeek-VL) with their real dtype bugs.
- :mod:`.diffusion`: a OneTrainer-style denoiser and its fp32-mask collator.
- :mod:`.rl`: a real ``trl.GRPOTrainer`` on a tiny model, its prompts and reward function.
- :mod:`.matrix`: the family × setup matrix of ``docs/matrix.md`` (``python -m
  hf_precision.tiny.matrix`` regenerates the installed transformers' column).

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
        INDEX_PUT_DTYPE_ERROR,
        MATMUL_DTYPE_ERROR,
        REMOTE_LAYOUTS,
        DeepSeekVLTiny,
        InternVLTiny,
        MiniCPMV2Tiny,
        OmniLMMTiny,
        RemoteVLM,
        Resampler,
        XComposerTiny,
        XTunerLLaVATiny,
        get_2d_sincos_pos_embed,
        remote_batch,
    )
    from .vlm import (
        TINY_CONFIGS,
        build_tiny,
        num_image_tokens,
        tiny_available,
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
        tower_body,
    )

_MODULES: dict[str, tuple[str, ...]] = {
    "vlm": (
        "TINY_CONFIGS",
        "build_tiny",
        "num_image_tokens",
        "tiny_batch",
        "tiny_blip2",
        "tiny_config",
        "tiny_idefics2",
        "tiny_idefics3",
        "tiny_kosmos2",
        "tiny_llava",
        "tiny_llava_next",
        "tiny_llava_processor",
        "tiny_minicpmv4_6",
        "tiny_paligemma",
        "tiny_qwen2_vl",
        "tiny_text_llama",
        "tiny_available",
        "tower_body",
    ),
    "remote_layouts": (
        "CONV_DTYPE_ERROR",
        "DeepSeekVLTiny",
        "INDEX_PUT_DTYPE_ERROR",
        "MATMUL_DTYPE_ERROR",
        "REMOTE_LAYOUTS",
        "InternVLTiny",
        "MiniCPMV2Tiny",
        "OmniLMMTiny",
        "XTunerLLaVATiny",
        "RemoteVLM",
        "Resampler",
        "XComposerTiny",
        "get_2d_sincos_pos_embed",
        "remote_batch",
    ),
    "diffusion": (
        "OneTrainerTiny",
        "collate_onetrainer",
        "get_timestep_embedding",
        "onetrainer_batch",
        "onetrainer_examples",
    ),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
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
