"""``hf-precision doctor`` and ``audit`` on checkpoints shaped unlike the package's tiny models:
other vocab sizes, image token ids and image sizes, stored split (vision fp32, language bf16)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hf_precision.tools.cli import main

TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


def _llava() -> Any:  # SigLIP tower, 48 px / patch 8, Qwen2 text, vocab 400, image token 399
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    return LlavaForConditionalGeneration(
        LlavaConfig(
            vision_config={
                "model_type": "siglip_vision_model",
                "image_size": 48,
                "patch_size": 8,
                **VISION,
            },
            text_config={"model_type": "qwen2", "vocab_size": 400, **TEXT},
            image_token_id=399,
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
        )
    )


def _paligemma() -> Any:  # 40 px / patch 8 (25 tokens), vocab 300, image token 7
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    return PaliGemmaForConditionalGeneration(
        PaliGemmaConfig(
            vision_config={
                "model_type": "siglip_vision_model",
                "image_size": 40,
                "patch_size": 8,
                "projection_dim": 32,
                **VISION,
            },
            text_config={"model_type": "gemma", "vocab_size": 300, "head_dim": 16, **TEXT},
            image_token_id=7,
            projection_dim=32,
        )
    )


def _idefics3() -> Any:  # 48 px / patch 8, scale factor 2 (9 tokens), vocab 500, token 450
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration(
        Idefics3Config(
            vision_config={"image_size": 48, "patch_size": 8, **VISION},
            text_config={"model_type": "llama", "vocab_size": 500, **TEXT},
            image_token_id=450,
            scale_factor=2,
        )
    )


BUILDERS = {"llava": _llava, "paligemma": _paligemma, "idefics3": _idefics3}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, build in BUILDERS.items():
        torch.manual_seed(0)
        model = build()
        lm = getattr(model.model, "language_model", None) or model.model.text_model
        lm.to(torch.bfloat16)  # stored split: vision fp32, language model bf16
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = folder
    return out


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_doctor_runs_on_checkpoints_of_other_shapes(
    arch: str, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["doctor", str(checkpoints[arch]), "--policy", "bf16", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ok"], data
    assert set(data["diagnosis"]) == {"train", "generate"}


def test_doctor_says_which_value_it_needs_instead_of_a_traceback(
    checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["doctor", str(checkpoints["llava"]), "--image-token-id", "5", "--no-generate"])
    assert code == 2
    err = capsys.readouterr().err
    assert "does not fit LlavaForConditionalGeneration" in err and "--image-token-id N" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_audit_shows_the_split_as_stored(
    arch: str, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", str(checkpoints[arch]), "--json"]) == 1  # the vision side is fp32
    data = json.loads(capsys.readouterr().out)
    groups = {g["group"]: g["dtypes"] for g in data["groups"]}
    assert groups["vision_encoder"] == "float32" and groups["language_model"] == "bfloat16"
    assert data["dtype_from"].startswith("as stored in the safetensors files")
    assert "the rest" not in data["dtype_from"]  # every stored tensor found its module


def test_audit_of_a_bare_model_type_says_where_its_dtype_comes_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # no config dtype; nothing trainable: the frozen dtype is the policy's
    assert main(["audit", "llava", "--policy", "bf16", "--trainable", "none", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "dtypes: the policy's dtype (the config declares none)" in out and "OK:" in out
    assert main(["audit", "paligemma", "--trainable", "none", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "tied: lm_head.weight -> model.language_model.embed_tokens.weight" in out
    assert "ok (tied)" in out


@pytest.mark.slow
def test_every_architecture_the_rules_know_audits_without_an_exception(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_precision.rules.groups.registry import group_rules

    types = sorted({t for r in group_rules() for t in r.model_types} & set(CONFIG_MAPPING_NAMES))
    assert len(types) > 40
    slow = []
    for mt in types:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = main(["audit", mt, "--json"])  # a clean CLI error (2) is an answer too
        out = capsys.readouterr()
        assert code in (0, 1, 2), (mt, code)
        if code in (0, 1):
            assert json.loads(out.out)["model_type"], mt
        else:
            # transformers may log its own warnings first (once per process): ours is the last line
            assert out.err.splitlines()[-1].startswith("hf-precision: error:"), (mt, out.err)
        slow.append((time.perf_counter() - t0, mt))
    assert max(slow)[0] < 60, max(slow)


# ---------------------------------------------------------------------------- Hub ids
def _hub_cache(root: Path, repo_id: str, folder: Path, files: tuple[str, ...]) -> Path:
    """The layout huggingface_hub's cache has: blobs, a snapshot of symlinks, refs/main."""
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, name in enumerate(files):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes((folder / name).read_bytes())
        (snap / name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


@pytest.fixture(scope="module")
def hf_home(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Hugging Face cache with ``tiny/llava-split`` (config + weights) and
    ``tiny/llava-config`` (the config only, as ``hf download --include '*.json'`` leaves it)."""
    root = tmp_path_factory.mktemp("hf_home")
    _hub_cache(root, "tiny/llava-split", checkpoints["llava"], ("config.json", "model.safetensors"))
    _hub_cache(root, "tiny/llava-config", checkpoints["llava"], ("config.json",))
    return root


def test_audit_of_a_hub_id_reads_the_local_cache_offline(hf_home: Path) -> None:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "hf_precision", "audit", "tiny/llava-split", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]  # vision fp32 under bf16
    data = json.loads(proc.stdout)
    assert "local Hugging Face cache, offline (HF_HUB_OFFLINE=1)" in data["note"]
    groups = {g["group"]: g["dtypes"] for g in data["groups"]}
    assert groups["vision_encoder"] == "float32" and groups["language_model"] == "bfloat16"
    assert data["dtype_from"].startswith("as stored in the safetensors files")


def test_a_hub_id_missing_from_the_cache_says_so(
    hf_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["audit", "Qwen/Qwen2-VL-7B-Instruct"]) == 2
    err = capsys.readouterr().err
    assert (
        "no folder Qwen/Qwen2-VL-7B-Instruct here" in err
        and "and as a Hub id it is not in the local" in err
    )
    assert "HF_HUB_OFFLINE=1" in err and err.count("\n") == 1
    # a cached config without weights: the config's dtype (float32), and the note says why
    assert main(["audit", "tiny/llava-config", "--policy", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dtype_from"].startswith("the config's dtype (no safetensors files")
    assert "local Hugging Face cache" in data["note"]


# ---------------------------------------------------------------------------- PEFT adapters
@pytest.fixture(scope="module")
def adapters(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LoRA adapters of the split LLaVA checkpoint, saved fp32 and bf16."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    root = tmp_path_factory.mktemp("adapters")
    base = LlavaForConditionalGeneration.from_pretrained(checkpoints["llava"])
    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(base, config)
    peft_model.peft_config["default"].base_model_name_or_path = str(checkpoints["llava"])
    peft_model.save_pretrained(root / "fp32")
    peft_model.to(torch.bfloat16).save_pretrained(root / "bf16")
    return root


def test_audit_of_a_peft_adapter_folder(
    adapters: Path, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", str(adapters / "fp32"), "--policy", "bf16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "adapter" and data["base_model"] == str(checkpoints["llava"])
    assert data["peft_type"] == "LORA" and data["built"].startswith("nothing")
    rows = {r["group"]: r for r in data["groups"]}
    # q_proj/v_proj of the SigLIP tower and of the Qwen2 language model, placed by the base
    assert set(rows) == {"vision_encoder", "language_model"}
    assert all(set(r["numel"]) == {"float32"} and r["trainable"] for r in rows.values())
    # bf16 adapter weights against a policy that trains in fp32
    assert main(["audit", str(adapters / "bf16"), "--policy", "bf16", "--plain"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATES" in out and "bfloat16:" in out and "to cast" in out
    assert "autocast_adapter_dtype" in out


# ---------------------------------------------------------------------------- diffusers
@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A diffusers folder: unet and text encoder fp16, vae fp32 (what fp16-vae32 wants)."""
    from hf_precision.tiny.diffusion import tiny_text_encoder, tiny_unet, tiny_vae

    root = tmp_path_factory.mktemp("pipeline")
    tiny_unet().to(torch.float16).save_pretrained(root / "unet")
    tiny_vae().save_pretrained(root / "vae")
    tiny_text_encoder().to(torch.float16).save_pretrained(root / "text_encoder")
    (root / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "StableDiffusionPipeline",
                "unet": ["diffusers", "UNet2DConditionModel"],
                "vae": ["diffusers", "AutoencoderKL"],
                "text_encoder": ["transformers", "CLIPTextModel"],
                "tokenizer": ["transformers", "CLIPTokenizer"],
                "scheduler": ["diffusers", "DDPMScheduler"],
            }
        )
    )
    return root


def test_audit_of_a_diffusers_folder_per_component(
    pipeline: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["audit", str(pipeline), "--policy", "fp16-vae32", "--trainable", "none", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["component"]: r for r in data["groups"]}
    assert set(rows) == {"unet", "vae", "text_encoder"}
    assert {k: set(r["numel"]) for k, r in rows.items()} == {
        "unet": {"float16"},
        "vae": {"float32"},
        "text_encoder": {"float16"},
    }
    assert {k: r["policy"] for k, r in rows.items()} == {
        "unet": "float16",
        "vae": "float32",
        "text_encoder": "float16",
    }
    # the same folder against fp16 everywhere: the fp32 VAE is what would be cast
    assert (
        main(["audit", str(pipeline), "--policy", "fp16-true", "--trainable", "none", "--json"])
        == 1
    )
    data = json.loads(capsys.readouterr().out)
    assert {r["component"] for r in data["groups"] if r["to_cast"]} == {"vae"}


def test_audit_of_a_hub_id_online_reads_config_and_headers_only(
    checkpoints: dict[str, Path],
    hub_404: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Online, through huggingface_hub: the config file fetched, the dtypes from the Hub's
    safetensors metadata. The Hub is the one thing faked (no network here): its two calls
    answer from a real saved checkpoint, whose weights are not where the audit looks."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError

    from hf_precision.tools.weight_files import safetensors_headers

    shutil.copy(checkpoints["llava"] / "config.json", tmp_path / "config.json")  # no weights
    headers = safetensors_headers(sorted(checkpoints["llava"].glob("*.safetensors")))
    fetched: list[str] = []

    def hf_hub_download(repo_id: str, filename: str, **_: Any) -> str:
        fetched.append(filename)
        if not (tmp_path / filename).is_file():
            raise EntryNotFoundError(f"{repo_id}/{filename}")
        return str(tmp_path / filename)

    def get_safetensors_metadata(repo_id: str, **_: Any) -> Any:
        tensors = {
            k: SimpleNamespace(dtype=v["dtype"], shape=v["shape"]) for k, v in headers.items()
        }
        return SimpleNamespace(
            files_metadata={"model.safetensors": SimpleNamespace(tensors=tensors)}
        )

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", hub_404)  # reachable: the one look passes
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", get_safetensors_metadata)
    assert main(["audit", "tiny/llava-online", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert fetched == ["config.json"] and "the Hub (tiny/llava-online" in data["note"]
    groups = {g["group"]: g["dtypes"] for g in data["groups"]}
    assert groups["vision_encoder"] == "float32" and groups["language_model"] == "bfloat16"


def test_an_adapter_whose_base_is_not_here_still_audits(
    adapters: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = tmp_path / "adapter"
    shutil.copytree(adapters / "fp32", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "tiny/not-cached"
    (folder / "adapter_config.json").write_text(json.dumps(config))
    assert main(["audit", str(folder), "--json"]) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert [r["group"] for r in data["groups"]] == ["adapter"] and data["base_model"] == (
        "tiny/not-cached"
    )
    assert "base model tiny/not-cached is not readable here" in data["notes"][0]
    assert "error" not in out.err  # a note, not the command's error
