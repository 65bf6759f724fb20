"""The DeepSpeed JSON checked against the precision flags before the engine exists
(``hf_precision.rules.deepspeed_config``): LLaVA's ``"auto"`` configs, contradictions named with
the fix, every form ``--deepspeed`` accepts (path, JSON text, base64)."""

from __future__ import annotations

import base64
import doctest
import json

import pytest
import torch

from hf_precision import PrecisionError, PrecisionGuardCallback
from hf_precision.rules.deepspeed_config import (
    check_deepspeed_config,
    check_training_args,
    load_deepspeed_config,
)
from hf_precision.tiny import tiny_llava

# LLaVA's scripts/zero2.json: every precision value follows the command line
LLAVA_ZERO2 = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 2, "overlap_comm": True},
}


def test_auto_sections_follow_the_flags():
    assert check_deepspeed_config(LLAVA_ZERO2, bf16=True, fp16=False) == torch.bfloat16
    assert check_deepspeed_config(LLAVA_ZERO2, bf16=False, fp16=True) == torch.float16
    assert check_deepspeed_config(LLAVA_ZERO2, bf16=False, fp16=False) == torch.float32
    # a missing section is filled by accelerate from the flags
    assert (
        check_deepspeed_config({"zero_optimization": {"stage": 3}}, bf16=True, fp16=False)
        == torch.bfloat16
    )


def test_llava_bf16_flag_with_fp16_json_is_named(tmp_path):
    cfg = {**LLAVA_ZERO2, "fp16": {"enabled": True}, "bf16": {"enabled": "auto"}}
    path = tmp_path / "zero2.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(PrecisionError) as err:
        check_deepspeed_config(path, bf16=True, fp16=False)
    text = str(err.value)
    assert f"check_deepspeed_config({str(path)!r}, bf16=True, fp16=False)" in text
    assert 'the JSON says "fp16": {"enabled": true} but --fp16 is False' in text
    assert "the JSON enables both bf16 and fp16" in text  # auto bf16 -> True, plus fp16 true
    assert '"enabled": "auto"' in text  # the fix


def test_bf16_flag_with_json_that_disables_mixed_precision():
    cfg = {"bf16": {"enabled": False}, "fp16": {"enabled": "false"}}
    with pytest.raises(PrecisionError, match=r'"bf16": \{"enabled": false\} but --bf16 is True'):
        check_deepspeed_config(cfg, bf16=True, fp16=False)
    # the bfloat16 alias DeepSpeed also reads
    with pytest.raises(PrecisionError, match=r'"bfloat16": \{"enabled": false\}'):
        check_deepspeed_config({"bfloat16": {"enabled": False}}, bf16=True, fp16=False)


def test_fp32_run_with_json_that_enables_fp16():
    with pytest.raises(PrecisionError, match=r"no --bf16/--fp16 \(fp32\)"):
        check_deepspeed_config({"fp16": {"enabled": True}}, bf16=False, fp16=False)


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"bf16": {"enabled": "yes"}}, r"bf16.enabled='yes'; allowed: true, false"),
        ({"bf16": True}, r"'bf16' must be an object"),
        ({"bf16": {"enabled": "auto"}, "amp": {"enabled": True}}, r'apex "amp" together with bf16'),
    ],
)
def test_bad_values_are_explained(cfg, match):
    with pytest.raises(PrecisionError, match=match):
        check_deepspeed_config(cfg, bf16=True, fp16=False)


def test_both_flags_and_unreadable_configs(tmp_path):
    with pytest.raises(PrecisionError, match="bf16 and fp16 are both set"):
        check_deepspeed_config({}, bf16=True, fp16=True)
    with pytest.raises(PrecisionError, match="no such file, and not JSON text or base64"):
        check_deepspeed_config(tmp_path / "missing.json", bf16=True, fp16=False)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PrecisionError, match="not valid JSON"):
        load_deepspeed_config(bad)


def test_json_text_and_base64_forms():
    text = json.dumps({"bf16": {"enabled": "true"}})
    assert load_deepspeed_config(text) == {"bf16": {"enabled": "true"}}
    encoded = base64.urlsafe_b64encode(text.encode()).decode()
    assert check_deepspeed_config(encoded, bf16=True, fp16=False) == torch.bfloat16


def test_training_args_are_checked(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=True, report_to=[])
    assert check_training_args(args) is None  # no DeepSpeed
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp16": {"enabled": True}}))
    # TrainingArguments(deepspeed=...) needs DeepSpeed installed; the field is read the same way
    args.deepspeed = str(path)
    with pytest.raises(PrecisionError, match=r"--fp16 is False"):
        check_training_args(args)
    args.deepspeed = {"bf16": {"enabled": "auto"}}
    assert check_training_args(args) == torch.bfloat16
    # the callback runs the same check when it sets up
    cb = PrecisionGuardCallback(report=False)
    args.deepspeed = str(path)
    with pytest.raises(PrecisionError, match="contradicts the precision flags"):
        cb.on_init_end(args, None, None, model=tiny_llava())


def test_module_doctests():
    import hf_precision.rules.deepspeed_config as mod

    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 2


def test_zero_stage_from_args_and_accelerator() -> None:
    from types import SimpleNamespace

    from hf_precision.rules.deepspeed_config import zero_stage

    assert zero_stage() is None and zero_stage(args=SimpleNamespace(deepspeed=None)) is None
    assert zero_stage(args=SimpleNamespace(deepspeed={"bf16": {"enabled": True}})) == 0
    cfg = {"zero_optimization": {"stage": 3}}
    assert zero_stage(args=SimpleNamespace(deepspeed=cfg)) == 3
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 2}})
    assert zero_stage(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))) == 2
