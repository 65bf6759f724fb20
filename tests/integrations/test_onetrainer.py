"""OneTrainer (:mod:`hf_precision.integrations.onetrainer`): the policy from its config words,
the sampling scope that reaches modules built inside a sampler call, and (``make
test-onetrainer``, marker ``onetrainer``) OneTrainer's own ``scripts/train.py`` on a tiny SD 1.5
inpainting model, unguarded and under ``hf-precision run``, in its own venvs.

The leg unpacks snapshots of OneTrainer and mgds (``git archive`` tarballs, AGPL: run, never
copied into this repository) from ``$HF_PRECISION_UPSTREAM`` (default: an ``upstream/`` folder
beside this checkout); absent, the leg skips and says so.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn

from hf_precision.integrations import onetrainer

from .conftest import Venv

ROOT = Path(__file__).resolve().parents[2]


class DataType(enum.Enum):
    """OneTrainer's ``modules.util.enum.DataType`` members the config words use (OneTrainer is
    not installed in this venv; the leg below runs its own)."""

    FLOAT_32 = "FLOAT_32"
    FLOAT_16 = "FLOAT_16"
    BFLOAT_16 = "BFLOAT_16"
    FLOAT_8 = "FLOAT_8"


def words(train: str, fallback: str = "BFLOAT_16", **parts: str) -> NS:
    return NS(
        train_dtype=DataType[train],
        fallback_train_dtype=DataType[fallback],
        **{p: NS(weight_dtype=DataType[d]) for p, d in parts.items()},
    )


# ----------------------------------------------------------------------- policy from words
@pytest.mark.parametrize(
    ("train", "preset", "trainable"),
    [("FLOAT_16", "fp16", torch.float32), ("BFLOAT_16", "bf16", torch.float32)],
)
def test_train_dtype_names_the_preset(train, preset, trainable):
    """``train_dtype: FLOAT_16`` is the ``fp16`` preset (frozen fp16, trained fp32), as
    ``fp16=True`` is for the Trainer; each part's ``weight_dtype`` is its group's dtype."""
    cfg = words(train, unet="FLOAT_16", text_encoder="FLOAT_16", vae="FLOAT_32")
    policy = onetrainer.policy_from_config(cfg, ("unet", "text_encoder", "vae"))
    assert policy.name == preset
    assert policy.trainable_dtype == trainable
    assert policy.group_dtypes == {
        "unet": torch.float16,
        "text_encoder": torch.float16,
        "vae": torch.float32,
    }


def test_quantized_weight_dtypes_are_left_as_loaded():
    cfg = words("FLOAT_16", unet="FLOAT_8", vae="FLOAT_32")
    policy = onetrainer.policy_from_config(cfg, ("unet", "vae"))
    assert policy.group_dtypes == {"vae": torch.float32}  # FLOAT_8 belongs to its library


def test_parts_are_found_by_onetrainers_attribute_names():
    a, b, c = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)
    model = NS(unet=a, text_encoder_1=b, text_encoder_2=c, vae=None, train_config=object())
    assert onetrainer.parts_of(model) == {"unet": a, "text_encoder": b, "text_encoder_2": c}


# ----------------------------------------------------------------------- sampling scope
def _erode() -> nn.Conv2d:
    """What OneTrainer's inpainting sampler builds on every call: an fp32 conv."""
    conv = nn.Conv2d(1, 1, 5, bias=False, padding=2, padding_mode="replicate")
    conv.weight.data = torch.ones(1, 1, 5, 5) / 25
    return conv.requires_grad_(False)


def test_a_module_built_inside_the_scope_is_reached(caplog):
    mask = torch.rand(1, 16, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError):  # as OneTrainer meets it (on a GPU: "Input type ...")
        _erode()(mask)
    said: set[str] = set()
    with caplog.at_level("WARNING", logger="hf_precision"), onetrainer.reach_new_modules({}, said):
        out = _erode()(mask)
        again = _erode()(mask)  # one line per kind of module, not per call
    assert out.dtype == torch.float32 and torch.equal(out, again)
    assert said == {"Conv2d (float32 weights)"}
    lines = [r.getMessage() for r in caplog.records if "sampler built" in r.getMessage()]
    assert len(lines) == 1 and "float16 input" in lines[0], lines
    with pytest.raises(RuntimeError):  # the global hook is gone after the scope
        _erode()(mask)


def test_the_scope_leaves_guarded_modules_and_out_of_range_values_alone():
    known_conv = _erode()
    x = torch.rand(1, 8, 8, dtype=torch.float16)
    half = nn.Linear(8, 8).half()
    big = torch.full((1, 8), 1e6)  # float32 values float16 cannot hold
    with onetrainer.reach_new_modules({id(known_conv): known_conv}, set()):
        with pytest.raises(RuntimeError):  # a guarded model's own hooks decide there
            known_conv(x)
        with pytest.raises(RuntimeError):  # narrowing would turn 1e6 into inf: not done
            half(big)
        assert half(torch.ones(1, 8)).dtype == torch.float16  # in range: narrowed


# ----------------------------------------------------------------------- the patch
def test_start_is_wrapped_once_and_guards_after_the_original(monkeypatch):
    calls = []

    class GenericTrainer:
        def start(self):
            calls.append("start")

    monkeypatch.setattr(onetrainer, "guard_trainer", lambda t: calls.append("guard"))
    monkeypatch.setenv("HF_PRECISION_GUARD", "auto")
    assert onetrainer.patch_generic_trainer(GenericTrainer)
    assert not onetrainer.patch_generic_trainer(GenericTrainer)  # idempotent
    GenericTrainer().start()
    monkeypatch.setenv("HF_PRECISION_GUARD", "off")
    GenericTrainer().start()
    assert calls == ["start", "guard", "start"]


# ======================================================================= OneTrainer's own code
def _upstream() -> Path:
    """``$HF_PRECISION_UPSTREAM``, else the first ``upstream/`` folder beside the checkout that
    holds a OneTrainer snapshot."""
    if os.environ.get("HF_PRECISION_UPSTREAM"):
        return Path(os.environ["HF_PRECISION_UPSTREAM"])
    found = sorted(ROOT.parent.glob("*/upstream/onetrainer-*.tar.gz"))
    return found[0].parent if found else ROOT.parent / "upstream"


UPSTREAM = _upstream()
OT_2024, OT_TODAY = "onetrainer-889ddd21", "onetrainer-23df3832"
#: mgds before its GenerateImageLike dtype fix (latent_mask fp32), the fix, today's
MGDS_2024, MGDS_FIXED, MGDS_TODAY = "mgds-5ea389a", "mgds-901d076", "mgds-3a6994a"
#: each OneTrainer's config version (its TrainConfig's migrations run up to it)
CONFIG_VERSION = {OT_2024: 4, OT_TODAY: 11}
VENVS = {
    OT_2024: Path(
        os.environ.get("HF_PRECISION_ONETRAINER2024_VENV", ROOT / ".venv-onetrainer2024")
    ),
    OT_TODAY: Path(os.environ.get("HF_PRECISION_ONETRAINER_VENV", ROOT / ".venv-onetrainer")),
}
BUILD = """
import sys, torch
from pathlib import Path
from PIL import Image
from hf_precision.tiny.sd_pipeline import save_tiny_sd_inpainting_pipeline
root = Path(sys.argv[1])
save_tiny_sd_inpainting_pipeline(root / "model")
(root / "data").mkdir()
g = torch.Generator().manual_seed(0)
for i in range(2):
    px = torch.randint(0, 256, (64, 64, 3), generator=g, dtype=torch.uint8)
    Image.fromarray(px.numpy()).save(root / "data" / f"{i}.png")
    (root / "data" / f"{i}.txt").write_text("a cat")
mask = torch.zeros(64, 64, dtype=torch.uint8)
mask[16:48, 16:48] = 255
Image.fromarray(mask.numpy()).save(root / "mask.png")
"""


def onetrainer_config(root: Path, version: int) -> dict:
    """A full fine-tune with fp16 weights for every part (``train_dtype`` ``FLOAT_16``, the
    default), debug decodes and one inpainting sample per step, on the CPU."""
    fp16 = {"weight_dtype": "FLOAT_16"}
    sample = {"prompt": "a cat", "height": 64, "width": 64, "diffusion_steps": 2}
    sample.update(
        sample_inpainting=True,
        base_image_path=str(root / "data" / "0.png"),
        mask_image_path=str(root / "mask.png"),
    )
    return {
        "__version": version,
        "model_type": "STABLE_DIFFUSION_15_INPAINTING",
        "training_method": "FINE_TUNE",
        "base_model_name": str(root / "model"),
        "weight_dtype": "FLOAT_16",
        "output_dtype": "FLOAT_32",
        "train_dtype": "FLOAT_16",
        **{part: dict(fp16) for part in ("unet", "text_encoder", "vae")},
        "train_device": "cpu",
        "temp_device": "cpu",
        "workspace_dir": str(root / "ws"),
        "cache_dir": str(root / "cache"),
        "debug_mode": True,
        "debug_dir": str(root / "debug"),
        "output_model_destination": str(root / "out"),
        "output_model_format": "DIFFUSERS",
        "resolution": "64",
        "batch_size": 1,
        "epochs": 1,
        "learning_rate_warmup_steps": 0,
        "attention_mechanism": "DEFAULT",
        "gradient_checkpointing": False,
        "dataloader_threads": 1,
        "tensorboard": False,
        "optimizer": {"optimizer": "ADAMW"},
        "concepts": [
            {
                "name": "c",
                "path": str(root / "data"),
                "image": {"enable_crop_jitter": False, "enable_random_flip": False},
            }
        ],
        "samples": [sample],
        "sample_after": 1,
        "sample_after_unit": "STEP",
        "backup_after": 0,
        "backup_after_unit": "NEVER",
    }


def _snapshot(name: str) -> Path:
    found = sorted(UPSTREAM.glob(f"{name}*.tar.gz"))
    if not found:
        pytest.skip(
            f"no {name}*.tar.gz in {UPSTREAM}: the OneTrainer leg runs OneTrainer's and mgds' "
            "own code from their snapshots. Set HF_PRECISION_UPSTREAM to the folder holding them."
        )
    return found[0]


def _venv(ot: str) -> Path:
    venv = VENVS[ot]
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no venv at {venv} for {ot}. Fix: make test-onetrainer (it creates it).")
    return venv


class Run(NS):
    """One ``scripts/train.py`` process: its output, exit code and run folder."""

    def losses(self) -> list[float]:
        return [float(v) for v in re.findall(r"[ ,]loss=([-+0-9.e]+|nan|inf)", self.out)]


def _env(venv: Path, mgds: Path, ot: Path) -> dict[str, str]:
    """The venv's environment (:meth:`.conftest.Venv.env`) with OneTrainer and its mgds first
    on ``PYTHONPATH``, then this checkout."""
    return Venv(venv.name, venv).env(
        PYTHONPATH=os.pathsep.join([str(mgds / "src"), str(ot), str(ROOT)])
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """Every run of the leg, started together (two cores) and awaited once."""
    src = tmp_path_factory.mktemp("upstream")
    for name in (OT_2024, OT_TODAY, MGDS_2024, MGDS_FIXED, MGDS_TODAY):
        with tarfile.open(_snapshot(name)) as tar:
            tar.extractall(src / name, filter="data")
    plan = {  # name: (OneTrainer, mgds, guarded)
        "2024": (OT_2024, MGDS_2024, False),
        "2024-mgds-fixed": (OT_2024, MGDS_FIXED, False),
        "2024-guarded": (OT_2024, MGDS_2024, True),
        "today": (OT_TODAY, MGDS_TODAY, False),
        "today-guarded": (OT_TODAY, MGDS_TODAY, True),
    }
    procs = {}
    for name, (ot, mgds, guarded) in plan.items():
        venv, root = _venv(ot), tmp_path_factory.mktemp(name)
        env = _env(venv, src / mgds / "mgds", src / ot / "OneTrainer")
        python = str(venv / "bin" / "python")
        subprocess.run([python, "-c", BUILD, str(root)], env=env, check=True, timeout=600)
        cfg = root / "cfg.json"
        cfg.write_text(json.dumps(onetrainer_config(root, CONFIG_VERSION[ot])))
        cmd = [python, "scripts/train.py", "--config-path", str(cfg)]
        if guarded:
            cmd = [python, "-m", "hf_precision", "run", "--", *cmd]
        log = (root / "run.log").open("w")
        proc = subprocess.Popen(
            cmd, cwd=src / ot / "OneTrainer", env=env, stdout=log, stderr=subprocess.STDOUT
        )
        procs[name] = (proc, root, log)
    out = {}
    for name, (proc, root, log) in procs.items():
        rc = proc.wait(timeout=900)
        log.close()
        text = (root / "run.log").read_text(errors="replace").replace("\r", "\n")
        out[name] = Run(rc=rc, out=text, root=root)
    return out


FAILURE_1 = "mat1 and mat2 must have the same dtype, but got Float and Half"
#: on a CPU; on a GPU: "Input type (torch.cuda.HalfTensor) and weight type (...FloatTensor)"
FAILURE_2 = "expected scalar type Half but found Float"
FAILURE_3 = "Input type (float) and bias type (c10::Half) should be the same"


@pytest.mark.onetrainer
def test_the_2024_code_shows_the_four_failures_unguarded(runs):
    """OneTrainer 889ddd21 with mgds 5ea389a, fp16 weights for every part: the sampler's erode
    conv (built per call, fp32) fails and OneTrainer samples nothing (2), then step 1 stops in
    the UNet's time embedding (1), because mgds made ``latent_mask`` fp32 (4): with mgds' fix
    (901d076) step 1 passes the UNet and stops in the debug ``vae.decode`` (3)."""
    first, fixed = runs["2024"], runs["2024-mgds-fixed"]
    assert first.rc != 0 and FAILURE_1 in first.out, first.out[-3000:]
    assert "self.time_embedding(" in first.out
    for run in (first, fixed):
        assert FAILURE_2 in run.out and "erode_kernel(mask)" in run.out, run.out[-3000:]
        assert "Error during sampling, proceeding without sampling" in run.out
    assert fixed.rc != 0 and FAILURE_1 not in fixed.out, fixed.out[-3000:]
    assert FAILURE_3 in fixed.out and "model.vae.decode(" in fixed.out
    assert "hf-precision" not in first.out + fixed.out


@pytest.mark.onetrainer
def test_the_2024_code_under_the_launcher_trains_samples_and_saves(runs):
    run = runs["2024-guarded"]
    assert run.rc == 0, run.out[-4000:]
    for failure in (FAILURE_1, FAILURE_2, FAILURE_3, "Error during sampling"):
        assert failure not in run.out, failure
    line = next(x for x in run.out.splitlines() if "precision guard on for OneTrainer" in x)
    assert "StableDiffusionModel (unet, text_encoder, vae;" in line
    assert "policy fp16 (frozen float16, trainable float32" in line
    assert 'from OneTrainer\'s "train_dtype": "FLOAT_16"' in line
    assert '"train_dtype": "BFLOAT_16"' in line and "--policy fp16-true" in line  # opt-outs
    assert f"reports in {run.root / 'ws' / 'precision'}" in line
    assert "sampler built a Conv2d (float32 weights) during sampling" in run.out
    losses = run.losses()
    assert len(losses) >= 2 and all(math.isfinite(v) for v in losses), losses
    setup = json.loads((run.root / "ws" / "precision" / "000000-setup-unet.json").read_text())
    assert "float32" in json.dumps(setup) and "float16" in json.dumps(setup)
    assert (run.root / "out" / "unet").is_dir()  # the fine-tune was saved


@pytest.mark.onetrainer
def test_todays_fp16_fine_tune_is_finite_under_the_launcher(runs):
    """OneTrainer 23df3832: fp16 weights, ``train_dtype`` FLOAT_16. Unguarded, AdamW's eps
    (1e-8, 0 in float16) makes step 2's loss NaN; under the launcher (the ``fp16`` preset:
    trained weights fp32) every step is finite and the run ends."""
    bare, guarded = runs["today"], runs["today-guarded"]
    assert bare.rc != 0 and "Training loss became NaN" in bare.out, bare.out[-3000:]
    assert guarded.rc == 0, guarded.out[-4000:]
    losses = guarded.losses()
    assert len(losses) >= 2 and all(math.isfinite(v) for v in losses), losses
    assert "precision guard on for OneTrainer" in guarded.out
