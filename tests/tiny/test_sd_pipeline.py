"""The tiny Stable Diffusion pipeline on disk and the tiny imagefolder the diffusers example
scripts read."""

from __future__ import annotations

import json

import pytest
import torch

from hf_precision.tiny.sd_pipeline import save_tiny_image_folder, save_tiny_sd_pipeline


def test_the_pipeline_loads_back_and_its_tokenizer_fits_the_text_encoder(tmp_path):
    pytest.importorskip("diffusers")
    from diffusers import DiffusionPipeline

    path = save_tiny_sd_pipeline(tmp_path / "pipe")
    assert sorted(p.name for p in path.iterdir()) == [
        "model_index.json",
        "scheduler",
        "text_encoder",
        "tokenizer",
        "unet",
        "vae",
    ]
    pipe = DiffusionPipeline.from_pretrained(path)
    ids = pipe.tokenizer("a cat", padding="max_length", truncation=True).input_ids
    assert len(ids) == pipe.tokenizer.model_max_length == 8
    assert max(ids) < pipe.text_encoder.config.vocab_size
    assert {p.dtype for p in pipe.unet.parameters()} == {torch.float32}


def test_the_image_folder_has_a_caption_per_image(tmp_path):
    folder = save_tiny_image_folder(tmp_path / "data", n=3)
    rows = [json.loads(x) for x in (folder / "metadata.jsonl").read_text().splitlines()]
    assert [r["file_name"] for r in rows] == ["0.png", "1.png", "2.png"]
    assert all((folder / r["file_name"]).is_file() and r["text"] for r in rows)
