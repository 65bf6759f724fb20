"""diagnose(): the module, the producer, the policy and the fix, per root-cause class."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hf_precision
from hf_precision import PrecisionError, PrecisionPolicy, diagnose, dtype_map
from hf_precision.engine.hooks import install_guards
from hf_precision.tiny import InternVLTiny, MiniCPMV2Tiny, tiny_batch, tiny_llava
from hf_precision.tools.diagnostics import is_mismatch_error


def _class_a() -> tuple[Any, dict[str, torch.Tensor]]:
    """InternViT casts nothing: the collator's fp32 pixels reach a bf16 conv."""
    model = InternVLTiny(torch.bfloat16)
    return model, model.batch()


def _class_b() -> tuple[Any, dict[str, torch.Tensor]]:
    """Vision tower left in fp32 while the rest is bf16."""
    model = tiny_llava(torch.bfloat16)
    model.model.vision_tower.float()
    return model, tiny_batch(model)


def _class_c() -> tuple[Any, dict[str, torch.Tensor]]:
    """One RMSNorm kept in fp32 inside a bf16 language model: its fp32 output hits a linear."""
    model = tiny_llava(torch.bfloat16)
    model.model.language_model.layers[0].post_attention_layernorm.float()
    return model, tiny_batch(model)


def _class_f() -> tuple[Any, dict[str, torch.Tensor]]:
    """A resampler that makes its key sin-cos table in fp32 in forward (``.float()``), in a
    model cast to bf16 whole: that table is the one fp32 tensor."""
    model = MiniCPMV2Tiny().to(torch.bfloat16)
    model.resampler.table_dtype = torch.float32
    return model, model.batch()


def _class_g() -> tuple[Any, dict[str, torch.Tensor]]:
    """A group on another device; the meta device stands in for a GPU on this CPU machine."""
    model = tiny_llava()
    model.model.multi_modal_projector.to("meta")
    return model, tiny_batch(model)


CASES: dict[str, tuple[Callable[[], Any], str, str, str, str]] = {
    # class: (builder, policy, culprit module, producer, module where the op failed)
    "A": (
        _class_a,
        "bf16-true",
        "vision_model",
        "batch['pixel_values']",
        "vision_model.patch_embed",
    ),
    "B": (
        _class_b,
        "bf16-true",
        "model.multi_modal_projector",
        "model.vision_tower.encoder.layers.0",
        "model.multi_modal_projector.linear_1",
    ),
    "C": (
        _class_c,
        "bf16-true",
        "model.language_model.layers.0.mlp.gate_proj",
        "model.language_model.layers.0.post_attention_layernorm",
        "model.language_model.layers.0.mlp.gate_proj",
    ),
    "F": (
        _class_f,
        "bf16-true",
        "resampler.attn",
        "made inside resampler.forward",
        "resampler.attn",
    ),
    "G": (
        _class_g,
        "fp32",
        "model.multi_modal_projector",
        "model.vision_tower.encoder.layers.0",
        "model.multi_modal_projector.linear_1",
    ),
}


@pytest.mark.parametrize("cls", sorted(CASES))
def test_names_module_producer_policy_and_fix(cls: str) -> None:
    build, policy, module, producer, failed_in = CASES[cls]
    model, batch = build()
    before = dtype_map(model).digest()
    with pytest.raises(PrecisionError) as info:
        diagnose(model, batch, policy=policy)
    diag = info.value.diagnosis
    assert isinstance(info.value.__cause__, RuntimeError)
    assert is_mismatch_error(info.value.__cause__)
    assert diag.root_cause == cls and not diag.ok and diag.phase == "forward"
    assert diag.culprit is not None and diag.culprit.module == module
    assert diag.culprit.producer.startswith(producer)
    assert diag.failed_in == failed_in
    text = str(info.value)
    for piece in (module, producer, f"root cause: {cls}", "expected: policy", "fix: "):
        assert piece in text, piece
    assert dtype_map(model).digest() == before, "diagnose must not change the model"


def test_details_per_class() -> None:
    diag = diagnose(*_class_b(), policy="bf16-true", raise_on_error=False)
    c = diag.culprit
    assert c is not None and (c.input_dtype, c.weight_dtype) == ("float32", "bfloat16")
    assert (c.group, c.producer_group, c.producer_dtype) == (
        "projector",
        "vision_encoder",
        "float32",
    )
    assert diag.violations["vision_encoder"] > 0 and "enforce_policy" in (diag.fix or "")

    diag = diagnose(*_class_g(), raise_on_error=False)
    c = diag.culprit
    assert c is not None and c.kind == "device" and c.weight_device == "meta"
    assert c.input_device == "cpu" and "move" in (diag.fix or "")

    diag = diagnose(*_class_c(), policy="bf16-true", raise_on_error=False)
    assert "leaf_guards='on'" in (diag.fix or "")
    diag = diagnose(*_class_f(), policy="bf16-true", raise_on_error=False)
    assert "torch.from_numpy(pos).to(x.dtype)" in (diag.fix or "")
    diag = diagnose(*_class_a(), policy="bf16-true", raise_on_error=False)
    assert "PrecisionCollator" in (diag.fix or "")


def test_the_guards_raise_mode_is_diagnosed() -> None:
    """With guards installed in raise mode, the guard's PrecisionError becomes a diagnosis."""
    model, batch = _class_a()
    policy = PrecisionPolicy.from_preset("bf16-true", mode="raise")
    handle = install_guards(model, policy)
    try:
        with pytest.raises(PrecisionError) as info:
            diagnose(model, batch, policy=policy)
    finally:
        handle.remove()
    diag = info.value.diagnosis
    # raise mode stops at the module entry that would fail (not at the batch, which autocast
    # may legitimately leave in fp32)
    assert "vision_model (TinyViT) received input 0 as float32" in (diag.error or "")
    assert diag.root_cause == "A" and diag.culprit is not None
    assert diag.culprit.producer == "batch['pixel_values']"


def test_hidden_mismatches_under_autocast_are_listed() -> None:
    model = tiny_llava()
    model.model.language_model.to(torch.bfloat16).requires_grad_(False)
    diag = diagnose(model, tiny_batch(model), policy="bf16", autocast="bf16", generate=True)
    assert diag.ok and diag.passes == {"forward": "ok", "backward": "ok", "generate": "ok"}
    hidden = diag.silent
    assert hidden and any(m.autocast for m in hidden)
    head = [m for m in hidden if m.module == "lm_head" and m.phase == "forward"]
    assert len(head) == 1 and head[0].autocast
    assert (head[0].input_dtype, head[0].weight_dtype) == ("bfloat16", "float32")
    assert head[0].producer_module == "model.language_model.norm"
    assert "info: autocast handled" in str(diag)
    assert all(p.grad is None for p in model.parameters()), "gradients are restored"
    json.dumps(diag.to_dict())


def test_clean_model_reports_no_mismatch_and_other_errors_pass_through() -> None:
    model = tiny_llava()
    diag = diagnose(model, tiny_batch(model), generate=True)
    assert diag.ok and diag.mismatches == [] and diag.calls > 0
    assert "no module received" in str(diag)
    assert diag.to_dict()["ok"] is True
    bad = tiny_batch(model)
    bad["pixel_values"] = bad["pixel_values"][:, :, :7]  # a shape error, not a dtype one
    with pytest.raises(ValueError, match="Input image size") as info:
        diagnose(model, bad)
    assert not isinstance(info.value, PrecisionError)


def test_forward_false_runs_generate_only() -> None:
    model, batch = _class_f()
    diag = diagnose(
        model, batch, policy="bf16-true", forward=False, generate=True, raise_on_error=False
    )
    assert list(diag.passes) == ["generate"] and diag.phase == "generate"
    assert diag.root_cause == "F" and diag.culprit is not None
    assert diag.culprit.module == "resampler.attn"


def test_exported_lazily() -> None:
    import hf_precision.tools.diagnostics as mod

    assert "diagnose" in hf_precision.__all__ and hf_precision.diagnose is mod.diagnose
    with pytest.raises(PrecisionError, match="unknown dtype"):
        diagnose(tiny_llava(), {}, autocast="bf61")


@pytest.mark.parametrize("name", ["tools.diagnostics", "watch.diagnosis"])
def test_module_doctests(name: str) -> None:
    import doctest
    import importlib

    module = importlib.import_module(f"hf_precision.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
