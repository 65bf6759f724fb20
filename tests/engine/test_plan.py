"""The plan: pure (nothing in the model changes), complete (every change has its record), and
what apply_plan carries out without planning again."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from hf_precision import PrecisionPolicy, PrecisionWarning, enforce_policy
from hf_precision.engine.enforce import apply_plan
from hf_precision.engine.plan import plan_policy
from hf_precision.model.view import ModelView
from hf_precision.tiny import tiny_llava


def _state(model: torch.nn.Module) -> list[tuple[int, torch.dtype, int, torch.device]]:
    tensors = [*model.parameters(), *model.buffers()]
    return [(id(t), t.dtype, t.data_ptr(), t.device) for t in tensors]


def test_planning_changes_nothing_and_records_every_change() -> None:
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)
    before = _state(model)
    report = plan_policy(ModelView.of(model), PrecisionPolicy.from_preset("bf16-true"))
    assert _state(model) == before
    assert report.changes and not apply_plan(report, "audit").applied
    assert [p.change for p in report.planned] == list(report.changes)
    params = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    for cast in report.planned:
        assert id(cast.tensor) in params
        assert cast.module._parameters.get(cast.key, cast.module._buffers.get(cast.key)) is (
            cast.tensor
        )
        assert cast.dtype == torch.bfloat16 and cast.change.after == "bfloat16"


def test_apply_carries_out_the_plan_it_is_given() -> None:
    model = tiny_llava()
    model.model.multi_modal_projector.to(torch.float16)
    policy = PrecisionPolicy.from_preset("fp32")
    report = plan_policy(ModelView.of(model), policy)
    planned = {id(p.tensor) for p in report.planned}
    assert planned == {id(p) for p in model.model.multi_modal_projector.parameters()}
    ids = [id(p) for p in model.parameters()]
    applied = apply_plan(report)
    assert applied.applied and applied.changes == list(report.changes)
    assert [id(p) for p in model.parameters()] == ids  # the same Parameter objects
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(dataclasses.FrozenInstanceError):  # the plan is a value
        report.changes = ()  # type: ignore[misc]
    assert apply_plan(report) is not applied  # each apply reports anew; the plan is unchanged


def test_an_fp16_overflow_is_planned_as_kept_not_cast() -> None:
    model = tiny_llava()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = 1e6  # beyond fp16's 65504
    policy = PrecisionPolicy.from_preset("fp16-true")
    with pytest.warns(UserWarning, match="exceeds the float16 range"):
        report = apply_plan(plan_policy(ModelView.of(model), policy))
    assert report.overflow == [("lm_head.weight", 1e6)]
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.isfinite(model.lm_head.weight).all()
    assert model.model.language_model.embed_tokens.weight.dtype == torch.float16


def _tiny_gemma3() -> torch.nn.Module:
    """A tiny Gemma3ForConditionalGeneration (hf_precision.tiny has none): per-layer-type
    rotary tables, as transformers 5 names them."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=255,
        boi_token_index=253,
        eoi_token_index=254,
    )
    return Gemma3ForConditionalGeneration(config)


def _rotary(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if "inv_freq" in n}


def test_gemma3_per_layer_type_rotary_tables_stay_fp32_under_bf16() -> None:
    model = _tiny_gemma3()
    tables = _rotary(model)
    # transformers 5 names them per layer type (sliding_attention_inv_freq,
    # ..._original_inv_freq, full_attention_...); 4.57 has rotary_emb and rotary_emb_local
    per_type = any("sliding_attention_inv_freq" in n for n in tables)
    assert len(tables) == (4 if per_type else 2)
    exact = {n: b.clone() for n, b in tables.items()}
    report = enforce_policy(model, PrecisionPolicy.from_preset("bf16"))
    assert not [c for c in report.changes if "inv_freq" in c.name]
    for name, b in _rotary(model).items():
        assert b.dtype == torch.float32 and torch.equal(b, exact[name]), name
    kept = {n: (g, rule) for n, g, rule, _ in report.kept}
    assert {kept[n] for n in tables} == {("language_model", "rotary")}
    # besides the tables, only the 0-D embed_scale (rule scalar: Gemma casts it at its use)
    others = {(k["name"].rpartition(".")[2], k["rule"]) for k in report.to_dict()["kept"]}
    assert others - {(n.rpartition(".")[2], "rotary") for n in tables} <= {
        ("embed_scale", "scalar")
    }
    said = f"kept {len(tables)} in float32 (rotary), e.g. model.language_model.rotary_emb"
    assert said in report.summary()


def test_a_rounded_rotary_table_is_recomputed_from_the_config() -> None:
    model = _tiny_gemma3()
    exact = {n: b.clone() for n, b in _rotary(model).items()}
    model.to(torch.bfloat16)  # rounds every floating buffer, the rotary tables included
    assert {b.dtype for b in _rotary(model).values()} == {torch.bfloat16}
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        report = enforce_policy(model, PrecisionPolicy.from_preset("bf16-true"))
    for name, b in _rotary(model).items():
        assert b.dtype == torch.float32 and torch.equal(b, exact[name]), name  # exact, not rounded
    reasons = {c.name: c.reason for c in report.changes if "inv_freq" in c.name}
    assert len(reasons) == len(exact)
    assert all("recomputed from the config" in r for r in reasons.values())


class RemoteRotaryEmbedding(torch.nn.Module):
    """Remote code's rotary module: its table from ``(dim, base)``, no config kept."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)


def test_a_rounded_table_that_cannot_be_recomputed_is_said_so() -> None:
    model = tiny_llava()
    model.model.vision_tower.rotary = RemoteRotaryEmbedding(8)
    name = "model.vision_tower.rotary.inv_freq"
    exact = model.model.vision_tower.rotary.inv_freq.clone()
    model.to(torch.bfloat16)
    with pytest.warns(PrecisionWarning, match="cannot restore the lost bits") as record:
        report = enforce_policy(model, PrecisionPolicy.from_preset("bf16-true"))
    said = " ".join(str(w.message) for w in record)
    assert name in said and "from_pretrained(..., dtype=torch.bfloat16)" in said
    held = model.model.vision_tower.rotary.inv_freq
    assert held.dtype == torch.float32 and not torch.equal(held, exact)  # the rounded values
    assert torch.equal(held, exact.to(torch.bfloat16).float())
    change = next(c for c in report.changes if c.name == name)
    assert "cannot be restored" in change.reason and "repaired" not in change.reason
    # the language model's rotary module keeps its config: recomputed, exact
    text = next(c for c in report.changes if c.name.endswith("language_model.rotary_emb.inv_freq"))
    assert "recomputed" in text.reason
    assert enforce_policy(model, PrecisionPolicy.from_preset("bf16-true")).changes == []


def _upcast_layernorm(model: torch.nn.Module) -> list[str]:
    """LLaMA-Factory's ``upcast_layernorm``: every 1-D parameter whose name holds ``norm`` or
    ``ln`` -> float32 (vision tower included)."""
    names = []
    for name, p in model.named_parameters():
        if p.ndim == 1 and any(ln in name for ln in ("norm", "ln")):
            p.data = p.data.to(torch.float32)
            names.append(name)
    return names


@pytest.mark.parametrize("preset", ["bf16", "bf16-true"])
def test_fp32_norms_beside_half_weights_are_kept_a_whole_fp32_group_is_cast(preset: str) -> None:
    from hf_precision.tiny import tiny_qwen2_vl

    model = tiny_qwen2_vl(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad = False
    upcast = _upcast_layernorm(model)
    assert "model.visual.merger.ln_q.weight" in upcast  # a LayerNorm: kept by type too
    report = plan_policy(ModelView.of(model), PrecisionPolicy.from_preset(preset))
    kept = {n: rule for n, _, rule, _ in report.kept}
    norms = [n for n in upcast if kept.get(n) == "deliberate_fp32"]
    assert "model.visual.merger.ln_q.weight" in norms
    assert "model.language_model.norm.weight" in norms
    assert not {c.name for c in report.changes} & set(upcast)
    named = dict(model.named_parameters())
    assert all(named[n].dtype == torch.float32 for n in upcast)
    # the seed: a whole fp32 vision tower in a bf16 model is cast, its norms with it
    model.model.visual.float()
    report = plan_policy(ModelView.of(model), PrecisionPolicy.from_preset(preset))
    cast = {c.name: c.after for c in report.changes}
    assert cast["model.visual.blocks.0.norm1.weight"] == "bfloat16"
    assert cast["model.visual.blocks.0.attn.qkv.weight"] == "bfloat16"
    kept = {n: rule for n, _, rule, _ in report.kept}
    assert kept.get("model.language_model.norm.weight") == "deliberate_fp32"


def test_a_renamed_group_says_its_name_now() -> None:
    from hf_precision.tiny import tiny_qwen2_vl

    model = tiny_qwen2_vl()
    policy = PrecisionPolicy.from_preset("fp32", group_dtypes={"resampler": "bf16"})
    report = plan_policy(ModelView.of(model), policy)
    (said,) = [w for w in report.warnings if "group_dtypes['resampler']" in w]
    assert "Fix: name 'projector': rule 'qwen2_vl' calls that group 'projector' now." in said


def test_zero3_half_adapters_are_kept_and_said() -> None:
    """enforce_policy(..., master_fp32=bf16) (what the front ends pass under ZeRO-3): PEFT's
    bf16 LoRA made with autocast_adapter_dtype=False is not upcast; EnforceReport.kept, its JSON
    and its summary name rule wrapper_master_fp32. Without it the bf16 preset upcasts them."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llava(torch.bfloat16, seed=0),
        LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)"),
        autocast_adapter_dtype=False,
    )
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert {p.dtype for p in adapters.values()} == {torch.bfloat16}
    audit = enforce_policy(model, "bf16", mode="audit")
    assert {c.name for c in audit.changes} >= {
        n.removeprefix("base_model.model.") for n in adapters
    }
    report = enforce_policy(model, "bf16", master_fp32=torch.bfloat16)
    assert {p.dtype for p in adapters.values()} == {torch.bfloat16}
    assert not any("lora_" in c.name for c in report.changes)
    kept = [k for k in report.kept if k[2] == "wrapper_master_fp32"]
    assert len(kept) == len(adapters) == 8
    assert not any("lora_" in name for name, _ in report.kept_fp32)  # not an fp32 keep
    rows = [r for r in report.to_dict()["kept"] if r["rule"] == "wrapper_master_fp32"]
    assert len(rows) == 8 and rows[0]["reason"].startswith("trainable bfloat16 under DeepSpeed")
    assert "  kept 8 as they are (wrapper_master_fp32), e.g. " in report.summary()
