"""What keep_out_of_fp8 selects: groups, words, patterns, keep_fp32, the first/last blocks."""

from __future__ import annotations

import pytest
from torch import nn

from hf_precision.errors import PrecisionError
from hf_precision.rules.fp8_rules import (
    DEFAULT_KEEP_OUT_OF_FP8,
    keep_out_reason,
    language_edge_blocks,
)
from hf_precision.rules.policy.precision_policy import PrecisionPolicy

LIN = nn.Linear(2, 2)


@pytest.mark.parametrize(
    ("path", "group", "why"),
    [
        (
            "model.vision_tower.encoder.layers.0.self_attn.k_proj",
            "vision_encoder",
            "group vision_encoder",
        ),
        ("model.multi_modal_projector.linear_1", "projector", "group projector"),
        ("lm_head", "lm_head", "group lm_head"),
        ("model.layers.0.block_sparse_moe.gate", "language_model", "routers"),
        ("model.layers.0.mlp.gate_proj", "language_model", None),
        ("base_model.model.layers.0.q_proj.lora_A.default", "language_model", "adapters"),
        ("model.embed_tokens", "language_model", "embeddings"),
    ],
)
def test_the_defaults(path, group, why) -> None:
    assert keep_out_reason(DEFAULT_KEEP_OUT_OF_FP8, path, group, LIN) == why


def test_patterns_keep_fp32_and_edge_blocks() -> None:
    path = "model.language_model.layers.3.mlp.up_proj"
    assert keep_out_reason(("re:.*mlp.*",), path, "language_model", LIN) == "pattern re:.*mlp.*"
    assert keep_out_reason((), path, "language_model", LIN, keep_fp32=("mlp",)) == "keep_fp32 mlp"
    edges = language_edge_blocks(
        (f"model.language_model.layers.{i}.mlp", "language_model") for i in range(4)
    )
    assert edges == {"model.language_model.layers.0", "model.language_model.layers.3"}
    assert keep_out_reason(("first_last_blocks",), path, "language_model", LIN, edge_blocks=edges)
    other = "model.language_model.layers.2.mlp.up_proj"
    assert (
        keep_out_reason(("first_last_blocks",), other, "language_model", LIN, edge_blocks=edges)
        is None
    )


def test_the_policy_field() -> None:
    p = PrecisionPolicy.from_preset("bf16", keep_out_of_fp8="lm_head")
    assert p.keep_out_of_fp8 == ("lm_head",)
    with pytest.raises(PrecisionError, match="keep_out_of_fp8: bad regex"):
        PrecisionPolicy.from_preset("bf16", keep_out_of_fp8=("re:(",))
