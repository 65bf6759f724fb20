"""Diffusion groups and presets (``hf_precision.rules.groups.diffusion``): each model on its own,
pipelines and component dicts through one adapter, PEFT-wrapped denoisers, language models left
alone, and the vae32 presets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")
from diffusers import SD3Transformer2DModel
from transformers import (
    CLIPTextModel,
    CLIPTextModelWithProjection,
    GPT2Config,
    GPT2LMHeadModel,
)

from hf_precision import (
    PrecisionError,
    PrecisionPolicy,
    dtype_map,
    enforce_policy,
    find_module_groups,
)
from hf_precision.rules.groups.diffusion import (
    DiffusionModules,
    component_groups,
    find_diffusion_groups,
)
from hf_precision.rules.policy.precision_policy import register_preset
from hf_precision.rules.policy.presets import PRESET_DEFAULTS, PRESET_HELP, PRESETS
from hf_precision.tiny import OneTrainerTiny
from hf_precision.tiny.diffusion import tiny_text_encoder, tiny_unet, tiny_vae

HALF = torch.float16


def dtypes(module: nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in module.parameters()}


# ------------------------------------------------------------------------------ groups


def test_groups_of_single_models() -> None:
    unet, vae = find_module_groups(tiny_unet()), find_module_groups(tiny_vae())
    assert (unet.rule, unet.paths) == ("diffusion_unet", {"unet": ("",)})
    assert unet.group_of("down_blocks.0.attentions.0.proj_in.weight") == "unet"
    # encode()/decode() call these children directly, never vae.forward: each is a root.
    assert vae.rule == "diffusion_vae"
    assert vae.paths == {"vae": ("", "encoder", "quant_conv", "post_quant_conv", "decoder")}
    for cls in (CLIPTextModel, CLIPTextModelWithProjection):
        te = find_module_groups(tiny_text_encoder(cls))
        assert (te.rule, te.paths) == ("diffusion_text_encoder", {"text_encoder": ("",)})
    sd3: Any = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
    )
    assert find_module_groups(sd3).paths == {"transformer": ("",)}
    # Not diffusers, but forward(latents, timesteps, ...): a OneTrainer-style denoiser.
    assert find_module_groups(OneTrainerTiny()).rule == "diffusion_unet"


def test_groups_through_peft_and_not_on_language_models() -> None:
    from peft import LoraConfig, get_peft_model

    peft_unet = get_peft_model(tiny_unet(), LoraConfig(r=2, target_modules=["to_q"]))
    groups = find_module_groups(peft_unet)
    assert groups.rule == "diffusion_unet" and groups.prefix == "base_model.model."
    # GPT-2 has a child named `transformer`: the diffusion rules must leave it alone.
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0)
    )
    assert not find_module_groups(gpt2).rule.startswith("diffusion")


def test_dict_adapter_and_component_names() -> None:
    unet, vae, te = tiny_unet(), tiny_vae(), tiny_text_encoder()
    comps = {"unet": unet, "vae": vae, "text_encoder": te, "scheduler": object(), "tokenizer": None}
    groups = find_diffusion_groups(comps)
    assert isinstance(groups.root, DiffusionModules) and groups.rule == "diffusion_components"
    assert groups.names == ("text_encoder", "unet", "vae")
    assert groups.paths["vae"] == (
        "vae",
        "vae.encoder",
        "vae.quant_conv",
        "vae.post_quant_conv",
        "vae.decoder",
    )
    # The adapter shares the modules: a policy enforced through it casts the originals.
    enforce_policy(groups.root, "fp16-vae32", groups=groups)
    assert dtypes(unet) == dtypes(te) == {HALF} and dtypes(vae) == {torch.float32}
    table = dtype_map(groups.root, groups)
    assert table.groups["vae"].dtypes == ("float32",)
    assert table.groups["unet"].dtypes == ("float16",)
    # The key names the group: SDXL's second encoder is a CLIPTextModelWithProjection.
    te2 = component_groups("text_encoder_2", tiny_text_encoder(CLIPTextModelWithProjection))
    assert te2.paths == {"text_encoder_2": ("",)}
    with pytest.raises(
        PrecisionError,
        match=r"find_diffusion_groups\(int\): expected a "
        r"DiffusionPipeline",
    ):
        find_diffusion_groups(42)
    with pytest.raises(PrecisionError, match=r"no nn\.Module among the components"):
        find_diffusion_groups({"scheduler": object()})


# ------------------------------------------------------------------------------ presets


def test_diffusion_presets() -> None:
    for name, half in (("fp16-vae32", torch.float16), ("bf16-vae32", torch.bfloat16)):
        policy = PrecisionPolicy.from_preset(name)
        assert (policy.compute_dtype, policy.frozen_dtype, policy.trainable_dtype) == (
            half,
            half,
            torch.float32,
        )
        assert policy.group_dtypes == {"vae": torch.float32} and policy.leaf_guards == "on"
        assert {"timestep", "timesteps", "labels"} <= set(policy.batch_skip_keys)
        assert policy.batch_key_groups["pixel_values"] == "vae"
        assert PrecisionPolicy.from_json(policy.to_json()) == policy
        assert policy.target_dtype("decoder.conv_in.weight", "vae", trainable=False) == (
            torch.float32,
            "group_dtypes['vae']",
        )
    # Overrides win; defaults are copied, so a change does not leak into the next policy.
    assert PrecisionPolicy.from_preset("fp16-vae32", group_dtypes={}).group_dtypes == {}
    PrecisionPolicy.from_preset("fp16-vae32").batch_key_groups["latents"] = "unet"
    assert "latents" not in PrecisionPolicy.from_preset("fp16-vae32").batch_key_groups
    with pytest.raises(
        PrecisionError,
        match="(?s)unknown preset 'fp16-vae31'.*Did you mean 'fp16-vae32'.*bf16-vae32",
    ):
        PrecisionPolicy.from_preset("fp16-vae31")


def test_register_preset_validates() -> None:
    with pytest.raises(PrecisionError, match="preset names are lowercase"):
        register_preset("FP16 VAE", "fp16", "fp16", "fp32", "x")
    with pytest.raises(PrecisionError, match="a preset of that name exists"):
        register_preset("fp16", "fp16", "fp16", "fp32", "x")
    with pytest.raises(
        PrecisionError,
        match=r"(?s)unknown field\(s\) \['group_dtype'\].*"
        "group_dtypes",
    ):
        register_preset("x-test", "fp16", "fp16", "fp32", "x", group_dtype={"vae": "fp32"})
    with pytest.raises(PrecisionError, match="unknown dtype 'fp61'"):
        register_preset("x-test", "fp61", "fp16", "fp32", "x")
    with pytest.raises(PrecisionError, match="(?s)unknown group 'vea'.*Did you mean 'vae'"):
        register_preset("x-test", "fp16", "fp16", "fp32", "x", group_dtypes={"vea": "fp32"})
    assert "x-test" not in PRESETS
    try:
        assert (
            register_preset("x-test", "bf16", "bf16", "fp32", "test", leaf_guards="off") == "x-test"
        )
        policy = PrecisionPolicy.from_preset("x-test")
        assert policy.leaf_guards == "off" and policy.name == "x-test"
    finally:
        for table in (PRESETS, PRESET_HELP, PRESET_DEFAULTS):
            table.pop("x-test", None)
