"""diffusers' own example training scripts, unmodified (vendored in ``diffusers_scripts/``), on a
tiny Stable Diffusion pipeline built from configs, under ``accelerate launch`` on CPU: each
failure runs as a user meets it, then under ``hf-precision run`` where it passes or is refused
before training with the fix (``make test-diffusers``).

The scripts import torchvision: the Makefile installs its wheel without its compiled ops into
``.venv-diffusers/site`` (``HF_PRECISION_DIFFUSERS_SITE``), put on ``PYTHONPATH`` here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.diffusers

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "diffusers_scripts"
SITE = Path(os.environ.get("HF_PRECISION_DIFFUSERS_SITE", ROOT / ".venv-diffusers" / "site"))
ACCELERATE = Path(sys.executable).with_name("accelerate")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    pytest.importorskip("diffusers")
    if not (SITE / "torchvision").is_dir():
        pytest.fail(
            f"no torchvision in {SITE}: the diffusers scripts import it. Fix: make "
            "test-diffusers (it installs it), or set HF_PRECISION_DIFFUSERS_SITE."
        )
    from hf_precision.tiny.sd_pipeline import save_tiny_image_folder, save_tiny_sd_pipeline

    root = tmp_path_factory.mktemp("sd")
    save_tiny_sd_pipeline(root / "pipe")
    save_tiny_image_folder(root / "data")
    (root / "instance").mkdir()  # DreamBooth opens every file of its folder as an image
    for png in (root / "data").glob("*.png"):
        (root / "instance" / png.name).write_bytes(png.read_bytes())
    return root


def run_script(
    assets: Path, out: Path, script: str, mp: str, *extra: str, guard: bool
) -> subprocess.CompletedProcess:
    """``[hf-precision run --] accelerate launch --num_processes 1 SCRIPT ...`` on CPU."""
    cmd = [str(ACCELERATE), "launch", "--num_processes", "1", "--num_machines", "1"]
    cmd += ["--mixed_precision", mp, "--dynamo_backend", "no", str(SCRIPTS / script)]
    cmd += ["--pretrained_model_name_or_path", str(assets / "pipe"), "--resolution", "32"]
    cmd += ["--train_batch_size", "2", "--max_train_steps", "2", "--seed", "0"]
    cmd += ["--output_dir", str(out), "--mixed_precision", mp, "--dataloader_num_workers", "0"]
    cmd += list(extra)
    if guard:
        cmd = [sys.executable, "-m", "hf_precision", "run", "--", *cmd]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_PRECISION_")}
    env = {**clean, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SITE)])}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def lora_steps(out: Path) -> tuple[set[torch.dtype], float]:
    """The LoRA weights' dtypes at step 1, and the share of ``lora_A`` elements step 2 left
    unchanged (an update rounded away in bf16)."""
    from safetensors.torch import load_file

    a = load_file(out / "checkpoint-1" / "pytorch_lora_weights.safetensors")
    b = load_file(out / "checkpoint-2" / "pytorch_lora_weights.safetensors")
    keys = [k for k in a if "lora_A" in k or "lora.down" in k]
    same = sum(int((a[k] == b[k]).sum()) for k in keys)
    return {v.dtype for v in a.values()}, same / sum(a[k].numel() for k in keys)


def ok(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode == 0


@pytest.mark.parametrize(
    ("script", "data"),
    [
        ("train_text_to_image_lora.py", ("--train_data_dir", "data")),
        (
            "train_dreambooth_lora.py",
            ("--instance_data_dir", "instance", "--instance_prompt", "a cat"),
        ),
    ],
)
def test_lora_under_bf16_trains_its_adapter_in_fp32(assets, tmp_path, script, data):
    """The scripts upcast LoRA weights only under fp16: under bf16 they train in bf16 and most
    of lora_A's updates round away. Under the launcher: fp32, every element moves, and the
    reports are written in <output_dir>/precision."""
    extra = (data[0], str(assets / data[1]), *data[2:], "--rank", "4", "--checkpointing_steps", "1")
    plain = run_script(assets, tmp_path / "plain", script, "bf16", *extra, guard=False)
    assert ok(plain), plain.stderr[-3000:]
    dtypes, unchanged = lora_steps(tmp_path / "plain")
    assert dtypes == {torch.bfloat16} and unchanged > 0.3  # the failure, as a user meets it

    guarded = run_script(assets, tmp_path / "guarded", script, "bf16", *extra, guard=True)
    assert ok(guarded), guarded.stderr[-3000:]
    dtypes, unchanged = lora_steps(tmp_path / "guarded")
    assert dtypes == {torch.float32} and unchanged < 0.05
    assert "precision guard on for Accelerator(mixed_precision='bf16')" in guarded.stderr
    assert "→ float32 (trainable) in unet" in guarded.stderr
    reports = tmp_path / "guarded" / "precision"
    assert (reports / "000000-after_prepare.json").is_file()
    assert (reports / "precision.log").is_file()
    assert (tmp_path / "guarded" / "checkpoint-1" / "precision_policy.json").is_file()
    tensorboard_beside_the_scripts_loss(tmp_path / "guarded", reports)


def tensorboard_beside_the_scripts_loss(out: Path, reports: Path) -> None:
    """The scripts' default ``--report_to tensorboard``: the guard's events went into the event
    file of the script's own tracker (``<output_dir>/logs/<project>/``), beside its loss; the
    events before ``init_trackers`` waited for its writer."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = out.glob("logs/*/events.out.tfevents.*")  # one file: no second writer
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"train_loss", "loss"} & set(scalars), scalars  # the script's own
    prepared = json.loads((reports / "000000-after_prepare.json").read_text())
    found = [(e.step, e.value) for e in acc.Scalars("precision/mismatches/found")]
    assert (0, prepared["mismatches"]["found"]) in found
    assert "precision/after_prepare/modules/text_summary" in acc.Tags()["tensors"]


def test_full_fine_tune_bf16_final_inference_runs(assets, tmp_path):
    """train_text_to_image.py under bf16: the trained UNet is fp32 beside the bf16 VAE, and the
    final inference fails in vae.decode. Under the launcher the pipelines are guarded as loaded
    (nothing cast), one report event per component."""
    extra = ("--train_data_dir", str(assets / "data"), "--validation_prompts", "a cat")
    plain = run_script(
        assets, tmp_path / "plain", "train_text_to_image.py", "bf16", *extra, guard=False
    )
    assert not ok(plain)
    assert "Input type (float) and bias type (c10::BFloat16)" in plain.stderr

    guarded = run_script(
        assets, tmp_path / "guarded", "train_text_to_image.py", "bf16", *extra, guard=True
    )
    assert ok(guarded), guarded.stderr[-3000:]
    assert (tmp_path / "guarded" / "model_index.json").is_file()  # the pipeline was saved
    events = sorted(p.name for p in (tmp_path / "guarded" / "precision").glob("*validation*.json"))
    assert any("validation_pipeline-vae" in e for e in events), events
    assert any("validation_pipeline-text_encoder" in e for e in events), events


def test_fp16_on_cpu_is_refused_before_training_with_the_fix(assets, tmp_path):
    """fp16 on a CPU: no fp16 autocast, no GradScaler. The LoRA script trains, then stops in
    validation; under the launcher it is refused at prepare, with the flag that fixes it."""
    extra = ("--train_data_dir", str(assets / "data"), "--rank", "4")
    extra += ("--validation_prompt", "a cat", "--num_validation_images", "1")
    script = "train_text_to_image_lora.py"
    plain = run_script(assets, tmp_path / "plain", script, "fp16", *extra, guard=False)
    assert not ok(plain)
    assert "Steps: 100%" in plain.stderr  # it trained, then failed in validation:
    assert "mixed dtype (CPU): expect parameter to have scalar type of Float" in plain.stderr

    guarded = run_script(assets, tmp_path / "guarded", script, "fp16", *extra, guard=True)
    assert not ok(guarded)
    assert "Fix: --mixed_precision bf16 (or --mixed_precision no) on a CPU" in guarded.stderr
    assert "Steps: 100%" not in guarded.stderr
    assert not (tmp_path / "guarded" / "pytorch_lora_weights.safetensors").exists()
