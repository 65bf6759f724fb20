"""The launcher in a plain accelerate loop (no Trainer): ``Accelerator.prepare`` goes through the
plugin, fp16 on a CPU is refused before anything is cast, a Trainer's own Accelerator is left to
the Trainer's guard, and pipelines loaded with ``from_pretrained`` are guarded as loaded."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from hf_precision import PrecisionError
from hf_precision.integrations import accelerate_hook, launch_config, launcher

from .test_autostart import _python


@pytest.fixture(autouse=True)
def accelerate_launched(monkeypatch):
    """The launcher's patches on the real classes, HF_PRECISION_GUARD=auto, fresh accelerate."""
    for var in launch_config.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_PRECISION_GUARD", "auto")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerate_hook.patch_accelerator(Accelerator)
    yield
    accelerate_hook.unpatch_accelerator(Accelerator)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Lora(nn.Module):
    """A frozen base and a trainable adapter, both loaded in bf16 (the diffusers LoRA script's
    bf16 case: it upcasts its LoRA weights only under fp16)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
        self.lora_A = nn.Linear(8, 2, bias=False).to(torch.bfloat16)
        self.lora_B = nn.Linear(2, 8, bias=False).to(torch.bfloat16)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


def test_the_start_up_hook_waits_for_accelerate_accelerator():
    code = (
        "m.activate(); import torch\n"
        "print('@', 'hf_precision' in sys.modules)\n"
        "from accelerate import Accelerator\n"
        "print('@', getattr(Accelerator.__init__, '_hf_precision_wrapped', False), "
        "getattr(Accelerator.prepare, '_hf_precision_wrapped', False))\n"
    )
    assert _python(code, HF_PRECISION_GUARD="auto") == ["False", "True", "True"]
    assert _python(code, HF_PRECISION_GUARD="0") == ["False", "False", "False"]


def test_prepare_runs_through_the_plugin_and_trainable_half_weights_become_fp32(tmp_path):
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
    model = Lora()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    prepared, _ = accelerator.prepare(model, optimizer)
    assert prepared is model  # no wrapper on one CPU process
    plugin = getattr(accelerator, accelerate_hook.PLUGIN_ATTR)
    assert plugin.policy.name == "bf16"
    assert model.lora_A.weight.dtype == model.lora_B.weight.dtype == torch.float32
    assert model.base.weight.dtype == torch.bfloat16
    assert optimizer.param_groups[0]["params"][0] is model.lora_A.weight  # same tensors
    assert sorted(p.name for p in (tmp_path / "precision").glob("*.json")) == [
        "000000-after_prepare.json",
        "000000-setup.json",
    ]
    assert accelerator.prepare(optimizer) is not None  # no model: passes straight through


def test_no_picture_and_no_warning_without_matplotlib(tmp_path, monkeypatch, recwarn):
    """Nobody asked the launcher for a picture: without matplotlib it draws none, silently."""
    monkeypatch.setattr(accelerate_hook, "has_matplotlib", lambda: False)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
    accelerator.prepare(Lora())
    assert (tmp_path / "precision" / "000000-setup.json").is_file()
    assert list((tmp_path / "precision").glob("*.png")) == []
    assert not [w for w in recwarn if "matplotlib" in str(w.message)]


def test_fp16_on_a_cpu_is_refused_before_anything_is_cast():
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model = Lora()
    with pytest.raises(PrecisionError, match="--mixed_precision bf16") as err:
        accelerator.prepare(model)
    assert "no float16 autocast and no GradScaler" in str(err.value)
    assert model.lora_A.weight.dtype == torch.bfloat16


def test_a_trainers_accelerator_is_left_to_the_trainers_guard(make_trainer):
    from transformers import Trainer

    from hf_precision.tiny import tiny_batch, tiny_llava

    launcher.patch_trainer(Trainer)
    try:
        model = tiny_llava()
        trainer = make_trainer(model, tiny_batch(model))
    finally:
        launcher.unpatch_trainer(Trainer)
    assert getattr(trainer.accelerator, accelerate_hook.TRAINER_ATTR, False)
    trainer.accelerator.prepare(trainer.model)
    assert not hasattr(trainer.accelerator, accelerate_hook.PLUGIN_ATTR)
    launched = [cb for cb in trainer.callback_handler.callbacks if hasattr(cb, "policy")]
    assert len(launched) == 1  # one guard: the callback


def test_a_validation_pipeline_is_guarded_as_loaded(tmp_path):
    """train_text_to_image.py's final inference: an fp32 (trained) UNet beside the bf16 VAE and
    text encoder; unguarded, vae.decode fails (`Input type (float) and bias type (BFloat16)`)."""
    pytest.importorskip("diffusers")
    from diffusers import StableDiffusionPipeline

    from hf_precision.tiny.sd_pipeline import save_tiny_sd_pipeline

    path = save_tiny_sd_pipeline(tmp_path / "pipe")
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
    unet = StableDiffusionPipeline.from_pretrained(path).unet  # fp32, as trained
    accelerator.prepare(nn.Linear(2, 2))  # the plugin (and its reporter) exist
    pipe = StableDiffusionPipeline.from_pretrained(path, unet=unet, torch_dtype=torch.bfloat16)
    guard = pipe.__dict__["_hf_precision_guard"]
    assert pipe.text_encoder.dtype == pipe.vae.dtype == torch.bfloat16  # never upcast
    assert pipe.unet.dtype == torch.float32  # never lowered
    out = pipe("a cat", num_inference_steps=1, height=16, width=16, output_type="pt")
    assert out.images.shape == (1, 3, 16, 16)
    assert set(guard.reports) == {"unet", "vae", "text_encoder"}
    files = {p.name for p in (tmp_path / "precision").glob("*validation_pipeline*.json")}
    assert files == {f"000000-validation_pipeline-{n}.json" for n in guard.reports}
    data = json.loads((tmp_path / "precision" / "000000-validation_pipeline-vae.json").read_text())
    assert data["event"] == "validation_pipeline-vae"


def test_a_held_fp32_vae_beside_a_bf16_unet_is_guarded_when_the_loop_starts(tmp_path):
    """A VAE the script keeps in fp32 and never prepares, fed the bf16 pixels of the bf16 run:
    unguarded, vae.encode fails (`Input type (c10::BFloat16) and bias type (float)`)."""
    pytest.importorskip("diffusers")
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from hf_precision.tiny.sd_pipeline import save_tiny_sd_pipeline

    path = save_tiny_sd_pipeline(tmp_path / "pipe")
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae").requires_grad_(False)
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet").requires_grad_(False)
    unet = accelerator.prepare(unet.to(torch.bfloat16))
    pixels = torch.randn(1, 3, 32, 32).to(torch.bfloat16)
    with accelerator.accumulate(unet):
        latents = vae.encode(pixels).latent_dist.sample()
    assert latents.dtype == torch.float32 and vae.dtype == torch.float32  # nothing cast
    # one event per held model (a model of an earlier test still alive in this process counts)
    assert list((tmp_path / "precision").glob("000000-held_models-vae*.json"))


def _three_steps(said: object, accelerator: Accelerator, model: nn.Module) -> list[str]:
    """The diffusers LoRA script's loop, unedited: model and optimizer prepared apart (some
    scripts do), AdamW at lr 1e-5, bf16 autocast; the warnings it raised about lost updates."""
    import warnings

    nn.init.normal_(model.lora_B.weight, std=0.1)  # peft starts it at 0: lora_A had no gradient
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")  # the finding goes through logging all the same
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(optimizer)
        for _ in range(3):
            with accelerator.accumulate(model), accelerator.autocast():
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return said.about("updates lost")


def _lost_updates(tmp_path) -> dict:
    [path] = sorted((tmp_path / "precision").glob("*-lost_updates.json"))
    data = json.loads(path.read_text())
    assert data["event"] == "lost_updates"
    return data["lost_updates"]


def test_the_bf16_lora_loop_is_upcast_and_its_lost_update_section_says_none_lost(said, tmp_path):
    """#30: the LoRA script under --mixed_precision bf16, launched: the LoRA weights train in
    fp32, and the lost-update check (run as on the Trainer path, also for an optimizer prepared
    on its own) reports the fraction: none."""
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
    model = Lora()
    lost = _three_steps(said, accelerator, model)
    assert model.lora_A.weight.dtype == torch.float32
    section = _lost_updates(tmp_path)
    assert section["steps"] == 3 and section["counted"] > 0
    assert {w["name"]: w["dtype"] for w in section["weights"]} == {
        "lora_A.weight": "float32",
        "lora_B.weight": "float32",
    }
    assert section["unchanged"] == 0 and section["half_share"] == 0.0
    assert lost == []


def test_a_bf16_lora_kept_in_bf16_is_warned_with_the_fraction_lost(said, tmp_path, monkeypatch):
    """#30: the same loop with the guard in audit mode (nothing cast): the LoRA weights train in
    bf16 and most updates round away; the section has the fraction, the warning says it and the
    fix in the launcher's own flags."""
    monkeypatch.setenv("HF_PRECISION_MODE", "audit")
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
    model = Lora()
    [line] = _three_steps(said, accelerator, model)
    assert model.lora_A.weight.dtype == torch.bfloat16  # audit: as loaded
    section = _lost_updates(tmp_path)
    assert [w["dtype"] for w in section["weights"]] == ["bfloat16", "bfloat16"]
    assert section["half_share"] > 0.5, section
    assert f"{section['half_share']:.0%} of the sampled bfloat16 elements" in line
    assert f"({section['unchanged']}/{section['counted']})" in line
    assert "lora_A.weight" in line and "lora_B.weight" in line
    assert "hf-precision run --policy bf16 --mode fix" in line
    assert "HF_PRECISION_GUARD=bf16 HF_PRECISION_MODE=fix" in line


def test_keep_fp32_reaches_the_inferred_policy(tmp_path, monkeypatch):
    """--keep-fp32 under --policy auto: the policy is still inferred at prepare, from the
    accelerator and the model, with the pattern (a constructor parameter, as the callback's)."""
    monkeypatch.setenv("HF_PRECISION_KEEP_FP32", "base")
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
    model = Lora()
    accelerator.prepare(model)
    plugin = getattr(accelerator, accelerate_hook.PLUGIN_ATTR)
    assert plugin.extra_keep_fp32 == ("base",)
    assert plugin.policy.name == "bf16" and "base" in plugin.policy.keep_fp32
    assert model.base.weight.dtype == torch.float32  # named by the user: kept in fp32
    assert model.lora_A.weight.dtype == torch.float32
