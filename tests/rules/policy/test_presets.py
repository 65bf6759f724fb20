"""hf_precision.rules.policy.presets: the preset table and the one check of a preset name."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionError
from hf_precision.rules.policy import presets
from hf_precision.rules.policy.presets import PRESETS, preset_name


def test_preset_table_holds_compute_frozen_trainable() -> None:
    assert PRESETS["bf16"] == (torch.bfloat16, torch.bfloat16, torch.float32)
    assert PRESETS["fp16-true"] == (torch.float16,) * 3


def test_a_misnamed_preset_says_which_was_meant() -> None:
    assert preset_name("bf16-true") == "bf16-true"
    with pytest.raises(PrecisionError, match=r"mycall\('bfloat16'\).*'bf16'"):
        preset_name("bfloat16", call="mycall")


def test_registered_presets_land_in_the_same_table() -> None:
    import hf_precision.rules.groups.diffusion  # noqa: F401  registers fp16-vae32

    assert "fp16-vae32" in presets.PRESETS and "fp16-vae32" in presets.PRESET_HELP
