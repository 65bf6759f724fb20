"""Remote-code layouts: fp32 works; the half-precision failures of the real code reproduce."""

from __future__ import annotations

import traceback
from collections.abc import Callable

import pytest
import torch

from hf_precision.tiny.remote_layouts import (
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
    remote_batch,
)

# The real attribute paths a group finder must see.
LAYOUT: dict[type[RemoteVLM], tuple[str, ...]] = {
    MiniCPMV2Tiny: ("vpm", "resampler", "llm", "llm.lm_head"),
    OmniLMMTiny: ("model", "model.vision_tower", "model.resampler", "lm_head"),
    XComposerTiny: (
        "vit",
        "vit.vision_tower",
        "vision_proj",
        "model",
        "output",
        "model.layers.0.self_attn.q_proj.Plora_A",
    ),
    InternVLTiny: ("vision_model", "mlp1", "language_model", "language_model.lm_head"),
    XTunerLLaVATiny: ("llm", "visual_encoder", "projector", "projector.model", "llm.lm_head"),
    DeepSeekVLTiny: (
        "vision_model",
        "vision_model.vision_tower",
        "aligner",
        "aligner.layers",
        "language_model",
        "language_model.lm_head",
    ),
}
VISION: dict[type[RemoteVLM], str] = {
    MiniCPMV2Tiny: "vpm",
    OmniLMMTiny: "model.vision_tower",
    XComposerTiny: "vit.vision_tower",
    InternVLTiny: "vision_model",
    XTunerLLaVATiny: "visual_encoder",
    DeepSeekVLTiny: "vision_model",
}


def _patch_embed(model: RemoteVLM, vision: torch.nn.Module) -> torch.nn.Module:
    if isinstance(model, XTunerLLaVATiny):  # an HF CLIPVisionModel (its path differs in 4.x)
        return model.visual_encoder.get_input_embeddings()
    if isinstance(model, DeepSeekVLTiny):  # CLIPVisionTower around the (timm) ViT
        return vision.get_submodule("vision_tower.patch_embed")
    return vision.get_submodule("patch_embed")


HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("cls", list(LAYOUT))
def test_fp32_forward_backward_generate(cls: type[RemoteVLM]) -> None:
    model = cls()
    assert REMOTE_LAYOUTS[model.config.model_type] is cls
    names = dict(model.named_modules())
    assert all(path in names for path in LAYOUT[cls])
    assert sum(p.numel() for p in model.parameters()) < 100_000
    assert {p.dtype for p in model.parameters()} == {torch.float32}

    batch = model.batch()
    assert batch["pixel_values"].dtype == torch.float32
    out = model(**batch)
    assert out.logits.shape[:2] == batch["input_ids"].shape
    assert torch.isfinite(out.loss)
    out.loss.backward()
    vision = model.get_submodule(VISION[cls])
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in vision.parameters())

    ids = model.generate(batch["input_ids"], batch["pixel_values"], max_new_tokens=3)
    assert ids.shape == (2, batch["input_ids"].shape[1] + 3)
    assert torch.equal(ids[:, : batch["input_ids"].shape[1]], batch["input_ids"])


@pytest.mark.parametrize("cls", list(LAYOUT))
def test_generate_encodes_images_outside_forward(cls: type[RemoteVLM]) -> None:
    """Class D: a hook on the top-level forward never sees generate's image encoding."""
    model = cls()
    calls = {"top": 0, "leaf": 0, "tower": 0}

    def count(key: str) -> Callable[..., None]:
        return lambda *_: calls.__setitem__(key, calls[key] + 1)

    vision = model.get_submodule(VISION[cls])
    model.register_forward_pre_hook(count("top"))
    _patch_embed(model, vision).register_forward_pre_hook(count("leaf"))
    vision.register_forward_pre_hook(count("tower"))
    batch = model.batch()
    model.generate(batch["input_ids"], batch["pixel_values"], max_new_tokens=2)
    assert calls["top"] == 0
    assert calls["leaf"] == (2 if cls is MiniCPMV2Tiny else 1)  # MiniCPM: one call per image
    # MiniCPM-V 2.x / OmniLMM call `forward_features(...)`, bypassing the tower's own
    # hooks: only leaf-module hooks see their vision path.
    assert calls["tower"] == (0 if cls in (MiniCPMV2Tiny, OmniLMMTiny) else 1)


@pytest.mark.parametrize("dtype", HALF)
def test_minicpmv2_numpy_table_breaks_half_resampler(dtype: torch.dtype) -> None:
    """Seed bug 4: ``mat1 and mat2 must have the same dtype, but got Float and BFloat16``."""
    model = MiniCPMV2Tiny(dtype=dtype)
    batch = model.batch()
    name = "BFloat16" if dtype == torch.bfloat16 else "Half"
    for pixels in (batch["pixel_values"], batch["pixel_values"].to(dtype)):  # fp32, then half
        with pytest.raises(RuntimeError, match=f"but got Float and {name}") as info:
            model(**{**batch, "pixel_values": pixels})
        frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
        assert "multi_head_attention_forward" in frames  # the key, not the vision tower


def test_resampler_pos_embed_made_with_float_survives_a_half_load() -> None:
    feats = torch.randn(2, 25, 16, dtype=torch.bfloat16)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # what from_pretrained(torch_dtype=bf16) does
    try:
        loaded = Resampler(2, 32, 4, kv_dim=16, adaptive=True)
    finally:
        torch.set_default_dtype(default)
    assert loaded.pos_embed.dtype == torch.float32 and loaded.query.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=MATMUL_DTYPE_ERROR):
        loaded(feats, (5, 5))
    for adaptive in (True, False):  # cast whole, both tables follow: it works
        cast = Resampler(2, 32, 4, kv_dim=16, adaptive=adaptive).to(torch.bfloat16)
        out = cast(feats, (5, 5))
        assert out.dtype == torch.bfloat16 and out.shape == (2, 4, 32)


def test_minicpmv2_resampler_only_cast() -> None:
    model = MiniCPMV2Tiny()
    model.resampler.to(torch.bfloat16)  # vpm stays fp32: its output meets a bf16 kv_proj
    batch = model.batch()
    for pixels in (batch["pixel_values"], batch["pixel_values"].bfloat16()):
        with pytest.raises(RuntimeError, match=r"float != c10::BFloat16"):
            model(**{**batch, "pixel_values": pixels})


@pytest.mark.parametrize("dtype", HALF)
def test_omnilmm_casts_pixels_to_vision_dtype(dtype: torch.dtype) -> None:
    model = OmniLMMTiny(dtype=dtype)
    out = model(**model.batch())  # fp32 pixels: `.type(vpm dtype)` makes this work on CPU
    assert out.logits.dtype == dtype
    assert torch.isfinite(out.loss)


def test_omnilmm_hidden_vision_tower_escapes_cast() -> None:
    model = OmniLMMTiny(tune_clip=False)
    # held as upstream holds it: a plain list in the body's __dict__, not a submodule
    assert isinstance(model.model.__dict__["vision_tower"], list)
    assert "vision_tower" not in model.model._modules
    assert not any("vision_tower" in name for name, _ in model.named_modules())
    with pytest.raises(AttributeError):
        model.get_submodule("model.vision_tower")
    model.to(torch.bfloat16)
    assert model.model.vision_tower[0].pos_embed.dtype == torch.float32
    assert model.model.resampler.query.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match=MATMUL_DTYPE_ERROR):
        model(**model.batch())


@pytest.mark.parametrize("dtype", HALF)
def test_xcomposer_fp32_image_into_half_vit(dtype: torch.dtype) -> None:
    model = XComposerTiny(dtype=dtype)
    batch = model.batch()
    name = "BFloat16" if dtype == torch.bfloat16 else "Half"
    with pytest.raises(RuntimeError, match=rf"float != c10::{name}"):
        model(**batch)
    out = model(**{**batch, "pixel_values": batch["pixel_values"].to(dtype)})
    assert out.logits.dtype == dtype


def test_xtuner_projector_follows_the_visual_encoder_and_seed1_lm_head() -> None:
    model = XTunerLLaVATiny(torch.float16)
    out = model(**model.batch())  # pixels cast to visual_encoder.dtype: works in fp16
    assert out.logits.dtype == torch.float16
    model.llm.model.norm.float()  # trained in fp32 "for stability" (the seed)
    batch = model.batch()
    with pytest.raises(RuntimeError, match=r"float != c10::Half"):
        model.generate(batch["input_ids"], batch["pixel_values"], max_new_tokens=1)


def test_xcomposer_plora_runs_on_image_tokens_only() -> None:
    model = XComposerTiny()
    plora = model.model.layers[0].self_attn.q_proj
    torch.nn.init.normal_(plora.Plora_B.weight)
    batch = model.batch()
    seen: dict[str, int] = {}

    def rows(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen["rows"] = args[0].shape[0]

    plora.Plora_A.register_forward_hook(rows)
    model(**batch)
    assert seen["rows"] == int((batch["input_ids"] == model.config.image_token_id).sum())


@pytest.mark.parametrize("dtype", HALF)
def test_internvl_fp32_pixels_into_half_conv(dtype: torch.dtype) -> None:
    model = InternVLTiny(dtype=dtype)
    batch = model.batch()
    with pytest.raises(RuntimeError, match=CONV_DTYPE_ERROR):
        model(**batch)
    with pytest.raises(RuntimeError, match=CONV_DTYPE_ERROR):  # generate: same vision path
        model.generate(batch["input_ids"], batch["pixel_values"], max_new_tokens=1)
    out = model(**{**batch, "pixel_values": batch["pixel_values"].to(dtype)})
    assert out.logits.dtype == dtype


def test_remote_batch_layout() -> None:
    model = InternVLTiny()
    batch = remote_batch(model, batch_size=3, seed=2, with_labels=True)
    assert batch["pixel_values"].shape == (3, 3, 32, 32)
    is_img = batch["input_ids"] == model.config.image_token_id
    assert is_img.sum(1).tolist() == [4, 4, 4]
    assert (batch["labels"][is_img] == -100).all()
    assert "labels" not in remote_batch(model, with_labels=False)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [MiniCPMV2Tiny, OmniLMMTiny])
def test_type_dtype_keeps_cpu_device(cls: type[RemoteVLM]) -> None:
    """``pixel_values.type(dtype)`` changes dtype only: CPU pixels reach CUDA weights."""
    model = cls().cuda()
    batch = {k: (v.cuda() if k != "pixel_values" else v) for k, v in model.batch().items()}
    with pytest.raises(RuntimeError, match=r"(same device|should be the same)"):
        model(**batch)


@pytest.mark.parametrize("cls", [InternVLTiny, DeepSeekVLTiny])
def test_index_put_of_fp32_features_into_half_embeddings(cls: type[RemoteVLM]) -> None:
    """InternVL-Chat's ``input_embeds[selected] = ... + vit_embeds`` and DeepSeek-VL's
    ``inputs_embeds[images_seq_mask] = images_embeds[images_emb_mask]`` cast nothing: a
    projector kept in fp32 beside a bf16 language model fails there, in forward and generate."""
    model = cls(torch.bfloat16)
    projector = model.mlp1 if isinstance(model, InternVLTiny) else model.aligner
    projector.float()
    projector.register_forward_pre_hook(lambda m, a: (a[0].float(),))  # its input in its dtype
    batch = model.batch()
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    message = INDEX_PUT_DTYPE_ERROR + ", got BFloat16 for the destination and Float"
    with pytest.raises(RuntimeError, match=message):
        model(**batch)
    with pytest.raises(RuntimeError, match=message):
        model.generate(batch["input_ids"], batch["pixel_values"], max_new_tokens=1)


def test_deepseek_vl_prepare_inputs_embeds_as_upstream() -> None:
    model = DeepSeekVLTiny()
    batch = model.batch()
    ids = batch["input_ids"].clone()
    ids[:, -1] = -1  # negative ids are zeroed in place, as upstream
    pixels = batch["pixel_values"].unsqueeze(1)  # (b, n_images, 3, H, W)
    seq_mask = ids == model.config.image_token_id
    emb_mask = torch.ones(2, 1, model.config.num_image_tokens, dtype=torch.bool)
    embeds = model.prepare_inputs_embeds(ids, pixels, seq_mask, emb_mask)
    assert (ids >= 0).all()
    feats = model.aligner(model.vision_model(batch["pixel_values"]))
    assert torch.equal(embeds[seq_mask], feats.reshape(-1, feats.shape[-1]))
    text = model.language_model.get_input_embeddings()(ids)
    assert torch.equal(embeds[~seq_mask], text[~seq_mask])


def test_internvl_wrap_llm_lora_is_peft_on_the_language_model_only() -> None:
    from peft import PeftModel

    model = InternVLTiny()
    model.wrap_llm_lora()
    assert isinstance(model.language_model, PeftModel)
    names = dict(model.named_modules())
    assert "language_model.base_model.model.lm_head" in names
    lm = [n for n, p in model.language_model.named_parameters() if p.requires_grad]
    assert lm and all("lora_" in n for n in lm)  # the rest: frozen by the finetune script
    assert torch.isfinite(model(**model.batch()).loss)
