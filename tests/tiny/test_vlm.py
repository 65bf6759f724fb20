"""Tiny native VLMs: build offline, run forward/backward/generate, batches match the configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from hf_precision.tiny import vlm
from hf_precision.tiny.remote_layouts import MATMUL_DTYPE_ERROR


def _types(*names: str) -> list[Any]:
    """Model types as parameters, skipped where this transformers lacks the model class."""
    return [
        pytest.param(
            n,
            marks=pytest.mark.skipif(
                not vlm.tiny_available(n),
                reason=f"transformers {transformers.__version__} has no {n} model class",
            ),
        )
        for n in names
    ]


MODEL_TYPES = sorted(vlm.TINY_CONFIGS)
# Where each model's vision encoder lives (a parameter there must get a gradient).
VISION_PARAM = {
    "llava": "model.vision_tower.",
    "llava_next": "model.vision_tower.",
    "idefics2": "model.vision_model.",
    "idefics3": "model.vision_model.",
    "qwen2_vl": "model.visual.",
    "paligemma": "model.vision_tower.",
    "minicpmv4_6": "model.vision_tower.",
    "blip-2": "vision_model.",
    "kosmos-2": "vision_model.",
}


@pytest.mark.parametrize("model_type", _types(*MODEL_TYPES))
def test_fp32_forward_backward_generate(model_type: str) -> None:
    model: Any = vlm.build_tiny(model_type)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) < 100_000
    assert {p.dtype for p in params} == {torch.float32}
    assert not model.training

    batch = vlm.tiny_batch(model)
    floats = {k: v.dtype for k, v in batch.items() if v.is_floating_point()}
    assert floats == ({"pixel_values": torch.float32} if model_type != "llama" else {})
    out = model(**batch)
    assert out.logits.dtype == torch.float32
    assert torch.isfinite(out.loss)
    out.loss.backward()
    prefix = VISION_PARAM.get(model_type)
    if prefix is not None:  # the image really reaches the loss
        grads = [p.grad for n, p in model.named_parameters() if n.startswith(prefix)]
        assert any(g is not None and g.abs().sum() > 0 for g in grads)

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    n = batch["input_ids"].shape[1]
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert n < generated.shape[1] <= n + 3
    assert torch.equal(generated[:, :n], batch["input_ids"])


@pytest.mark.parametrize("model_type", _types("llava", "qwen2_vl", "blip-2", "minicpmv4_6"))
def test_dtype_argument_casts_everything(model_type: str) -> None:
    model: Any = vlm.build_tiny(model_type, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    if model_type == "blip-2":  # .to() ignores _keep_in_fp32_modules
        assert "query_tokens" in model._keep_in_fp32_modules
        assert model.query_tokens.dtype == torch.bfloat16
    # transformers 5.23 casts pixel_values to the vision dtype: a uniform cast runs.
    out = model(**vlm.tiny_batch(model))
    assert out.logits.dtype == torch.bfloat16
    assert torch.isfinite(out.loss)


def test_component_split_reproduces_class_b() -> None:
    model = vlm.tiny_llava()
    model.model.vision_tower.to(torch.bfloat16)  # projector left in fp32
    with pytest.raises(RuntimeError, match=MATMUL_DTYPE_ERROR):
        model(**vlm.tiny_batch(model))


def test_seed_and_registry() -> None:
    a, b, c = vlm.tiny_llava(seed=0), vlm.tiny_llava(seed=0), vlm.tiny_llava(seed=1)
    wa, wb, wc = (m.lm_head.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert vlm.tiny_config("blip_2").model_type == "blip-2"
    assert vlm.tiny_config("kosmos2").model_type == "kosmos-2"
    assert vlm.tiny_config("llava") is not vlm.tiny_config("llava")  # fresh each time
    assert vlm.tiny_config("llava").image_token_index == vlm.IMAGE_TOKEN_ID
    with pytest.raises(KeyError, match="no tiny model for 'gpt2'"):
        vlm.build_tiny("gpt2")


def test_tiny_available_is_a_bool_for_any_model_type() -> None:
    from hf_precision import tiny

    assert tiny.tiny_available("llava") is True and tiny.tiny_available("blip_2") is True
    for name in ("qwen2_5_vl", "gpt2", ""):
        assert tiny.tiny_available(name) is False, name


@pytest.mark.parametrize("model_type", _types(*MODEL_TYPES))
def test_the_configs_file_speaks_the_tiny_tokenizers_ids(model_type: str) -> None:
    config = vlm.tiny_config(model_type)
    text = config.get_text_config()
    assert text.vocab_size == 256, model_type
    if model_type != "kosmos-2":  # its own ids (Kosmos2TextConfig's defaults; see tiny_batch)
        ids = (text.pad_token_id, text.bos_token_id, text.eos_token_id)
        assert ids == (vlm.PAD_ID, vlm.BOS_ID, vlm.EOS_ID), model_type
    expected = {"qwen2_vl": vlm.QWEN_IMAGE, "kosmos-2": None, "llama": None}
    assert vlm.image_token_of(config) == expected.get(model_type, vlm.IMAGE_TOKEN_ID)


def test_a_config_and_a_fragment_are_fresh_copies_of_the_file() -> None:
    config = vlm.tiny_config("llava_next")
    config.image_grid_pinpoints[0][0] = 1
    assert vlm.tiny_config("llava_next").image_grid_pinpoints == [[30, 30]]
    clip = vlm.fragment_kwargs("clip")  # merged with the fragment it uses
    assert clip["model_type"] == "clip_vision_model" and clip["hidden_size"] == 32
    clip["hidden_size"] = 8
    assert vlm.fragment_kwargs("clip")["hidden_size"] == 32
    with pytest.raises(KeyError, match="no fragment 'clip64' in configs.toml"):
        vlm.fragment_kwargs("clip64")


def test_qwen2_vl_rope_is_spelled_the_way_this_transformers_reads_it() -> None:
    text = vlm.tiny_config("qwen2_vl").get_text_config()
    if vlm._accepts("Qwen2VLTextConfig", "rope_parameters"):
        assert text.rope_parameters["mrope_section"] == [2, 1, 1]
    else:  # 4.x reads rope_scaling
        assert text.rope_scaling["mrope_section"] == [2, 1, 1]


@pytest.mark.parametrize("model_type", _types(*[t for t in MODEL_TYPES if t != "llama"]))
def test_batch_layout(model_type: str) -> None:
    config = vlm.tiny_config(model_type)
    batch = vlm.tiny_batch(config, batch_size=3, seed=1)
    n_img = vlm.num_image_tokens(config)
    img_id = {"qwen2_vl": vlm.QWEN_IMAGE, "kosmos-2": 4}.get(model_type, vlm.IMAGE_TOKEN_ID)
    is_img = batch["input_ids"] == img_id
    assert is_img.sum(dim=1).tolist() == [n_img] * 3
    assert (batch["labels"][is_img] == -100).all()
    assert torch.equal(batch["labels"][~is_img], batch["input_ids"][~is_img])
    assert batch["attention_mask"].dtype == torch.long
    assert "labels" not in vlm.tiny_batch(config, with_labels=False)
    extra = {
        "llava_next": "image_sizes",
        "idefics2": "pixel_attention_mask",
        "idefics3": "pixel_attention_mask",
        "qwen2_vl": "mm_token_type_ids",
        "paligemma": "token_type_ids",
        "minicpmv4_6": "target_sizes",
        "kosmos-2": "image_embeds_position_mask",
    }.get(model_type)
    if model_type == "qwen2_vl" and "mm_token_type_ids" not in batch:
        extra = None  # transformers 4.x's Qwen2-VL takes no mm_token_type_ids
    if extra is not None:
        assert extra in batch
    if extra == "mm_token_type_ids":
        assert torch.equal(batch["mm_token_type_ids"].bool(), is_img)
        assert batch["pixel_values"].shape == (3 * 16, 96)


def test_llava_processor_round_trip(tmp_path: Path) -> None:
    processor = vlm.tiny_llava_processor(str(tmp_path))
    assert {"tokenizer.json", "processor_config.json"} <= {p.name for p in tmp_path.iterdir()}
    tok = processor.tokenizer
    assert len(tok) == 256
    assert tok.convert_tokens_to_ids("<image>") == vlm.IMAGE_TOKEN_ID
    # the PIL-backed image processor (its name in transformers 5 and in 4.x)
    assert type(processor.image_processor).__name__ in (
        "CLIPImageProcessorPil",
        "CLIPImageProcessor",
    )

    messages: Any = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What color is the square?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "It is red."}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    assert text.startswith("user : <image> What color")
    image = Image.fromarray((np.random.default_rng(0).random((40, 50, 3)) * 255).astype("uint8"))
    enc = processor(images=[image], text=[text], return_tensors="pt")
    assert enc["pixel_values"].shape == (1, 3, 30, 30)
    assert enc["pixel_values"].dtype == torch.float32
    ids = enc["input_ids"][0]
    assert int((ids == vlm.IMAGE_TOKEN_ID).sum()) == 25
    assert vlm.UNK_ID not in ids.tolist()  # every word is in the vocab
    assert tok.decode(ids, skip_special_tokens=True).endswith("it is red .")

    model = vlm.tiny_llava()
    out = model(**enc, labels=enc["input_ids"])
    assert torch.isfinite(out.loss)
    reloaded = type(processor).from_pretrained(str(tmp_path), local_files_only=True)
    again = reloaded(images=[image], text=[text], return_tensors="pt")
    assert torch.equal(again["input_ids"], enc["input_ids"])
    assert torch.allclose(again["pixel_values"], enc["pixel_values"])


def test_imports_stay_light() -> None:
    """``import hf_precision`` skips the tiny package; the tiny modules never import wandb."""
    code = (
        "import sys, hf_precision\n"
        "assert 'hf_precision.tiny' not in sys.modules\n"
        "import hf_precision.tiny as t\n"
        "assert 'hf_precision.tiny.vlm' not in sys.modules  # lazy attributes\n"
        "t.tiny_llava, t.MiniCPMV2Tiny, t.OneTrainerTiny\n"
        "assert 'wandb' not in sys.modules, 'wandb imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
