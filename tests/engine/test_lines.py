"""The console's words (``hf_precision/engine/lines.py``): what keep rules held, in words."""

from __future__ import annotations

import torch

from hf_precision import PrecisionPolicy
from hf_precision.engine import enforce, lines
from hf_precision.tiny import tiny_llava


def test_kept_words_names_the_rule_and_the_count() -> None:
    model = tiny_llava(torch.bfloat16)
    policy = PrecisionPolicy.from_preset("bf16-true", keep_fp32=["multi_modal_projector"])
    report = enforce.enforce_policy(model, policy, mode="audit")
    n = sum(1 for _ in model.model.multi_modal_projector.parameters())
    assert lines.kept_words(report).startswith("kept in float32 on purpose: ")
    assert f"{n} (" in lines.kept_words(report)
    assert not lines.kept_as_is(report)
    clean = enforce.enforce_policy(tiny_llava(torch.bfloat16), "bf16-true", mode="audit")
    assert lines.kept_words(clean) == ""
