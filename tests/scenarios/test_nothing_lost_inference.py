"""Nothing lost when no precision flag is given: weights trained in fp32 (PEFT's LoRA adapters, a
connector trained in fp32, keep-fp32 modules) stay fp32 through train + evaluate; a policy the
caller passes in is never changed; errors repeat the caller's own call."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_precision import PrecisionError, PrecisionGuardCallback, PrecisionPolicy
from hf_precision.tiny import tiny_batch, tiny_idefics2, tiny_llava
from hf_precision.tiny.remote_layouts import MiniCPMV2Tiny

LM_ATTN = r".*language_model.*\.(q_proj|v_proj)"


def _fp32_trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {
        n: p for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float32
    }


def _train_and_evaluate(trainer_for, model, batch, **kw):
    cb = PrecisionGuardCallback(report=False)
    trainer = trainer_for(model, batch, callbacks=[cb], eval_strategy="steps", eval_steps=1, **kw)
    out = trainer.train()
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(out.training_loss))
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    return cb


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_peft_lora_on_a_half_model_with_no_flag_keeps_adapters_fp32(trainer_for, half):
    base = tiny_llava(dtype=half)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=LM_ATTN))
    kept = _fp32_trainable(model)
    assert kept and all("lora_" in n for n in kept)  # PEFT upcast its adapters on purpose
    cb = _train_and_evaluate(trainer_for, model, tiny_batch(base, 4))
    assert cb.policy is not None and cb.policy.frozen_dtype == half
    assert {p.dtype for p in kept.values()} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {half}


def test_connector_trained_in_fp32_inside_a_bf16_idefics2(trainer_for):
    model = tiny_idefics2(dtype=torch.bfloat16)
    model.requires_grad_(False)
    connector = model.model.connector.to(torch.float32).requires_grad_(True)
    head = model.lm_head.to(torch.float32)  # frozen and fp32: the odd one out follows bf16
    cb = _train_and_evaluate(trainer_for, model, tiny_batch(model, 4))
    assert cb.policy is not None and cb.policy.name == "bf16-true"
    assert {p.dtype for p in connector.parameters()} == {torch.float32}
    assert {p.dtype for p in head.parameters()} == {torch.bfloat16}


def test_minicpmv2_lora_with_no_flag_keeps_adapters_fp32(trainer_for):
    model = get_peft_model(
        MiniCPMV2Tiny(torch.bfloat16), LoraConfig(r=4, target_modules=r"llm.*\.(q_proj|v_proj)")
    )
    kept = _fp32_trainable(model)
    assert kept
    _train_and_evaluate(trainer_for, model, MiniCPMV2Tiny().batch(4))
    assert {p.dtype for p in kept.values()} == {torch.float32}


def test_full_fine_tune_in_bf16_stays_bf16_and_fp32_parts_stay_fp32(trainer_for):
    model = tiny_llava(dtype=torch.bfloat16)
    lm_head = model.lm_head.to(torch.float32)  # trainable, chosen fp32
    cb = _train_and_evaluate(trainer_for, model, tiny_batch(model, 4))
    assert cb.policy is not None and cb.policy.name == "bf16-true"
    assert {p.dtype for p in lm_head.parameters()} == {torch.float32}
    rest = {p.dtype for n, p in model.named_parameters() if not n.startswith("lm_head")}
    assert rest == {torch.bfloat16}


def test_text_only_models_keep_fp32_trainables(trainer_for):
    from transformers import FalconConfig, FalconForCausalLM, LlamaConfig, LlamaForCausalLM

    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    models = [
        LlamaForCausalLM(LlamaConfig(intermediate_size=64, num_key_value_heads=2, **small)),
        FalconForCausalLM(FalconConfig(**small)),
    ]
    for base in models:
        base.to(torch.bfloat16)
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "query_key_value"]))
        kept = _fp32_trainable(model)
        ids = torch.randint(0, 64, (4, 8))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        _train_and_evaluate(trainer_for, model, batch)
        assert kept and {p.dtype for p in kept.values()} == {torch.float32}


def test_a_named_true_preset_is_the_way_to_lower_trainables(trainer_for):
    base = tiny_llava(dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=LM_ATTN))
    lora = next(p for n, p in model.named_parameters() if "lora_A" in n)
    trainer_for(model, tiny_batch(base, 4), callbacks=[PrecisionGuardCallback("bf16-true")])
    assert lora.dtype == torch.bfloat16  # the user named it


def test_the_callers_policy_is_not_mutated():
    policy = PrecisionPolicy.from_preset("bf16")
    before = policy.to_dict()
    cb = PrecisionGuardCallback(policy, mode="audit", leaf_guards="on")
    assert policy.to_dict() == before and policy.mode == "fix"
    assert cb.policy is not None and cb.policy.mode == "audit" and cb.policy is not policy
    with pytest.raises(AttributeError):
        policy.mode = "audit"  # type: ignore[misc]
    from hf_precision import PrecisionGuardPlugin

    guard = PrecisionGuardPlugin(policy, mode="raise")
    assert policy.mode == "fix" and guard.policy is not None and guard.policy.mode == "raise"


@pytest.mark.parametrize("owner", ["PrecisionGuardPlugin", "PrecisionGuardCallback"])
def test_errors_repeat_the_users_call(owner):
    import hf_precision

    cls = getattr(hf_precision, owner)
    with pytest.raises(PrecisionError) as err:
        cls("bf16", mode="rasie")
    msg = str(err.value)
    assert msg.startswith(f"{owner}('bf16', mode='rasie'): unknown mode 'rasie'")
    assert "Did you mean 'raise'" in msg and "fp32" not in msg
    with pytest.raises(PrecisionError) as err:
        cls("bf61")
    assert str(err.value).startswith(f"{owner}('bf61'): unknown preset 'bf61'")
