"""Errors that existing except clauses catch, and the one "did you mean" hint."""

from __future__ import annotations

import pytest

from hf_precision import PrecisionError, PrecisionPolicy, PrecisionWarning
from hf_precision.errors import did_you_mean


def test_precision_error_is_caught_as_value_and_runtime_error() -> None:
    for base in (PrecisionError, ValueError, RuntimeError):
        with pytest.raises(base, match=r"unknown preset 'bf61'\. Did you mean 'bf16'\?"):
            PrecisionPolicy.from_preset("bf61")
    assert issubclass(PrecisionWarning, UserWarning)


def test_did_you_mean_lists_the_closest_choices() -> None:
    assert did_you_mean("vison_encoder", ["vision_encoder", "projector"]) == (
        " Did you mean 'vision_encoder'?"
    )
    choices = ["llava", "java", "llava_next", "llama"]
    assert did_you_mean("lava", choices, n=3) == " Did you mean 'llava', 'java' or 'llama'?"
    assert did_you_mean("lava", choices) == " Did you mean 'llava'?"  # one by default
    assert did_you_mean("zzz", ["bf16"]) == ""
    assert did_you_mean(3, []) == ""
