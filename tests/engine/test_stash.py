"""The ``*_full_eval`` stash (``hf_precision/engine/stash.py``): trainable weights first, exact
copies,
and what does not fit said with its count and first name."""

from __future__ import annotations

import torch

from hf_precision import PrecisionPolicy
from hf_precision.engine.stash import stash_tensors
from hf_precision.tiny import tiny_llava


def test_trainable_weights_are_stashed_first_and_the_rest_is_said() -> None:
    model = tiny_llava()
    model.requires_grad_(False)
    head = model.lm_head.weight.requires_grad_(True)
    limit = head.numel() * head.element_size()
    kept, said = stash_tensors(
        model, PrecisionPolicy.from_preset("fp32"), set(), torch.bfloat16, limit
    )
    assert list(kept) == ["lm_head.weight"]
    assert torch.equal(kept["lm_head.weight"], head) and kept["lm_head.weight"] is not head
    assert said is not None and "frozen tensor(s)" in said and "bfloat16_full_eval casts" in said
