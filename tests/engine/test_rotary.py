"""A rounded rotary table recomputed from its module's config (engine/rotary.py), directly on
tiny LLaVA's real Llama rotary module; the plan's use of it is in tests/engine/test_plan.py."""

from __future__ import annotations

import torch

from hf_precision.engine.rotary import recomputed_rotary, rounded_rotary
from hf_precision.tiny import tiny_llava


class NoConfigRotary(torch.nn.Module):
    """Remote code's rotary module: its table from ``(dim, base)``, no config kept."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)


def test_a_rounded_table_is_recomputed_exactly_and_a_changed_one_is_not() -> None:
    rotary = tiny_llava().model.language_model.rotary_emb
    exact = rotary.inv_freq.clone()
    rounded = exact.to(torch.bfloat16)
    value = recomputed_rotary(rotary, "inv_freq", rounded)
    assert value is not None and value.dtype == torch.float32 and torch.equal(value, exact)
    value, reason, warning = rounded_rotary(rotary, "inv_freq", rounded, "t.inv_freq", "lm")
    assert value is not None and warning is None and "recomputed from the config" in reason
    changed = (exact * 2).to(torch.bfloat16)  # not the config's table: never replaced
    assert recomputed_rotary(rotary, "inv_freq", changed) is None


def test_a_table_without_config_is_said_so() -> None:
    module = NoConfigRotary()
    rounded = module.inv_freq.to(torch.bfloat16)
    assert recomputed_rotary(module, "inv_freq", rounded) is None
    value, reason, warning = rounded_rotary(module, "inv_freq", rounded, "v.rotary.inv_freq", "v")
    assert value is None and "cannot be restored" in reason
    assert warning is not None and warning.startswith("v.rotary.inv_freq [v]: this rotary table")
    assert "from_pretrained(..., dtype=torch.bfloat16)" in warning
