"""rules/policy/inference: the preset a model, TrainingArguments or an Accelerator names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_precision import PrecisionError, PrecisionPolicy
from hf_precision.rules.policy.inference import (
    accelerator_preset,
    full_eval_dtype,
    model_preset,
    training_args_preset,
)
from hf_precision.tiny import tiny_llava


def test_flags_name_presets() -> None:
    assert training_args_preset(SimpleNamespace(bf16=True)) == "bf16"
    assert training_args_preset(SimpleNamespace()) is None
    with pytest.raises(PrecisionError, match="choose one"):
        training_args_preset(SimpleNamespace(bf16=True, fp16=True))
    assert full_eval_dtype(SimpleNamespace(fp16_full_eval=True)) == torch.float16
    assert accelerator_preset(SimpleNamespace(mixed_precision="no")) is None
    with pytest.warns(Warning, match="fp8"):
        assert accelerator_preset(SimpleNamespace(mixed_precision="fp8")) == "bf16"


def test_a_bf16_model_with_an_fp32_projector() -> None:
    model = tiny_llava().to(torch.bfloat16)
    model.model.multi_modal_projector.float()
    assert model_preset(model) == ("bf16-true", {"keep_trainable_fp32": True})
    assert PrecisionPolicy.from_model(model).name == "bf16-true"
