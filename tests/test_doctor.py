"""``hf-precision doctor``: it enforces the policy, runs a guarded step and generate(), and names
the root cause and the culprit of what still fails (checkpoints: tests/test_cli.py and
tests/test_cli_checkpoints.py)."""

from __future__ import annotations

import json

import pytest

from hf_precision.cli import main


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
    assert main(["doctor", "llava", "--policy", "fp16", "--trainable", "projector", "--json"]) == 1
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
