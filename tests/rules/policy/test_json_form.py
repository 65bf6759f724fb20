"""hf_precision.rules.policy.json_form: the policy's JSON form."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionError, PrecisionPolicy
from hf_precision.rules.policy.json_form import (
    POLICY_VERSION,
    decode_fields,
    encode_fields,
    json_object,
)


def test_dtypes_are_written_by_name_with_the_version() -> None:
    out = encode_fields({"compute_dtype": torch.bfloat16, "keep_fp32": ("a",)})
    assert out == {"compute_dtype": "bfloat16", "keep_fp32": ["a"], "version": POLICY_VERSION}


def test_a_hand_written_typo_raises_a_saved_newer_field_warns() -> None:
    with pytest.raises(PrecisionError, match="unknown field"):
        decode_fields({"compute_dtyp": "bf16"}, frozenset({"compute_dtype"}))
    with pytest.warns(Warning, match="ignoring field"):
        kept = decode_fields({"version": 2, "x": 1, "name": "a"}, frozenset({"name"}))
    assert kept == {"name": "a"}


def test_json_that_is_no_object_says_so() -> None:
    with pytest.raises(PrecisionError, match="not valid JSON"):
        json_object("bf16")
    with pytest.raises(PrecisionError, match="is a list"):
        json_object("[1]")


def test_the_policy_round_trips() -> None:
    p = PrecisionPolicy.from_preset("bf16", group_dtypes={"vision_encoder": "fp32"})
    assert PrecisionPolicy.from_json(p.to_json()) == p
