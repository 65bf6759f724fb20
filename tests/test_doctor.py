"""``hf-precision doctor``: it enforces the policy, runs a guarded step and generate(), and names
the root cause and the culprit of what still fails (checkpoints: tests/test_cli.py and
tests/test_cli_checkpoints.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision.cli import main
from hf_precision.tiny import tiny_llava


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
