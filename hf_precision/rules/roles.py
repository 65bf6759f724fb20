"""Tensor roles: what a tensor is beyond its name, by the module that holds it (a
normalization layer's weight, a rotary table) or by its shape (a 0-D scalar). The policy's
precedence reads them (:mod:`hf_precision.rules.policy.precision_policy`)."""

from __future__ import annotations

import re
from typing import Literal

import torch
from torch import nn

#: What a tensor is, beyond its name (:func:`tensor_role`): a normalization layer's weight, a
#: rotary/positional table, or a 0-D floating scalar (a LoRA ``alpha``, a scale, a temperature,
#: CLIP's ``logit_scale``).
Role = Literal["norm", "rotary", "scalar"]
#: Normalization layers by type (subclasses included) and by class name (``*RMSNorm``,
#: ``*LayerNorm``, ``*GroupNorm`` of transformers and remote code).
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.modules.batchnorm._NormBase,
)
_NORM_NAME = re.compile(r"(RMS|Layer|Group|Batch)_?Norm", re.IGNORECASE)
_ROTARY_NAME = re.compile(r"Rotary|RoPE|Rope(Emb|$)")


def is_norm_module(module: nn.Module) -> bool:
    """A normalization layer, by type or class name (``LlamaRMSNorm``, ``Qwen2VLLayerNorm``,
    ``nn.LayerNorm``, remote code's ``InternRMSNorm``)."""
    return isinstance(module, _NORM_TYPES) or bool(_NORM_NAME.search(type(module).__name__))


def is_rotary_module(module: nn.Module) -> bool:
    """A rotary-embedding module: its class name says so (``LlamaRotaryEmbedding``,
    ``Qwen2VisionRotaryEmbedding``), or it keeps rotary state (``inv_freq``,
    ``rope_init_fn``, ``rope_type``)."""
    if _ROTARY_NAME.search(type(module).__name__):
        return True
    d = module.__dict__
    return "inv_freq" in d.get("_buffers", {}) or "rope_init_fn" in d or "rope_type" in d


def tensor_role(
    module: nn.Module, key: str, tensor: torch.Tensor, *, is_buffer: bool
) -> Role | None:
    """What ``module.<key>`` is, by the module that holds it: ``"rotary"`` for a floating
    buffer of a rotary module (or any ``*inv_freq*`` buffer), ``"scalar"`` for any other 0-D
    floating parameter or buffer (one number: what it is exactly is what the model computes
    with and what a trainer saves), ``"norm"`` for a 1-D weight or bias of a normalization
    layer, else ``None``."""
    floating = tensor.is_floating_point()
    if is_buffer and floating and ("inv_freq" in key or is_rotary_module(module)):
        return "rotary"
    if floating and tensor.dim() == 0:
        return "scalar"
    if is_buffer:
        return None
    if tensor.dim() <= 1 and is_norm_module(module):
        return "norm"
    return None
