"""hf_precision.integrations.framework_runs: what a tool with its own loop tells the launcher
(its output folder, batch keys, flags as typed, the flag the guard undoes)."""

from __future__ import annotations

import os

import torch

from hf_precision.integrations import framework_runs
from hf_precision.integrations.framework_runs import FrameworkRun
from hf_precision.rules.batch_keys import batch_key_kind
from hf_precision.watch import provenance


def test_kohya_is_a_registered_detector() -> None:
    assert framework_runs.DETECTORS["library.train_util"] == (
        "hf_precision.integrations.kohya:detect"
    )
    assert framework_runs.detect(None) is None  # no tool's run in this process


def test_a_run_registers_its_batch_keys_and_its_typed_flags() -> None:
    run = FrameworkRun(
        "kohya",
        "train_network.py",
        output_dir="/runs/lora",
        metadata_keys=("clip_weights_of_a_tool",),
        settings={"--mixed_precision": "bf16", "--full_bf16": True},
        undone=("undoing --full_bf16: float32 LoRA weights",),
    )
    assert run.report_dir() == os.path.join("/runs/lora", "precision")
    assert FrameworkRun("x", "x.py").report_dir() is None
    assert run.said == (
        "train_network.py's --mixed_precision bf16 --full_bf16; undoing --full_bf16: float32 "
        "LoRA weights"
    )
    assert batch_key_kind("clip_weights_of_a_tool", torch.ones(2)) == "unknown_small"
    run.register()
    try:
        assert batch_key_kind("clip_weights_of_a_tool", torch.ones(2)) == "metadata"
        found = run.provenance("bf16")
        assert found["chosen_by"] == "train_network.py"
        assert found["line"].startswith(
            "precision: bf16 — train_network.py's --mixed_precision bf16 --full_bf16 (undoing"
        )
        assert "by itself" not in found["line"]  # the user typed them
    finally:
        provenance.forget("train_network.py")
