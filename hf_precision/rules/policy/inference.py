"""Inferring the policy from what the user already said: the dtype the model was loaded in,
``TrainingArguments``' ``bf16``/``fp16`` flags, ``accelerator.mixed_precision``. These answer
a preset name and the fields inferred; :class:`~hf_precision.PrecisionPolicy`'s
``from_model``/``from_training_args``/``from_accelerator`` build the policy from them."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ...base.wrapper_kinds import unwrap_model
from ...errors import PrecisionError, PrecisionWarning
from ..dtypes import is_castable, majority_dtype
from ..groups.module_groups import find_module_groups
from .presets import PRESETS


def loaded_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype the user loaded ``model`` in (``from_pretrained(..., dtype=...)``): the one
    most of the language model's frozen weights have, else most of its weights, else the
    whole model's (frozen first). ``None`` when no weight is floating.

    The language model decides, not a count over the whole model: a vision tower larger than
    the language model (or kept fp32 on purpose), PEFT's fp32 adapters on a tiny model, or a
    projector trained in fp32 would otherwise tip the count.
    """
    root, _ = unwrap_model(model)
    params = [(n, p) for n, p in root.named_parameters() if is_castable(p)]
    with warnings.catch_warnings():  # the guard says what it finds when it runs; quiet here
        warnings.simplefilter("ignore")
        groups = find_module_groups(root)
    lm = [p for n, p in params if groups.group_of(n) == "language_model"]
    for pool in (lm, [p for _, p in params]):
        frozen = [p for p in pool if not p.requires_grad]
        for chosen in (frozen, pool):
            dt = majority_dtype((p.dtype, p.numel()) for p in chosen)
            if dt is not None:
                return dt
    return None


def infer_preset(model: nn.Module) -> str:
    """The preset :meth:`PrecisionPolicy.from_model` starts from: ``bf16-true`` /
    ``fp16-true`` when the language model was loaded in that half dtype
    (:func:`loaded_dtype`), else ``fp32``."""
    dt = loaded_dtype(model)
    if dt == torch.bfloat16:
        return "bf16-true"
    if dt == torch.float16:
        return "fp16-true"
    return "fp32"


def trainable_half_dtype(model: nn.Module) -> torch.dtype | None:
    """The half dtype most trainable weights not in fp32 were loaded in (or ``None``)."""
    root, _ = unwrap_model(model)
    return majority_dtype(
        (p.dtype, p.numel())
        for p in root.parameters()
        if p.requires_grad and is_castable(p) and p.dtype in (torch.bfloat16, torch.float16)
    )


def model_preset(model: nn.Module) -> tuple[str, dict[str, Any]]:
    """``(preset, fields)`` for :meth:`PrecisionPolicy.from_model`: the preset the model was
    loaded in and the fields inferred from its trainable weights."""
    preset = infer_preset(model)
    inferred: dict[str, Any] = {"keep_trainable_fp32": True}
    half = trainable_half_dtype(model)
    if half == torch.bfloat16 and half != PRESETS[preset][2]:
        # trained in bf16 as loaded (pure-bf16 training is a choice); fp16 trainables
        # outside an fp16 model are not kept: fp16 cannot hold AdamW's eps
        inferred["trainable_dtype"] = half
    return preset, inferred


def training_args_preset(args: Any) -> str | None:
    """The preset ``TrainingArguments``' flags name (``bf16``/``fp16``), ``None`` for no flag."""
    if getattr(args, "bf16", False) and getattr(args, "fp16", False):
        raise PrecisionError(
            "PrecisionPolicy.from_training_args(args): bf16=True and fp16=True together. "
            "Fix: choose one."
        )
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return None


def full_eval_dtype(args: Any) -> torch.dtype | None:
    """The dtype ``bf16_full_eval``/``fp16_full_eval`` ask for, else ``None``."""
    if getattr(args, "bf16_full_eval", False):
        return torch.bfloat16
    if getattr(args, "fp16_full_eval", False):
        return torch.float16
    return None


def accelerator_preset(accelerator: Any) -> str | None:
    """The preset ``accelerator.mixed_precision`` names; ``None`` for ``no``."""
    mp = str(getattr(accelerator, "mixed_precision", "no") or "no")
    if mp in ("bf16", "fp16"):
        return mp
    if mp == "fp8":
        warnings.warn(
            "PrecisionPolicy.from_accelerator: mixed_precision='fp8' is handled by its own "
            "recipe; the guard uses the 'bf16' policy around it.",
            PrecisionWarning,
            stacklevel=3,
        )
        return "bf16"
    return None
