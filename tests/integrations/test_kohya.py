"""kohya-ss sd-scripts' own ``train_network.py`` (LoRA, ``networks.lora``), unmodified, on a
tiny SD 1.5 built from configs, on CPU, plain and under ``hf-precision run -- accelerate launch``
(``make test-kohya``: its own venv, ``.venv-kohya``).

sd-scripts is not on the package index: the tests unpack a source snapshot (``git archive`` of
one commit, ``sd-scripts-<commit>.tar.gz``) from ``$HF_PRECISION_SD_SCRIPTS`` (the archive or
an unpacked folder) or from an ``upstream/`` folder beside the checkout, and skip, naming both,
where there is none. ``kohya_runner.py`` sets the UNet widths sd-scripts keeps as module
constants, then runs the script.

The unit tests of :mod:`hf_precision.integrations.kohya` (no sd-scripts needed) are at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision.integrations import kohya
from hf_precision.rules.groups.diffusion import is_lora_network

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().parent / "kohya_runner.py"
ENV_SNAPSHOT = "HF_PRECISION_SD_SCRIPTS"
kohya_run = pytest.mark.kohya


def snapshot() -> Path | None:
    """The sd-scripts archive or folder: ``$HF_PRECISION_SD_SCRIPTS``, else the newest
    ``upstream/sd-scripts-*.tar.gz`` in a folder beside the checkout."""
    named = os.environ.get(ENV_SNAPSHOT)
    if named:
        return Path(named)
    found = sorted(REPO.parent.glob("*/upstream/sd-scripts-*.tar.gz"))
    return found[-1] if found else None


@pytest.fixture(scope="module")
def sd(kohya_venv: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """sd-scripts unpacked, the tiny SD 1.5 (diffusers folder), its tokenizer where
    ``--tokenizer_cache_dir`` looks, and four 64x64 images with captions."""
    src = snapshot()
    if src is None or not src.exists():
        pytest.skip(
            f"no sd-scripts snapshot: set {ENV_SNAPSHOT} to a sd-scripts-<commit>.tar.gz (git "
            "archive of kohya-ss/sd-scripts) or its unpacked folder, or put it in an "
            "upstream/ folder beside the checkout"
        )
    from PIL import Image

    from hf_precision.tiny.sd_pipeline import save_tiny_sd15_pipeline

    root = tmp_path_factory.mktemp("kohya")
    if src.is_dir():
        scripts = src
    else:
        with tarfile.open(src) as tar:
            tar.extractall(root / "src", filter="data")
        (scripts,) = (root / "src").iterdir()
    model = save_tiny_sd15_pipeline(root / "sd15")
    shutil.copytree(model / "tokenizer", root / "tok" / "openai_clip-vit-large-patch14")
    data = root / "data" / "1_cat"  # sd-scripts' DreamBooth layout: <repeats>_<name>/
    data.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        pixels = torch.randint(0, 256, (64, 64, 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text("a cat")
    return {"venv": kohya_venv, "scripts": scripts, "root": root}


def train(sd: dict[str, Any], out: Path, *flags: str, guard: str | None = None) -> Any:
    """``[hf-precision run ... --] accelerate launch kohya_runner.py train_network.py ...``:
    three steps of LoRA (rank 4, alpha 0.3) on the tiny SD 1.5, 64x64, batch 2."""
    root, venv = sd["root"], sd["venv"]
    cmd = [str(venv.bin / "accelerate"), "launch", "--num_processes", "1", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", str(RUNNER)]
    cmd += [str(sd["scripts"] / "train_network.py"), "--pretrained_model_name_or_path"]
    cmd += [str(root / "sd15"), "--tokenizer_cache_dir", str(root / "tok"), "--train_data_dir"]
    cmd += [str(root / "data"), "--caption_extension", ".txt", "--resolution", "64"]
    cmd += ["--train_batch_size", "2", "--max_train_steps", "3", "--network_module"]
    cmd += ["networks.lora", "--network_dim", "4", "--network_alpha", "0.3", "--output_dir"]
    cmd += [str(out), "--output_name", "lora", "--save_model_as", "safetensors", "--seed", "0"]
    cmd += ["--max_data_loader_n_workers", "0", "--optimizer_type", "AdamW"]
    cmd += ["--learning_rate", "1e-3", *flags]
    if guard is not None:
        cmd = [sys.executable, "-m", "hf_precision", "run", *guard.split(), "--", *cmd]
    out.mkdir(parents=True, exist_ok=True)
    return venv.run(cmd, cwd=out, COLUMNS="2000")  # sd-scripts logs through rich: no wrapping


def saved(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "lora.safetensors")


def raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def events(out: Path) -> dict[str, dict[str, Any]]:
    """The dtype-map events of a run (a finding's own JSON, such as the lost updates', aside)."""
    found = {p.stem: json.loads(p.read_text()) for p in (out / "precision").glob("*.json")}
    return {n: e for n, e in found.items() if "dtype_map" in e}


@kohya_run
def test_bf16_keeps_what_kohya_saves_and_reports_where_its_user_looks(sd, tmp_path):
    """Items 1 and 3: under --mixed_precision bf16 the guard casts no LoRA alpha (0-D), so the
    saved file has kohya's own dtypes and kohya's own alpha bytes (float32 0.30000001, not
    bfloat16 0.30078125); the reports are in --output_dir, each model compared with itself,
    the network its own group, kohya's batch keys known, the pipeline it loads reported."""
    plain = train(sd, tmp_path / "plain", "--mixed_precision", "bf16")
    assert plain.returncode == 0, plain.stdout[-3000:]
    guarded = train(sd, tmp_path / "guarded", "--mixed_precision", "bf16", guard="")
    assert guarded.returncode == 0, guarded.stdout[-3000:]
    own, ours = saved(tmp_path / "plain"), saved(tmp_path / "guarded")
    assert own.keys() == ours.keys()
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in own.items()}
    alphas = [k for k in own if k.endswith(".alpha")]
    assert len(alphas) > 100 and all(raw(own[k]) == raw(ours[k]) for k in alphas)
    assert ours[alphas[0]].item() == torch.tensor(0.3).item()

    said = guarded.stdout
    out = tmp_path / "guarded"
    assert f"reports in {out / 'precision'}{os.sep}" in said
    assert "train_network.py --mixed_precision bf16 (via hf-precision run)" in said
    assert not (tmp_path / "plain" / "precision").exists()
    found = events(out)
    groups = {n: set(e["dtype_map"]["groups"]) for n, e in found.items()}
    assert {"unet"} in groups.values() and {"text_encoder"} in groups.values()
    assert {kohya.GROUP} in groups.values()  # the network, not "other"
    for name, event in found.items():  # no other model's modules as "(absent)"
        assert not [r for r in event["drift"] if r["after"] == "(absent)"], name
    network = next(e for e in found.values() if set(e["dtype_map"]["groups"]) == {kohya.GROUP})
    assert network["provenance"]["line"] == (
        "precision: bf16 — train_network.py's --mixed_precision bf16"
    )
    assert "as given" not in said and "alone keep" not in said
    assert "loss_weights" not in said and "network_multipliers" not in said
    loaded = [e for n, e in found.items() if n.startswith("000000-load_pipeline")]
    assert loaded and sum(e["hooks"]["pre_hooks"] for e in loaded) > 100
    log = (out / "precision" / "precision.log").read_text()
    assert log.index("load_pipeline") < log.index("setup")  # the first events


@kohya_run
def test_full_bf16_is_named_when_undone_and_dropped_first_in_audit(sd, tmp_path):
    """Item 2: --full_bf16 casts the LoRA network to bf16. In fix mode the guard holds it in
    float32 and its lines name --full_bf16; in audit mode the lost-update warning offers
    sd-scripts' own fix (drop --full_bf16) first."""
    fixed = train(sd, tmp_path / "fix", "--mixed_precision", "bf16", "--full_bf16", guard="")
    assert fixed.returncode == 0, fixed.stdout[-3000:]
    weights = {k: v.dtype for k, v in saved(tmp_path / "fix").items()}
    assert {d for k, d in weights.items() if not k.endswith(".alpha")} == {torch.float32}
    assert {d for k, d in weights.items() if k.endswith(".alpha")} == {torch.bfloat16}  # kohya's
    flat = " ".join(fixed.stdout.split())
    assert "precision guard on for train_network.py --mixed_precision bf16 --full_bf16" in flat
    assert "inferred from train_network.py's --mixed_precision bf16 --full_bf16; undoing " in flat
    assert "→ float32 (trainable) in lora_network" in flat

    audit = train(
        sd, tmp_path / "audit", "--mixed_precision", "bf16", "--full_bf16", guard="--mode audit"
    )
    assert audit.returncode == 0, audit.stdout[-3000:]
    assert {v.dtype for v in saved(tmp_path / "audit").values()} == {torch.bfloat16}
    flat = " ".join(audit.stdout.split())
    assert "updates lost in bfloat16" in flat
    assert "Fix: drop --full_bf16 (sd-scripts then keeps the LoRA network in float32" in flat
    assert "undoing" not in flat  # audit undoes nothing


@kohya_run
def test_fp8_base_on_a_cpu_is_refused_before_step_1(sd, tmp_path):
    """Item 5: --fp8_base stores the UNet in fp8 e4m3, norms included; a CPU stops in its first
    GroupNorm. Refused in one line naming fp8 and the fix, before anything is trained."""
    proc = train(sd, tmp_path / "fp8", "--mixed_precision", "bf16", "--fp8_base", guard="")
    assert proc.returncode != 0
    line = next(x for x in proc.stdout.splitlines() if x.startswith("hf_precision.errors."))
    assert "--fp8_base on a CPU" in line and "float8_e4m3fn (fp8 e4m3)" in line
    assert line.endswith("Fix: drop --fp8_base on a CPU (fp8 storage needs a GPU).")
    assert "steps:" not in proc.stdout and not (tmp_path / "fp8" / "lora.safetensors").exists()


# --------------------------------------------------------------------- without sd-scripts
def _namespace(**kw: Any) -> argparse.Namespace:
    base = {"network_module": "networks.lora", "output_dir": "/runs/lora"}
    base.update(mixed_precision="bf16", full_bf16=False, full_fp16=False, fp8_base=False)
    return argparse.Namespace(**{**base, **kw})


def test_detect_reads_the_runs_arguments_from_the_stack(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/src/sdxl_train_network.py", "--full_bf16"])
    assert kohya.detect() is None  # no sd-scripts run here

    def train(args: argparse.Namespace) -> Any:  # NetworkTrainer.train holds `args`
        return kohya.detect(None)

    run = train(_namespace(full_bf16=True))
    assert run is not None and run.program == "sdxl_train_network.py" and run.tool == "kohya"
    assert run.report_dir() == os.path.join("/runs/lora", "precision")
    assert dict(run.settings) == {"--mixed_precision": "bf16", "--full_bf16": True}
    assert run.undone and "--full_bf16" in run.undone[0]
    assert run.own_fix.startswith("drop --full_bf16")
    assert run.said.startswith("sdxl_train_network.py's --mixed_precision bf16 --full_bf16; ")
    assert set(kohya.METADATA_KEYS) <= set(run.metadata_keys)


def test_fp8_base_reads_storage_and_compute_and_refuses_a_cpu() -> None:
    def train(args: argparse.Namespace, device: str) -> Any:
        return kohya.detect(argparse.Namespace(device=device))

    gpu = train(_namespace(fp8_base=True), "cuda:0")
    assert gpu is not None and gpu.refusal is None
    assert "weights fp8 e4m3 (float8_e4m3fn storage), compute bf16" in gpu.notes[0]
    cpu = train(_namespace(fp8_base=True), "cpu")
    assert cpu is not None and cpu.refusal is not None and "\n" not in cpu.refusal
    assert "fp8" in cpu.refusal and cpu.refusal.endswith("(fp8 storage needs a GPU).")


def test_the_network_is_its_own_group() -> None:
    from torch import nn

    from hf_precision.rules.groups.module_groups import find_module_groups

    net_cls = type("LoRANetwork", (nn.Module,), {"__module__": "networks.lora"})
    net = net_cls()
    net.lora_down = nn.Linear(4, 2)
    assert is_lora_network(net) and not is_lora_network(nn.Linear(2, 2))

    def train(args: argparse.Namespace) -> Any:
        return kohya.detect(None)

    train(_namespace())  # registers the group and its rule
    assert find_module_groups(net).group_of("lora_down.weight") == kohya.GROUP
