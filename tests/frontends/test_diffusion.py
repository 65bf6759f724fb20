"""hf_precision.frontends.diffusion: groups, presets, batch rules, the VAE overflow check,
guard_diffusion
and the lora_diffusion recipe, on tiny diffusers models built from configs (CPU)."""

from __future__ import annotations

import doctest
import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn

pytest.importorskip("diffusers")

import hf_precision.frontends.diffusion as diffusion
from hf_precision import (
    PrecisionCollator,
    PrecisionError,
    PrecisionPolicy,
    PrecisionWarning,
    enforce_policy,
    find_module_groups,
    install_guards,
)
from hf_precision.frontends.diffusion import guard_diffusion
from hf_precision.rules.groups.diffusion import (
    DIFFUSION_BATCH_RULES,
    diffusion_batch_rules,
    vae_overflow,
)
from hf_precision.tiny.diffusion import tiny_text_encoder, tiny_unet, tiny_vae

ROOT = Path(__file__).resolve().parents[2]
HALF = torch.float16


def dtypes(module: nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in module.parameters()}


def test_module_doctests() -> None:
    result = doctest.testmod(diffusion, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 8 and result.failed == 0


# ------------------------------------------------------------------------------ policies at work


def test_vae_fp32_policy_encode_denoise_decode() -> None:
    unet, vae, te = tiny_unet(), tiny_vae(), tiny_text_encoder()
    for m in (unet, vae, te):
        m.to(HALF)  # loaded in the weight dtype, as OneTrainer does
    guard = guard_diffusion({"unet": unet, "vae": vae, "text_encoder": te}, "fp16-vae32")
    assert dtypes(vae) == {torch.float32} and dtypes(unet) == dtypes(te) == {HALF}
    assert guard.reports["vae"].group_dtypes == {"vae": {torch.float32}}
    images = torch.rand(2, 3, 16, 16) * 2 - 1  # fp32, as the data pipeline makes them
    latents = vae.encode(images).latent_dist.sample()
    assert latents.dtype == torch.float32
    hidden = te(torch.tensor([[0, 5, 6, 1], [0, 7, 1, 0]]))[0]
    assert hidden.dtype == HALF
    pred = unet(latents, torch.tensor([10, 900]), hidden).sample
    assert pred.dtype == HALF
    image = vae.decode(pred).sample  # fp16 latents into the fp32 VAE
    assert image.dtype == torch.float32 and bool(torch.isfinite(image).all())
    assert "vae" in str(guard) and "unet" in str(guard)
    # vae(x) goes through the VAE's batch guard: x stays fp32, never rounded to half.
    seen: list[torch.Tensor] = []
    vae.encoder.conv_in.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    assert vae(images).sample.dtype == torch.float32 and torch.equal(seen[-1], images)
    guard.remove()
    with pytest.raises(RuntimeError, match=r"Input type \(c10::Half\) and bias type \(float\)"):
        vae.decode(pred)


def _time_proj_inputs(unet: Any) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    unet.time_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    return seen


@pytest.mark.parametrize("positional", [False, True])
def test_timesteps_keep_precision_at_the_batch(positional: bool) -> None:
    x, hidden = torch.randn(1, 4, 8, 8), torch.randn(1, 5, 16)
    t = torch.tensor([999.3])

    def call(unet: Any, t: torch.Tensor) -> torch.Tensor:
        if positional:  # diffusers' training scripts call the UNet positionally
            return unet(x, t, hidden).sample
        return unet(sample=x, timestep=t, encoder_hidden_states=hidden).sample

    plain = tiny_unet()
    install_guards(plain, "bf16", enforce_policy(plain, "bf16"))
    seen = _time_proj_inputs(plain)
    call(plain, t)
    # timesteps are metadata for every policy (hf_precision.rules.batch_keys): not rounded to 1000.0
    assert seen[-1].dtype == torch.float32 and float(seen[-1]) == pytest.approx(999.3)
    unet = tiny_unet()
    guard_diffusion(unet, "bf16-vae32")
    seen = _time_proj_inputs(unet)
    assert call(unet, t).dtype == torch.bfloat16
    assert seen[-1].dtype == torch.float32 and float(seen[-1]) == pytest.approx(999.3)
    call(unet, torch.tensor([7]))
    assert seen[-1].dtype == torch.int64  # integer timesteps untouched


class TimeMLPDenoiser(nn.Module):
    """A denoiser that feeds the float timestep straight into a Linear: it expects it in the
    compute dtype, and the leaf guard casts it there."""

    def __init__(self) -> None:
        super().__init__()
        self.t_proj = nn.Linear(1, 4)
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        return self.conv(latents) + self.t_proj(timesteps[:, None])[:, :, None, None]


def test_float_timesteps_follow_compute_dtype_where_the_model_expects_it() -> None:
    model = TimeMLPDenoiser().requires_grad_(False).to(HALF)
    latents, t = torch.randn(2, 4, 4, 4, dtype=HALF), torch.tensor([0.25, 0.75])
    with pytest.raises(
        RuntimeError, match="mat1 and mat2 must have the same dtype, but got Float and Half"
    ):
        model(latents, t)
    handle = guard_diffusion(model, "fp16-vae32").handles["model"]
    assert "t_proj" in handle.leaf + handle.boundary  # a leaf guard (or the group's entry)
    assert model(latents, t).dtype == HALF


def test_batch_rules_in_the_collator() -> None:
    policy = PrecisionPolicy.from_preset("fp16-vae32")
    mask = torch.zeros(2, 1, 4, 4)
    mask[:, :, 0] = torch.finfo(torch.float32).min  # an additive mask sentinel
    batch = {
        "pixel_values": torch.rand(2, 3, 16, 16),
        "latents": torch.randn(2, 4, 4, 4),
        "noise": torch.randn(2, 4, 4, 4),
        "latent_mask": mask,
        "timesteps": torch.tensor([3, 500]),
        "timestep": torch.tensor([0.5, 0.25]),
        "encoder_hidden_states": torch.randn(2, 5, 16),
        "target": torch.randn(2, 4, 4, 4),
    }
    out = PrecisionCollator(lambda rows: rows[0], policy)([batch])
    assert out["pixel_values"].dtype == torch.float32  # follows the VAE
    assert {out[k].dtype for k in ("latents", "noise", "latent_mask", "encoder_hidden_states")} == {
        HALF
    }
    assert float(out["latent_mask"].min()) == torch.finfo(HALF).min  # not -inf
    for key in ("timesteps", "timestep", "target"):
        assert out[key] is batch[key]
    assert set(DIFFUSION_BATCH_RULES) >= {
        "latents",
        "latent_mask",
        "noise",
        "timesteps",
        "pixel_values",
    }
    # Any policy can take the rules.
    fp16 = diffusion_batch_rules("fp16")
    assert "timesteps" in fp16.batch_skip_keys and fp16.batch_key_groups["images"] == "vae"


def test_raise_mode_names_module_dtype_and_argument() -> None:
    unet = tiny_unet()
    with pytest.raises(
        PrecisionError,
        match=r"(?s)enforce_policy\(mode='raise'\).*"
        r"conv_in\.weight \[unet\]: float32 -> float16",
    ):
        guard_diffusion(unet, "fp16-vae32", mode="raise")
    guard_diffusion(unet, "fp16-vae32")
    install_guards(unet, PrecisionPolicy.from_preset("fp16-vae32", mode="raise"))
    with pytest.raises(
        PrecisionError,
        match=r"received (sample|input 0) as float32 .* weights are "
        r"float16",
    ):
        unet(torch.randn(1, 4, 8, 8), torch.tensor([1]), torch.randn(1, 5, 16, dtype=HALF))


# ------------------------------------------------------------------------------ VAE range


def test_vae_weight_overflow_keeps_the_vae_fp32() -> None:
    vae = tiny_vae()
    with torch.no_grad():
        vae.decoder.conv_out.bias[0] = 1e5  # beyond ±65504
    assert vae_overflow(vae) == [("decoder.conv_out.bias", 1e5)]
    with pytest.warns(
        PrecisionWarning,
        match=r"(?s)the VAE \('vae'\) leaves the float16 range.*"
        r"decoder\.conv_out\.bias.*kept in float32",
    ):
        guard = guard_diffusion({"vae": vae}, "fp16")
    assert dtypes(vae) == {torch.float32} and guard.vae_overflow
    image = vae.decode(torch.randn(1, 4, 8, 8, dtype=HALF)).sample
    assert image.dtype == torch.float32 and float(image[:, 0].min()) > 6e4


def test_enforce_policy_per_tensor_overflow_keeps_the_vae_working() -> None:
    """Without guard_diffusion's group check, enforce_policy keeps the out-of-range tensor (and
    its module's other parameters) in fp32; the mixed VAE then gets leaf guards."""
    vae = tiny_vae()
    with torch.no_grad():
        vae.decoder.conv_out.bias[0] = 1e5
    with pytest.warns(
        PrecisionWarning,
        match=r"decoder\.conv_out\.bias \[vae\]: max \|value\| "
        r"100000 exceeds the float16 range",
    ):
        report = enforce_policy(vae, "fp16", groups=find_module_groups(vae))
    assert vae.decoder.conv_out.weight.dtype == vae.decoder.conv_out.bias.dtype == torch.float32
    assert vae.decoder.conv_in.weight.dtype == HALF and report.mixed_groups == ("vae",)
    install_guards(vae, "fp16", report)
    image = vae.decode(torch.randn(1, 4, 8, 8)).sample
    assert image.dtype == torch.float32 and bool(torch.isfinite(image).all())


def test_vae_activation_overflow_found_with_images() -> None:
    vae, images = tiny_vae(), torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():  # weights still fit fp16, activations do not
        w = vae.decoder.conv_in.weight
        w.mul_(60000 / w.abs().max())
    assert vae_overflow(vae) == []
    hits = vae_overflow(vae, images)
    assert hits and all(v > 65504 for _, v in hits) and hits[0][0].startswith("decoder.")
    naive = tiny_vae()
    naive.load_state_dict(vae.state_dict())
    naive.to(HALF)
    assert not bool(
        torch.isfinite(naive.decode(torch.randn(1, 4, 8, 8, dtype=HALF)).sample).all()
    )  # what an fp16 VAE does with these weights
    with pytest.warns(PrecisionWarning, match=rf"{hits[0][0]}.*kept in float32"):
        guard_diffusion({"vae": vae}, "fp16", vae_images=images)
    assert dtypes(vae) == {torch.float32}
    image = vae.decode(torch.randn(1, 4, 8, 8, dtype=HALF)).sample
    assert bool(torch.isfinite(image).all())


# ------------------------------------------------------------------------------ recipe


def _load_recipe() -> Any:
    if "recipe_lora_diffusion" in sys.modules:
        return sys.modules["recipe_lora_diffusion"]
    spec = importlib.util.spec_from_file_location(
        "recipe_lora_diffusion", ROOT / "recipes" / "lora_diffusion.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_recipe_config_header_and_fields() -> None:
    path = ROOT / "recipes" / "configs" / "diffusion" / "tiny.yaml"
    text = path.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header[0].startswith("# Tiny Stable-Diffusion-style LoRA")
    assert (
        "# Launch:   python recipes/lora_diffusion.py --config recipes/configs/diffusion/tiny.yaml"
    ) in header
    assert any(line.startswith("# Override:") for line in header)
    config = yaml.safe_load(text)
    recipe = _load_recipe()
    assert set(config) <= {f.name for f in recipe.fields(recipe.RecipeArguments)}
    assert config["precision"] == "fp16-vae32" and config["weight_dtype"] == "float16"


def test_recipe_trains_a_few_steps(tmp_path: Path) -> None:
    from accelerate.state import AcceleratorState

    recipe = _load_recipe()
    AcceleratorState._reset_state(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = recipe.main(
                [
                    "--config",
                    str(ROOT / "recipes/configs/diffusion/tiny.yaml"),
                    "--output_dir",
                    str(tmp_path),
                    "--max_steps",
                    "3",
                    "--precision_report",
                    "false",
                ]
            )
    finally:
        AcceleratorState._reset_state(True)
    losses = report["loss"]["curve"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    groups = {
        name: {r["group"]: r["dtypes"] for r in rows}
        for name, rows in report["dtype_groups"].items()
    }
    assert groups["vae"] == {"vae": "float32"}
    assert groups["text_encoder"] == {"text_encoder": "float16"}
    assert groups["unet"] == {"unet": "float16/float32"}  # frozen fp16, LoRA fp32
    assert report["sample"] == {"dtype": "torch.float32", "shape": [1, 3, 16, 16], "finite": True}
    assert Path(report["adapter"]).name == "pytorch_lora_weights.safetensors"
    assert Path(report["adapter"]).is_file()
    assert (tmp_path / "precision_report.json").is_file()
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("*.bin"))  # no pickles
    _reload_into_a_pipeline(recipe, tmp_path / "adapter")


def _reload_into_a_pipeline(recipe, adapter_dir: Path) -> None:
    """A diffusers pipeline built from the same base weights loads the saved LoRA with
    ``load_lora_weights``, and its UNet then computes what the trained UNet computed."""
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    models = recipe.tiny_models(16, 0)
    # the base weights as trained: stored in fp16 (weight_dtype), computed in fp32 for the check
    for name in ("unet", "vae", "text_encoder"):
        models[name].to(torch.float16).to(torch.float32)
    pipe = StableDiffusionPipeline(
        vae=models["vae"],
        text_encoder=models["text_encoder"],
        tokenizer=None,
        unet=models["unet"],
        scheduler=models["scheduler"],
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    check = load_file(adapter_dir / "unet_check.safetensors")
    inputs = {k: check[k] for k in ("sample", "timestep", "encoder_hidden_states")}
    with torch.no_grad():
        base = pipe.unet(**inputs).sample
    pipe.load_lora_weights(adapter_dir)
    assert any("lora" in n for n, _ in pipe.unet.named_parameters())
    with torch.no_grad():
        tuned = pipe.unet(**inputs).sample
    torch.testing.assert_close(tuned, check["output"], rtol=0, atol=1e-5)
    assert (tuned - base).abs().max() > 1e-4  # the LoRA changed the output, as training did
