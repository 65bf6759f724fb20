"""A synthetic shapes-and-colours image-caption set, written in the LLaVA conversation format.

Each example is a small PNG (one coloured circle, square or triangle on a white background) and
a one-turn conversation asking what is in the picture, answered ``"a red circle"``. Every word
is in the tiny tokenizer's vocabulary (:data:`hf_precision.tiny.vlm.TINY_WORDS`), the answer
depends on the image only through its colour and shape, and the set is deterministic per seed,
so a tiny model learns it in a few dozen steps and the loss visibly goes down.

The files follow the LLaVA-Instruct layout the recipes document and load with ``datasets``::

    {"id": "0", "image": "images/00000.png",
     "conversations": [{"from": "human", "value": "<image>\\nwhat is in the image ?"},
                       {"from": "gpt", "value": "a red circle"}]}

>>> import tempfile
>>> from hf_precision.tiny.data import make_shapes_dataset
>>> files = make_shapes_dataset(tempfile.mkdtemp(), n_train=4, n_eval=2)
>>> sorted(files)
['eval', 'train']
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (40, 60, 220),
    "yellow": (235, 200, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
QUESTIONS: tuple[str, ...] = ("what is in the image ?", "describe the picture .")
BACKGROUND = (255, 255, 255)


def shape_image(shape: str, colour: str, size: int = 30, rng: random.Random | None = None) -> Any:
    """One ``size`` x ``size`` RGB PIL image with a single filled shape, about centred (size and
    position jittered by a few pixels, so no two images are the same).

    >>> shape_image("circle", "red").size
    (30, 30)
    """
    from PIL import Image, ImageDraw

    if shape not in SHAPES or colour not in COLOURS:
        raise ValueError(
            f"shape_image({shape!r}, {colour!r}): shape must be one of {SHAPES}, "
            f"colour one of {tuple(COLOURS)}"
        )
    rng = rng or random.Random(0)
    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    # Large and about centred: each shape covers its own pattern of the vision tower's patches
    # (corners for a square, a wedge for a triangle), which a tiny model can learn in seconds.
    side = rng.randint(size * 7 // 10, size * 8 // 10)
    x0 = (size - side) // 2 + rng.randint(-1, 1)
    y0 = (size - side) // 2 + rng.randint(-1, 1)
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon(
            [(x0 + side // 2, y0), (x0, y0 + side - 1), (x0 + side - 1, y0 + side - 1)], fill=fill
        )
    return img


def shapes_record(idx: int, image: str, shape: str, colour: str, question: str) -> dict[str, Any]:
    """One LLaVA-format record (``image`` relative to the JSONL file's folder)."""
    return {
        "id": str(idx),
        "image": image,
        "conversations": [
            {"from": "human", "value": f"<image>\n{question}"},
            {"from": "gpt", "value": f"a {colour} {shape}"},
        ],
    }


def make_shapes_dataset(
    out_dir: str | Path, *, n_train: int = 64, n_eval: int = 8, image_size: int = 30, seed: int = 0
) -> dict[str, Path]:
    """Write ``images/*.png``, ``train.jsonl`` and ``eval.jsonl`` under ``out_dir``.

    Classes cycle through every colour x shape pair, so even a small set covers all of them.
    Returns ``{"train": path, "eval": path}``. Re-running with the same arguments rewrites the
    same bytes (PNG encoding is deterministic), so a cached set can be reused.
    """
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pairs = [(s, c) for c in COLOURS for s in SHAPES]
    files: dict[str, Path] = {}
    idx = 0
    for split, count in (("train", n_train), ("eval", n_eval)):
        lines = []
        order = pairs[:]
        rng.shuffle(order)
        for i in range(count):
            shape, colour = order[i % len(order)]
            name = f"images/{idx:05d}.png"
            shape_image(shape, colour, image_size, rng).save(out / name)
            question = QUESTIONS[rng.randrange(len(QUESTIONS))]
            lines.append(json.dumps(shapes_record(idx, name, shape, colour, question)))
            idx += 1
        files[split] = out / f"{split}.jsonl"
        files[split].write_text("\n".join(lines) + "\n")
    return files
