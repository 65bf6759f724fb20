"""``attribute_gap``: the shares on a LoRA model with a bf16 base (the adapters make the gap),
and that nothing of the model is changed by the attribution."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_precision.watch.rl_attribution import (
    FIXES,
    attribute_gap,
    first_parted,
    rl_groups,
    token_log_probs,
)


def _batch() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))}


def test_the_adapters_make_the_gap_of_a_lora_model_on_a_bf16_base(lora_llama: Any):
    model = lora_llama()
    found = attribute_gap(model, _batch(), keep=6, score=token_log_probs)
    assert found.gap > 0 and found.tokens == 12
    assert found.top == "adapters" and found.shares["adapters"] > 0.95
    assert set(found.shares) == {"adapters", "lm_head", "norms"}
    assert found.first_parted_group == "adapters" and ".lora_" in found.first_parted
    line = found.line()
    assert line.count("adapters: ") == 1 and FIXES["adapters"] in line
    assert found.to_dict()["top"] == "adapters"


def test_attribution_changes_nothing_of_the_model(lora_llama: Any):
    """Parameters: the same objects, dtypes and values bit for bit; the optimizer's references
    hold; the modules' training flags and hooks are as before, also when a forward raises."""
    model = lora_llama().train()
    model.base_model.model.lm_head.eval()  # a mixed mode comes back mixed
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    before = {n: (p, p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    attribute_gap(model, _batch(), keep=6, score=token_log_probs)
    calls = []

    def failing(m: Any, b: Any, k: int) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:  # inside the first group's switch
            raise RuntimeError("boom")
        return token_log_probs(m, b, k)

    with pytest.raises(RuntimeError, match="boom"):
        attribute_gap(model, _batch(), keep=6, score=failing)
    for n, p in model.named_parameters():
        obj, dtype, value = before[n]
        assert p is obj and p.dtype == dtype and torch.equal(p, value)
    assert [p for g in opt.param_groups for p in g["params"]] == [
        p for p in model.parameters() if p.requires_grad
    ]
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not torch.is_autocast_enabled("cpu")


def test_no_group_passes_at_or_under_the_threshold(lora_llama: Any):
    found = attribute_gap(lora_llama(), _batch(), keep=6, score=token_log_probs, threshold=1.0)
    assert found.gap > 0 and found.shares == {} and found.top is None


def test_groups_and_first_parted(lora_llama: Any):
    groups = rl_groups(lora_llama())
    assert len(groups["adapters"]) == 4  # lora_A/lora_B of q_proj and v_proj
    assert len(groups["lm_head"]) == 1 and len(groups["norms"]) == 3
    a = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([1.0, 2.001])}
    b = {"x": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "y": torch.tensor([1.0, 2.0])}
    assert first_parted(a, b) == "y"  # x is equal once both are bf16
