"""``hf-precision doctor``: it enforces the policy, runs a guarded step and generate(), and names
the root cause and the culprit of what still fails (checkpoints: tests/tools/test_cli.py and
tests/tools/test_cli_checkpoints.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision.tiny import tiny_llava
from hf_precision.tools.cli import main


def test_doctor_fixes_minicpmv_and_names_the_internvl_bug(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # MiniCPM-V 2's leak is a parameter (resampler.pos_embed made with .float()): the policy
    # casts it, and the guarded step runs clean
    assert main(["doctor", "minicpmv", "--policy", "bf16-true", "--no-generate"]) == 0
    out = capsys.readouterr().out
    assert "enforce: cast" in out and "OK: train ok" in out
    assert (
        main(
            [
                "doctor",
                "internvl_chat",
                "--policy",
                "bf16-true",
                "--batch",
                "raw",
                "--mode",
                "raise",
                "--no-generate",
                "--json",
            ]
        )
        == 1
    )
    data = json.loads(capsys.readouterr().out)
    train = data["diagnosis"]["train"]
    assert train["root_cause"] == "A" and train["culprit"]["producer"] == "batch['pixel_values']"


def test_doctor_mixed_preset_lists_what_autocast_hides(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["doctor", "llava", "--policy", "fp16", "--trainable", "projector", "--mode", "raise"]
    assert main([*argv, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    train, gen = data["diagnosis"]["train"], data["diagnosis"]["generate"]
    assert train["ok"] and any(m["autocast"] for m in train["mismatches"])
    # generate() runs outside autocast: the fp16 vision output meets the fp32 projector there
    assert gen["root_cause"] == "B" and gen["culprit"]["module"] == "model.multi_modal_projector"
    assert "mode='fix'" in gen["fix"]
    assert (
        main(
            [
                "doctor",
                "llava",
                "--policy",
                "fp16",
                "--trainable",
                "projector",
                "--mode",
                "fix",
                "--no-generate",
            ]
        )
        == 0
    )


# ------------------------------------------------------------- the stored split is exercised
def test_doctor_loads_each_tensor_in_the_dtype_it_is_stored_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_llava()
    model.model.language_model.to(torch.bfloat16)  # stored split: LM bf16, the rest fp32
    model.save_pretrained(tmp_path)
    n_lm = sum(1 for _ in model.model.language_model.parameters())
    argv = ["doctor", str(tmp_path), "--policy", "fp32", "--no-generate", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{\n") :])  # a library may log a line to stdout first
    assert "each tensor back to its stored dtype" in data["steps"]["load"]
    # fp32 policy: exactly the language model's bf16 tensors are cast (one dtype at load: 0)
    assert data["steps"]["enforce"].startswith(f"cast {n_lm} tensor(s)")
    assert "language_model bfloat16->float32" in data["steps"]["enforce"]


# ------------------------------------------------------------------ text-only models
def _bert(folder: Path) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=3,
    )
    BertForSequenceClassification(config).save_pretrained(folder)


def _t5(folder: Path) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
    )
    T5ForConditionalGeneration(config).save_pretrained(folder)


def _gpt2(folder: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    ).save_pretrained(folder)


@pytest.mark.parametrize(
    "build, steps",
    [(_bert, {"train"}), (_t5, {"train", "generate"}), (_gpt2, {"train", "generate"})],
    ids=["bert-classifier", "t5-seq2seq", "gpt2-causal"],
)
def test_doctor_runs_text_only_models(
    build: Any, steps: set[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build(tmp_path)
    assert (
        main(
            [
                "doctor",
                str(tmp_path),
                "--policy",
                "bf16",
                "--text-len",
                "5",
                "--json",
                "--trainable",
                "all",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert set(data["diagnosis"]) == steps
    assert data["diagnosis"]["train"]["passes"] == {"forward": "ok", "backward": "ok"}


def test_a_text_model_batch_error_names_text_flags_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _bert(tmp_path)  # 32 positions: a 40-token batch does not fit
    assert main(["doctor", str(tmp_path), "--text-len", "40"]) == 2
    err = capsys.readouterr().err
    assert "--text-len N" in err and "--image-size" not in err and "--image-token-id" not in err


# --------------------------------------------------- what autocast handled is information
def test_what_autocast_handled_is_counted_as_information(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(
            ["doctor", "llava", "--policy", "bf16", "--no-generate", "--json", "--trainable", "all"]
        )
        == 0
    )
    train = json.loads(capsys.readouterr().out)["diagnosis"]["train"]
    handled = [m for m in train["mismatches"] if m["autocast"]]
    assert handled and train["autocast_handled"] == len(handled)
    assert main(["doctor", "llava", "--policy", "bf16", "--no-generate", "--trainable", "all"]) == 0
    out = capsys.readouterr().out
    assert f"info: autocast handled {len(handled)} input/weight dtype difference(s)" in out
    assert "did not fail" not in out  # nothing outside autocast to look at
    assert f"OK: train ok (autocast handled {len(handled)} dtype difference(s))" in out


def test_doctor_with_nothing_trained_runs_the_forward_alone(capsys: pytest.CaptureFixture[str]):
    """The default, ``--trainable none`` (LoRA's case): no backward to run, and it says so."""
    assert main(["doctor", "llava", "--policy", "bf16", "--no-generate", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["diagnosis"]["train"]["passes"] == {"forward": "ok"}
    assert "nothing trainable" in out["steps"]["train"]


# ------------------------------------------- every family's batch from its own vision config
def _qwen2_vl_patch14() -> Any:
    """Qwen2-VL with the released patch size 14 (the tiny config's is 4)."""
    from transformers import Qwen2VLForConditionalGeneration

    from hf_precision.tiny import tiny_config

    config = tiny_config("qwen2_vl")
    config.vision_config.patch_size = 14
    return Qwen2VLForConditionalGeneration(config)


def _qwen2_5_vl_patch14() -> Any:
    """Qwen2.5-VL (window attention, patch 14, merge 2), its text model the tiny Qwen2-VL's."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from hf_precision.tiny import tiny_config

    tiny = tiny_config("qwen2_vl")
    text = {**tiny.text_config.to_dict(), "model_type": "qwen2_5_vl_text"}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=14)
    vision.update(window_size=56, out_hidden_size=tiny.text_config.hidden_size)
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config={**vision, "fullatt_block_indexes": [1]},
        image_token_id=250,
        video_token_id=251,
        vision_start_token_id=252,
        vision_end_token_id=253,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _tiny(model_type: str) -> Any:
    from hf_precision.tiny import build_tiny

    return lambda: build_tiny(model_type)


#: one checkpoint per model type the doctor builds a batch for (tiny_batch's BATCH_TYPES)
FAMILIES = {
    "llava": _tiny("llava"),
    "llava_next": _tiny("llava_next"),
    "idefics2": _tiny("idefics2"),
    "idefics3": _tiny("idefics3"),
    "qwen2_vl": _tiny("qwen2_vl"),
    "qwen2_vl-patch14": _qwen2_vl_patch14,
    "qwen2_5_vl-patch14": _qwen2_5_vl_patch14,
    "paligemma": _tiny("paligemma"),
    "minicpmv4_6": _tiny("minicpmv4_6"),
    "blip-2": _tiny("blip-2"),
    "kosmos-2": _tiny("kosmos-2"),
    "llama": _tiny("llama"),
}


def test_every_batch_recipe_has_a_checkpoint_case() -> None:
    from hf_precision.tiny.vlm import BATCH_TYPES

    assert {k.split("-patch")[0] for k in FAMILIES} == set(BATCH_TYPES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_doctor_builds_its_batch_from_the_checkpoints_vision_config(
    family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny checkpoint of each family saved to disk, language model bf16: the doctor's batch
    follows the checkpoint's own patch size, merge size, image size and channels."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.save_pretrained(tmp_path)
    code = main(["doctor", str(tmp_path), "--trainable", "projector", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:] + out.out[-2000:]
    data = json.loads(out.out[out.out.index("{\n") :])
    assert data["ok"] and data["diagnosis"]["train"]["passes"]["forward"] == "ok"
    if family.startswith("qwen"):  # its own patch: 14 x 14 x 2 frames x 3 channels per row
        from hf_precision.tiny.vlm import qwen_grid

        assert qwen_grid(model.config)[1] == 3 * 2 * model.config.vision_config.patch_size**2
        # --image-size sets the grid (a multiple of the merge size), and the tokens follow it
        side = 4 * model.config.vision_config.patch_size
        assert main(["doctor", str(tmp_path), "--image-size", str(side), "--no-generate"]) == 0
        assert "OK: train ok" in capsys.readouterr().out


def test_the_demo_setup_passes_doctor_as_the_callback_runs_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's own setup (a bf16 checkpoint, the projector trained): the default --mode fix
    is what PrecisionGuardCallback does, so the doctor passes and prints no fix it already made;
    --mode raise on request names the boundary and the mode that fixes it."""
    tiny_llava(torch.bfloat16).save_pretrained(tmp_path)
    assert main(["doctor", str(tmp_path), "--trainable", "projector"]) == 0
    out = capsys.readouterr().out
    assert "OK: train ok" in out and "generate ok" in out and "mode='fix'" not in out
    argv = ["doctor", str(tmp_path), "--trainable", "projector", "--mode", "raise"]
    assert main([*argv, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert "mode='fix'" in data["diagnosis"]["generate"]["fix"]
    assert main(argv) == 1
    assert "note: --mode raise makes every cast" in capsys.readouterr().out


def test_doctor_headroom_names_an_activation_beyond_float16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # every weight passes the range check (50 << 65504); the projector's output does not
    model = tiny_llava()
    with torch.no_grad():
        model.model.multi_modal_projector.linear_1.weight.fill_(50.0)
        model.model.multi_modal_projector.linear_2.weight.fill_(50.0)
    model.save_pretrained(tmp_path / "ckpt")
    argv = ["doctor", str(tmp_path / "ckpt"), "--no-generate", "--blame", "off", "--headroom"]
    assert main([*argv, "--policy", "fp16-true", "--json"]) == 1  # float16 would hold inf
    text = capsys.readouterr().out
    data = json.loads(text[text.index("\n{") + 1 :] if not text.startswith("{") else text)
    assert data["headroom"]["beyond_float16"][0] == "model.multi_modal_projector.linear_2"
    assert data["headroom"]["worst"][0]["max_abs"] > 65504
    assert main([*argv, "--policy", "bf16-true"]) == 0  # bf16 holds it: said, not failed
    out = capsys.readouterr().out
    assert "[headroom] headroom (one float32 forward" in out
    assert "model.multi_modal_projector.linear_2" in out
