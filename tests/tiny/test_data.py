"""The synthetic shapes-and-colours set (hf_precision.tiny.data)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from hf_precision.tiny.data import COLOURS, SHAPES, make_shapes_dataset, shape_image
from hf_precision.tiny.vlm import TINY_WORDS


def test_files_follow_the_llava_format_and_cover_every_class(tmp_path: Path) -> None:
    files = make_shapes_dataset(tmp_path, n_train=12, n_eval=3, seed=1)
    rows = [json.loads(line) for line in files["train"].read_text().splitlines()]
    assert len(rows) == 12
    answers = set()
    for row in rows:
        human, gpt = row["conversations"]
        assert human["from"] == "human" and human["value"].startswith("<image>\n")
        assert gpt["from"] == "gpt"
        assert (tmp_path / row["image"]).is_file()
        # Every word is in the tiny tokenizer's vocabulary: nothing maps to <unk>.
        words = human["value"].replace("<image>", "").split() + gpt["value"].split()
        assert set(words) <= set(TINY_WORDS)
        answers.add(gpt["value"])
    assert answers == {f"a {c} {s}" for c in COLOURS for s in SHAPES}  # 12 rows, 12 classes
    eval_rows = [json.loads(line) for line in files["eval"].read_text().splitlines()]
    assert len(eval_rows) == 3 and {r["id"] for r in eval_rows}.isdisjoint(r["id"] for r in rows)


def test_deterministic_per_seed(tmp_path: Path) -> None:
    a = make_shapes_dataset(tmp_path / "a", n_train=4, n_eval=1, seed=3)
    b = make_shapes_dataset(tmp_path / "b", n_train=4, n_eval=1, seed=3)
    assert a["train"].read_text() == b["train"].read_text()
    assert (tmp_path / "a/images/00002.png").read_bytes() == (
        tmp_path / "b/images/00002.png"
    ).read_bytes()


def test_shape_image_colours_the_shape() -> None:
    img = shape_image("square", "blue", size=30, rng=random.Random(0))
    pixels = {colour for _, colour in img.getcolors()}
    assert pixels == {(255, 255, 255), COLOURS["blue"]}
    with pytest.raises(ValueError, match=r"shape must be one of .*colour one of"):
        shape_image("hexagon", "blue")
