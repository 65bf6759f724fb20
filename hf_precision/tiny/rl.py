"""Tiny GRPO runs for the tests and benchmarks: a real ``trl.GRPOTrainer`` (``use_vllm=False``)
with a local reward function (no reward model), on the tiny LLaVA with image prompts, or on a
one-layer Llama over the same tokenizer with text prompts (TRL's continuous-batching generate
refuses a VLM). TRL and ``datasets`` are imported when a function needs them.

>>> from hf_precision.tiny.rl import length_reward
>>> length_reward(["a", "a red square"])
[1.0, 12.0]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

#: the (shape, colour) of each image prompt, in order
PROMPT_SHAPES = (("circle", "red"), ("square", "blue"), ("triangle", "green"), ("circle", "yellow"))
#: the text prompts, in order (repeated)
TEXT_PROMPTS = ("a red square", "a blue circle")


def length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A local reward function: longer completions score higher."""
    return [float(len(str(c))) for c in completions]


def image_prompts(n: int = 2, *, column: str = "image") -> Any:
    """A ``datasets.Dataset`` of ``n`` (at most 4) one-turn prompts "what is in the image ?",
    each with its shape image (:data:`PROMPT_SHAPES`) under ``column``: ``"image"`` holds the
    image, ``"images"`` a list of it."""
    from datasets import Dataset

    from .data import shape_image

    ask = [{"type": "image"}, {"type": "text", "text": "what is in the image ?"}]
    rows = []
    for shape, colour in PROMPT_SHAPES[:n]:
        image = shape_image(shape, colour)
        rows.append(
            {
                "prompt": [{"role": "user", "content": ask}],
                column: [image] if column == "images" else image,
            }
        )
    return Dataset.from_list(rows)


def text_prompts(n: int = 2) -> Any:
    """A ``datasets.Dataset`` of ``n`` text prompts (:data:`TEXT_PROMPTS`, repeated)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(n)]})


def rl_llama(dtype: torch.dtype | None = torch.bfloat16, seed: int = 0, **config: Any) -> Any:
    """``(model, tokenizer)``: a ``LlamaForCausalLM`` over the tiny LLaVA's tokenizer (its
    vocabulary and special ids), one layer 16 wide unless ``config`` says otherwise, in
    ``dtype`` (``None``: fp32 as built)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .vlm import tiny_llava_processor

    tok = tiny_llava_processor().tokenizer
    defaults: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(LlamaConfig(**{**defaults, **config}))
    return (model if dtype is None else model.to(dtype)), tok


def grpo_config(output_dir: str | Path, **overrides: Any) -> Any:
    """A ``trl.GRPOConfig`` for a tiny run on CPU: one step of 2 prompts x 2 completions of 8
    tokens, bf16 autocast, no KL term, no trackers, no checkpoints; ``overrides`` win."""
    import trl

    defaults: dict[str, Any] = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=True,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        beta=0.0,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return trl.GRPOConfig(**{**defaults, **overrides})


def tiny_grpo(
    output_dir: str | Path,
    model: Any,
    *,
    callbacks: Sequence[Any] = (),
    peft_config: Any = None,
    train_dataset: Any = None,
    processing_class: Any = None,
    reward_funcs: Sequence[Callable[..., Any]] = (length_reward,),
    **config: Any,
) -> Any:
    """A ``trl.GRPOTrainer`` on ``model`` (not trained yet): :func:`grpo_config` with
    ``config``, :func:`image_prompts` and the tiny LLaVA's processor unless given. TRL's own
    warnings while it builds are silenced."""
    import trl

    from .vlm import tiny_llava_processor

    args = grpo_config(output_dir, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.GRPOTrainer(
            model=model,
            reward_funcs=list(reward_funcs),
            args=args,
            train_dataset=image_prompts() if train_dataset is None else train_dataset,
            processing_class=processing_class or tiny_llava_processor(),
            peft_config=peft_config,
            callbacks=list(callbacks),
        )


__all__ = [
    "PROMPT_SHAPES",
    "TEXT_PROMPTS",
    "grpo_config",
    "image_prompts",
    "length_reward",
    "rl_llama",
    "text_prompts",
    "tiny_grpo",
]
