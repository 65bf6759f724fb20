"""The CLI on inputs a newcomer gets wrong (issue 28): weight files that cannot be read (empty,
truncated, corrupt, another format under a .safetensors name) end in one line naming the file,
with exit code 3 and never a verdict; a relative path that does not exist is a missing folder,
not a Hub id; a diffusers component folder (unet/, vae/) is audited. Real files throughout."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision.tiny import tiny_llava
from hf_precision.tools.cli import main
from hf_precision.tools.exits import EXIT_BAD_WEIGHTS


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA saved in bf16: clean against bf16 with nothing trained."""
    folder = tmp_path_factory.mktemp("good")
    tiny_llava(torch.bfloat16).save_pretrained(folder)
    return folder


def _empty(f: Path) -> None:
    f.write_bytes(b"")


def _truncated(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # the header intact, half the tensor data gone


def _garbage_header(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[8:40] = b"\x00\xff" * 16  # the length fits, the JSON does not parse
    f.write_bytes(bytes(data))


def _text(f: Path) -> None:
    f.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 42\n")


def _torch_zip(f: Path) -> None:
    torch.save({"w": torch.zeros(4)}, f)  # what a pytorch_model.bin holds


def _torch_pickle(f: Path) -> None:
    torch.save({"w": torch.zeros(4)}, f, _use_new_zipfile_serialization=False)


BREAKS: dict[str, tuple[Callable[[Path], None], str]] = {
    "empty": (_empty, "the file is empty"),
    "truncated": (_truncated, "truncated: the header places tensor data up to byte"),
    "garbage-header": (_garbage_header, "the header is not JSON"),
    "lfs-pointer-text": (_text, "not a safetensors file (its header length"),
    "torch-zip": (_torch_zip, "not a safetensors file (a zip archive"),
    "torch-pickle": (_torch_pickle, "not a safetensors file (a pickle"),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_unreadable_weights_give_one_line_and_exit_3(
    name: str, good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(good, folder)
    weights = folder / "model.safetensors"
    breaker, says = BREAKS[name]
    breaker(weights)
    assert main(["audit", str(folder), "--policy", "bf16"]) == EXIT_BAD_WEIGHTS == 3
    out, err = capsys.readouterr()
    assert (
        err
        == f"hf-precision: error: {weights}: cannot read the weights: "
        + err.split("cannot read the weights: ", 1)[1]
    )
    assert says in err and err.count("\n") == 1 and "Traceback" not in err
    assert "OK" not in out and "VIOLATES" not in out  # no verdict on weights it could not read


def test_a_missing_shard_is_said_before_any_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny_llava(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    shards[1].unlink()
    assert main(["audit", str(tmp_path)]) == 3
    out, err = capsys.readouterr()
    assert f"model.safetensors.index.json: cannot read the weights: 1 of its {len(shards)}" in err
    assert shards[1].name in err and "OK" not in out and "VIOLATES" not in out
    for shard in shards:  # the JSON files alone (hf download --include '*.json'): no weights
        shard.unlink(missing_ok=True)
    assert main(["audit", str(tmp_path), "--json"]) == 0
    assert "the config's dtype" in json.loads(capsys.readouterr().out)["dtype_from"]


@pytest.mark.parametrize("command", [["audit", "--weights"], ["doctor", "--no-generate"]])
def test_a_truncated_file_stops_every_command_that_reads_it(
    command: list[str], good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(good, folder)
    _truncated(folder / "model.safetensors")
    assert main([command[0], str(folder), *command[1:]]) == 3
    assert "truncated" in capsys.readouterr().err


def test_a_broken_adapter_or_component_file_is_said_alike(
    good: Path, components: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A PEFT adapter (saved by peft) and a diffusers component (saved by diffusers) whose
    weights were cut: the same one line and exit code 3, not a verdict from the header."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlavaForConditionalGeneration

    base = LlavaForConditionalGeneration.from_pretrained(good)
    adapter = tmp_path / "adapter"
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    unet = tmp_path / "unet"
    shutil.copytree(components / "unet", unet)
    for weights in (adapter / "adapter_model.safetensors", *unet.glob("*.safetensors")):
        _truncated(weights)
        assert main(["audit", str(weights.parent)]) == 3
        out, err = capsys.readouterr()
        assert f"{weights}: cannot read the weights: truncated" in err
        assert "OK" not in out and "VIOLATES" not in out


# ------------------------------------------------------------------ a missing relative path
@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The Hub online, and every huggingface_hub call that would reach it recorded (and
    refused): a missing folder must be said without one."""
    import huggingface_hub
    from huggingface_hub import constants

    called: list[str] = []

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            called.append(name)
            raise OSError(f"{name} called")

        return call

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("hf_hub_download", "snapshot_download", "get_safetensors_metadata"):
        monkeypatch.setattr(huggingface_hub, name, spy(name))
    return called


@pytest.mark.parametrize("source", ["work/ckpt", "./work/ckpt", "work/ckpt/", "work/a/b", "./x"])
def test_a_missing_relative_path_is_a_missing_folder_not_a_hub_id(
    source: str,
    no_hub: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "work").mkdir()  # work/ is here, work/ckpt is not: a mistyped path
    monkeypatch.chdir(tmp_path)
    for command in ("audit", "doctor"):
        assert main([command, source]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hf-precision: error: no such folder: {source}"), err
        assert err.count("\n") == 1
    assert no_hub == []


def test_an_owner_name_with_no_local_owner_is_still_a_hub_id(
    no_hub: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert main(["audit", "someone/model"]) == 2
    err = capsys.readouterr().err
    assert no_hub == []  # one look at the endpoint, refused: no download retried for a minute
    assert "no folder someone/model here" in err and "the Hub could not be reached" in err
    assert err.count("\n") == 1


def test_the_offline_hint_fetches_no_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    assert main(["audit", "someone/model"]) == 2
    err = capsys.readouterr().err
    assert "hf download someone/model --include '*.json'" in err
    # the hint once said it fetched "headers" with '*.safetensors', which downloads the weights
    assert "'*.json' '*.safetensors'" not in err and "download the whole weights" in err


# ------------------------------------------------------------------ a diffusers component
@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a user points at inside a pipeline folder: unet/ in fp16, vae/ in fp32, each saved
    by diffusers' save_pretrained (config.json with _class_name, no model_type)."""
    from hf_precision.tiny.diffusion import tiny_unet, tiny_vae

    root = tmp_path_factory.mktemp("sd")
    tiny_unet().to(torch.float16).save_pretrained(root / "unet")
    tiny_vae().save_pretrained(root / "vae")
    shutil.copytree(root / "unet", root / "my-finetune")  # a folder whose name says nothing
    return root


def test_audit_of_a_diffusers_component_folder(
    components: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "model_type" not in json.loads((components / "unet" / "config.json").read_text())
    argv = ["--trainable", "none", "--json"]
    assert main(["audit", str(components / "unet"), "--policy", "fp16", *argv]) == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["groups"]
    assert row["component"] == "unet" and row["group"] == "unet"
    assert set(row["numel"]) == {"float16"} and row["class"] == "diffusers.UNet2DConditionModel"
    # the VAE in fp32 is what fp16-vae32 wants, and what fp16-true would cast
    assert main(["audit", str(components / "vae"), "--policy", "fp16-vae32", *argv]) == 0
    capsys.readouterr()
    assert main(["audit", str(components / "vae"), "--policy", "fp16-true", *argv]) == 1
    assert json.loads(capsys.readouterr().out)["groups"][0]["to_cast"] > 0
    # the group comes from the class when the folder's name does not say it
    assert main(["audit", str(components / "my-finetune"), "--policy", "fp16", *argv]) == 0
    assert json.loads(capsys.readouterr().out)["groups"][0]["group"] == "unet"


def test_doctor_says_a_component_is_for_audit(
    components: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", str(components / "unet")]) == 2
    assert f"'hf-precision audit {components / 'unet'}'" in capsys.readouterr().err
