"""What the launcher's environment asks for (:mod:`hf_precision.integrations.launch_config`);
the Trainers it reaches are in test_launcher.py."""

from __future__ import annotations

import pytest

from hf_precision import PrecisionError
from hf_precision.integrations.launch_config import LaunchConfig, parse_keep_fp32, tool_name


def test_the_environment_round_trip_and_a_bad_value_refused_with_the_fix():
    config = LaunchConfig(
        policy="bf16", mode="audit", keep_fp32=("a", "re:b.*"), report_dir="/r", blame="off"
    )
    env = config.to_env()
    assert env["HF_PRECISION_KEEP_FP32"] == '["a", "re:b.*"]'
    back = LaunchConfig.from_env(env)
    assert (back.policy, back.mode, back.keep_fp32, back.report_dir, back.blame) == (
        "bf16",
        "audit",
        ("a", "re:b.*"),
        "/r",
        "off",
    )
    with pytest.raises(PrecisionError, match="unknown mode 'fixx'.*Fix: --mode fix"):
        LaunchConfig(mode="fixx").check(call="hf-precision run")
    with pytest.raises(PrecisionError, match="'bf61' is neither 'auto', a preset"):
        LaunchConfig(policy="bf61").check(call="hf-precision run")
    with pytest.raises(PrecisionError, match="bad regex"):
        LaunchConfig(keep_fp32=("re:(",)).check(call="hf-precision run")


def test_keep_fp32_and_the_users_tool_are_read_from_their_forms():
    assert parse_keep_fp32('["x", "y"]', where="W") == ("x", "y")
    assert parse_keep_fp32(" x , y ,", where="W") == ("x", "y")
    with pytest.raises(PrecisionError, match="W='\\[1\\]': expected a JSON list of strings"):
        parse_keep_fp32("[1]", where="W")
    assert tool_name(["accelerate", "launch", "train_text_to_image_lora.py", "--lr", "1"]) == (
        "train_text_to_image_lora.py"
    )
    assert tool_name(["/venv/bin/llamafactory-cli", "train", "cfg.yaml"]) == "llamafactory-cli"
