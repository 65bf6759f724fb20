"""The user's tool and how it spells a flag (hf_precision/rules/flags.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_precision.rules.flags import (
    ENV,
    TOOLS,
    detect_tool,
    flag,
    load_dtype,
    no_flag,
    quantized_compute,
    set_flag,
)


@pytest.mark.parametrize(
    ("tool", "bf16", "fp16_off"),
    [
        ("llamafactory", "bf16: true", "fp16: false"),
        ("axolotl", "bf16: true", "fp16: false"),
        ("trl", "--bf16", "--fp16 False"),
        ("cli", "--bf16", "--fp16 False"),
        ("swift", "--bf16 true", "--fp16 false"),
        ("python", "bf16=True", "fp16=False"),
        ("accelerate", "Accelerator(mixed_precision='bf16')", "Accelerator(mixed_precision='no')"),
    ],
)
def test_flag_in_each_tool(tool: Any, bf16: str, fp16_off: str) -> None:
    assert flag("bf16", tool=tool) == bf16
    assert flag("fp16", False, tool=tool) == fp16_off


def test_every_tool_has_a_spelling() -> None:
    for tool in TOOLS:
        assert flag("bf16", tool=tool) and no_flag(tool=tool) and load_dtype("bf16", tool=tool)


def test_python_names_the_arguments_class(monkeypatch: pytest.MonkeyPatch) -> None:
    from trl import SFTConfig

    monkeypatch.setenv(ENV, "python")
    args = SFTConfig(output_dir="out", use_cpu=True, report_to=[])
    assert flag("bf16", args=args) == "SFTConfig(bf16=True)"


def test_detect_from_the_environment_first() -> None:
    env = {ENV: "LLaMA-Factory"}
    assert detect_tool(argv=["/x/bin/swift", "sft"], environ=env) == "llamafactory"
    assert detect_tool(argv=["x"], environ={ENV: "axolotl"}) == "axolotl"
    # an unknown value is ignored, not trusted
    assert detect_tool(argv=["/x/bin/trl", "sft"], environ={ENV: "mytool"}) == "trl"


@pytest.mark.parametrize(
    ("argv", "tool"),
    [
        (["/venv/bin/llamafactory-cli", "train", "qwen2vl_lora_sft.yaml"], "llamafactory"),
        (["/src/llamafactory/launcher.py", "x.yaml"], "llamafactory"),  # torchrun's child
        (["/venv/bin/swift", "sft", "--model", "m"], "swift"),
        (["/venv/lib/python3.11/site-packages/swift/cli/sft.py", "--model", "m"], "swift"),
        (["/venv/bin/axolotl", "train", "cfg.yaml"], "axolotl"),
        (["/venv/bin/trl", "sft", "--model_name_or_path", "m"], "trl"),
        (["sft_vlm.py", "--output_dir", "o", "--bf16", "True"], "cli"),
        (["train.py"], "python"),
        ([], "python"),
    ],
)
def test_detect_from_the_program(argv: list[str], tool: str) -> None:
    assert detect_tool(argv=argv, environ={}) == tool


def test_detect_from_the_arguments_class() -> None:
    class Args:  # what LLaMA-Factory's / ms-swift's / axolotl's own TrainingArguments look like
        pass

    for module, tool in (
        ("llamafactory.hparams.training_args", "llamafactory"),
        ("swift.trainers.arguments", "swift"),
        ("axolotl.core.training_args", "axolotl"),
    ):
        Args.__module__ = module
        assert detect_tool(Args(), argv=["python"], environ={}) == tool
    Args.__module__ = "trl.trainer.sft_config"
    assert detect_tool(Args(), argv=["sft.py", "--bf16"], environ={}) == "trl"
    assert detect_tool(Args(), argv=["sft.py"], environ={}) == "python"


@pytest.mark.parametrize(
    ("tool", "text"),
    [
        ("llamafactory", "bf16: true"),
        ("axolotl", "bf16: true"),
        ("swift", "--torch_dtype bfloat16"),
        ("trl", "--dtype bfloat16"),
        ("python", "BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.bfloat16)"),
    ],
)
def test_quantized_compute_in_the_users_words(tool: Any, text: str) -> None:
    assert text in quantized_compute(torch.bfloat16, tool=tool)
    if tool in ("llamafactory", "axolotl"):
        assert "bnb_4bit_compute_dtype" not in quantized_compute("bf16", tool=tool)


def test_load_dtype() -> None:
    assert load_dtype(torch.float16, tool="python") == "from_pretrained(..., dtype=torch.float16)"
    assert load_dtype("float32", tool="llamafactory") == "bf16: false and fp16: false"
    assert load_dtype("fp16", tool="axolotl") == "fp16: true"


@pytest.mark.parametrize(
    ("tool", "argv", "said"),
    [
        ("cli", ["train.py", "--epochs", "3"], "bf16=True"),  # set in Python, not typed
        ("cli", ["train.py", "--bf16"], "--bf16"),
        ("trl", ["trl", "sft", "--bf16=true"], "--bf16"),
        ("trl", ["trl", "sft", "--lr", "1"], "bf16=True"),
        ("llamafactory", ["llamafactory-cli", "train", "a.yaml"], "bf16: true"),
    ],
)
def test_set_flag_says_where_the_user_set_it(tool: Any, argv: list[str], said: str) -> None:
    assert set_flag("bf16", tool=tool, argv=argv) == said
