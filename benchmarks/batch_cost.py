"""Cost of batch fixing: ``PrecisionCollator(collate)`` ÷ ``collate``.

* ``batch_processor`` — the collator of a LLaVA-1.5 fine-tune: chat template, then
  ``LlavaProcessor(images=..., text=...)`` on 8 decoded 640x480 images (resized to 336x336,
  576 image tokens each), labels masked; the policy (``bf16``) casts ``pixel_values`` to bf16;
* ``batch_stack`` — the worst case, for reference: ``default_data_collator`` stacking features
  that are already tensors, so the collate itself is one memory copy and the cast a second pass.

>>> from benchmarks.batch_cost import run
>>> figures = run(quick=True)  # doctest: +SKIP
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np
import torch

from hf_precision import PrecisionCollator

from .common import Figure, calibrate, interleave, ratio_figure, smoke

FAMILY = "batch"


def llava15_processor(image_size: int = 336) -> Any:
    """A LLaVA-1.5-style processor built offline (tiny word-level tokenizer, CLIP preprocessing)."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    from hf_precision.tiny.vlm import CHAT_TEMPLATE, _tiny_tokenizer

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=_tiny_tokenizer(),
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def examples(n: int, size: tuple[int, int] = (640, 480), seed: int = 0) -> list[dict[str, Any]]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        out.append(
            {
                "image": Image.fromarray(pixels),
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image"},
                            {"type": "text", "text": "what is in the image ?"},
                        ],
                    },
                    {"role": "assistant", "content": "a red circle on a white background ."},
                ],
            }
        )
    return out


class VLMCollator:
    """The usual VLM fine-tuning collator (as in TRL's vision SFT examples)."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        tok = processor.tokenizer
        self.ignore = [tok.pad_token_id, tok.convert_tokens_to_ids("<image>")]

    def __call__(self, features: list[dict[str, Any]]) -> Any:
        texts = [
            self.processor.apply_chat_template(f["messages"], tokenize=False) for f in features
        ]
        batch = self.processor(
            images=[f["image"] for f in features], text=texts, padding=True, return_tensors="pt"
        )
        labels = batch["input_ids"].clone()
        for token in self.ignore:
            labels[labels == token] = -100
        batch["labels"] = labels
        return batch


def run(quick: bool = False, reps: int | None = None) -> list[Figure]:
    reps = reps or (2 if quick else 21)
    figures = []
    t0 = time.perf_counter()
    size = 112 if quick else 336
    collate = VLMCollator(llava15_processor(size))
    fixed = PrecisionCollator(collate, policy="bf16")
    feats = examples(2 if quick else 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fixed(feats)
    if out["pixel_values"].dtype != torch.bfloat16:
        raise RuntimeError(f"PrecisionCollator left pixel_values {out['pixel_values'].dtype}")
    # The processor's own time jumps by ±15% from call to call: many short repetitions.
    runs = interleave(
        {"cast": lambda: fixed(feats), "collate": lambda: collate(feats)}, reps=reps, warmup=1
    )
    figures.append(
        ratio_figure(
            "batch_processor",
            "collate + cast ÷ collate (LLaVA processor, 8 × 336px images)",
            runs,
            "cast",
            "collate",
            1.05,
            pixel_values=list(out["pixel_values"].shape),
            input_ids=list(out["input_ids"].shape),
        )
    )
    figures[-1].seconds = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    from transformers import default_data_collator

    tensors = [
        {
            "pixel_values": torch.randn(3, size, size),
            "input_ids": torch.arange(600),
            "attention_mask": torch.ones(600, dtype=torch.long),
            "labels": torch.arange(600),
        }
        for _ in range(len(feats))
    ]
    fixed_stack = PrecisionCollator(default_data_collator, policy="bf16")
    arms = {"cast": lambda: fixed_stack(tensors), "collate": lambda: default_data_collator(tensors)}
    runs = interleave(arms, reps=reps, warmup=1, inner=calibrate(arms, 0.01))
    fig = ratio_figure(
        "batch_stack",
        "collate + cast ÷ collate (pre-tensorised, stack only)",
        runs,
        "cast",
        "collate",
        None,
    )
    fig.note = (
        "reference worst case: collate is one memory copy, so the cast (a second pass "
        "over pixel_values) shows in full"
    )
    fig.seconds = round(time.perf_counter() - t0, 1)
    figures.append(fig)
    return [smoke(f) for f in figures] if quick else figures
