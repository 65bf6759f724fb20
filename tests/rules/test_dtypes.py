import pytest
import torch

from hf_precision import PrecisionError
from hf_precision.rules.dtypes import (
    dtype_name,
    is_castable,
    is_quantized,
    majority_dtype,
    narrows_range,
    parse_dtype,
)


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        ("FP16", torch.float16),
        ("half", torch.float16),
        ("fp32", torch.float32),
        (torch.float32, torch.float32),
    ],
)
def test_parse_dtype_aliases(value, dtype):
    assert parse_dtype(value, call="t") is dtype


def test_parse_dtype_typo_names_call_allowed_values_and_suggestion():
    with pytest.raises(PrecisionError) as err:
        parse_dtype("bf61", call="PrecisionPolicy(compute_dtype='bf61')")
    text = str(err.value)
    assert "PrecisionPolicy(compute_dtype='bf61')" in text
    assert "Did you mean 'bf16'" in text
    assert "bfloat16 (bf16)" in text and "float16 (fp16)" in text
    assert "Fix:" in text


def test_parse_dtype_rejects_integer_dtype_and_other_types():
    with pytest.raises(PrecisionError, match="not a floating dtype"):
        parse_dtype(torch.int8, call="x")
    with pytest.raises(PrecisionError, match="expected a dtype name"):
        parse_dtype(16, call="x")


def test_quantized_and_castable():
    assert is_quantized(torch.zeros(2, dtype=torch.int8))
    assert is_quantized(torch.zeros(2, dtype=torch.float8_e4m3fn))
    assert not is_castable(torch.zeros(2, dtype=torch.float8_e4m3fn))
    assert is_castable(torch.zeros(2))
    assert not is_castable(torch.zeros(2, dtype=torch.long))


def test_narrows_range_and_names():
    assert narrows_range(torch.float32, torch.float16)
    assert narrows_range(torch.bfloat16, torch.float16)
    assert not narrows_range(torch.float16, torch.float32)
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert (
        majority_dtype([(torch.float32, 10), (torch.bfloat16, 20), (torch.float32, 5)])
        is torch.bfloat16
    )
    assert majority_dtype([]) is None
