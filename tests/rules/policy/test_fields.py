"""hf_precision.rules.policy.fields: the word fields of a policy and the one check of a new
policy's fields."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionError, PrecisionPolicy


def test_a_new_policy_is_normalised_once() -> None:
    p = PrecisionPolicy(
        compute_dtype="bf16",
        group_dtypes={"vision_encoder": "float32"},
        keep_fp32="model.norm",  # one pattern as a string
        batch_skip_keys=["labels"],
    )
    assert (p.compute_dtype, p.frozen_dtype) == (torch.bfloat16, torch.bfloat16)
    assert p.group_dtypes == {"vision_encoder": torch.float32}
    assert p.keep_fp32 == ("model.norm",) and p.batch_skip_keys == ("labels",)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"mode": "rasie"}, r"unknown mode 'rasie'\. Did you mean 'raise'"),
        ({"leaf_guards": "of"}, "unknown leaf_guards value 'of'"),
        ({"group_dtypes": {"visoin_encoder": "fp32"}}, "unknown group 'visoin_encoder'"),
        ({"keep_fp32": ("re:(",)}, r"bad regex 're:\('"),
        ({"batch_key_groups": {"pixel_values": "towr"}}, "unknown group 'towr'"),
    ],
)
def test_bad_fields_are_refused_naming_the_field(fields, said) -> None:
    with pytest.raises(PrecisionError, match=said):
        PrecisionPolicy.from_preset("bf16", **fields)
