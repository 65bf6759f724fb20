"""Class C — fp32 upcast leak: the LM's RMSNorms are trained in fp32 next to frozen bf16 weights.
``LlamaRMSNorm`` returns ``weight * x.to(input_dtype)``, so an fp32 weight turns the bf16
activations into fp32 and the next bf16 linear (``q_proj``, ``lm_head``) fails."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionGuardCallback
from hf_precision.engine.hooks import guard_targets
from hf_precision.tiny import DeepSeekVLTiny, InternVLTiny, remote_batch, tiny_batch, tiny_llava

FP32_INTO_BF16 = r"expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16"


def _norms_trained_in_fp32():
    model = tiny_llava(torch.bfloat16)
    model.train()
    for name, p in model.named_parameters():
        p.requires_grad = "language_model" in name and "norm" in name
        if p.requires_grad:
            p.data = p.data.float()
    return model


def test_without_guard_fp32_norm_output_reaches_bf16_linears(trainer_for):
    model = _norms_trained_in_fp32()
    trainer = trainer_for(model, tiny_batch(model, batch_size=4))
    with pytest.raises(RuntimeError, match=FP32_INTO_BF16):
        trainer.train()


def test_guard_casts_leaf_inputs_to_each_weight_dtype(trainer_for, record_inputs):
    model = _norms_trained_in_fp32()
    # "bf16": frozen bf16, trainable fp32 (no Trainer flag, so no autocast hides the leak)
    guard = PrecisionGuardCallback("bf16")
    trainer = trainer_for(
        model,
        tiny_batch(model, batch_size=4),
        callbacks=[guard],
        eval_strategy="steps",
        eval_steps=2,
    )
    assert guard.last_report is not None
    assert "language_model" in guard.last_report.mixed_groups
    targets = guard_targets(model)
    lm = "model.language_model.layers.1"
    assert f"{lm}.input_layernorm" not in targets  # an fp32 norm takes half inputs itself
    assert targets[f"{lm}.self_attn.q_proj"] == ("leaf", "bfloat16")
    q_in = record_inputs(model.model.language_model.layers[1].self_attn.q_proj)
    head_in = record_inputs(model.lm_head)

    out = trainer.train()

    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert set(q_in) == set(head_in) == {torch.bfloat16}
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    assert sum(p.requires_grad for p in model.parameters()) == 5  # 2 layers x 2 norms + final


# --- fp32 kept on purpose: LLaMA-Factory's upcast_layernorm -------------------------------


def _llamafactory_upcast_layernorm_lora():
    """LLaMA-Factory's order (``patch_model`` then ``init_adapter``): a bf16 model, every 1-D
    parameter whose name holds ``norm``/``ln`` cast to fp32 (``upcast_layernorm: true``; PEFT's
    ``prepare_model_for_kbit_training`` and axolotl do the same for norms), then LoRA on the
    language model's attention."""
    from peft import LoraConfig, get_peft_model

    model = tiny_llava(torch.bfloat16)
    norms = []
    for name, p in model.named_parameters():
        if p.ndim == 1 and any(ln in name for ln in ("norm", "ln")):
            p.data = p.data.to(torch.float32)
            norms.append(name)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    peft_model = get_peft_model(model, lora)
    peft_model.train()
    return peft_model, norms


def _norm_dtypes(model, norms):
    named = dict(model.base_model.model.named_parameters())
    return {named[n].dtype for n in norms}


def test_upcast_layernorm_without_guard_and_without_flag_fails(trainer_for):
    model, _ = _llamafactory_upcast_layernorm_lora()
    trainer = trainer_for(model, tiny_batch(model.base_model.model, batch_size=4))
    with pytest.raises(RuntimeError, match=FP32_INTO_BF16):
        trainer.train()


@pytest.mark.parametrize("bf16", [False, True])
def test_guard_keeps_upcast_norms_fp32_and_trains(trainer_for, bf16, tmp_path):
    import json

    model, norms = _llamafactory_upcast_layernorm_lora()
    assert len(norms) > 10 and _norm_dtypes(model, norms) == {torch.float32}
    guard = PrecisionGuardCallback()
    trainer = trainer_for(
        model,
        tiny_batch(model.base_model.model, batch_size=4),
        callbacks=[guard],
        bf16=bf16,
        output_dir=str(tmp_path / "out"),
    )
    report = guard.last_report
    assert report is not None
    assert not {c.name for c in report.changes} & set(norms)  # not one norm cast down
    kept = {name: rule for name, _, rule, _ in report.kept}
    deliberate = {n for n, rule in kept.items() if rule == "deliberate_fp32"}
    assert deliberate == set(norms)  # vision tower's and language model's alike
    assert _norm_dtypes(model, norms) == {torch.float32}

    out = trainer.train()

    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert _norm_dtypes(model, norms) == {torch.float32}
    base = model.base_model.model
    q = base.model.language_model.layers[0].self_attn.q_proj
    assert q.base_layer.weight.dtype == torch.bfloat16 and q.lora_A.default.weight.dtype == (
        torch.float32
    )
    event = json.loads(next((tmp_path / "out" / "precision").glob("*on_init_end.json")).read_text())
    rules = {k["name"]: k["rule"] for k in event["kept"]}
    assert rules["model.language_model.norm.weight"] == "deliberate_fp32"
    assert rules["model.language_model.rotary_emb.inv_freq"] == "rotary"


# --- hand-over in the consumer's dtype: projectors written into the embeddings by index ------


def _train_only(model, *prefixes):
    model.train()
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith(prefixes)
    return model


def _internvl_mlp1_fp32():
    """InternVL-Chat's finetune recipe: ``mlp1`` trained (in fp32), the rest frozen bf16."""
    model = _train_only(InternVLTiny(torch.bfloat16), "mlp1")
    model.mlp1.float()
    return model


def _deepseek_aligner_fp32():
    model = _train_only(DeepSeekVLTiny(torch.bfloat16), "aligner")
    model.aligner.float()
    return model


@pytest.mark.parametrize("build", [_internvl_mlp1_fp32, _deepseek_aligner_fp32])
def test_fp32_projector_written_by_index_put_trains_with_no_flag(trainer_for, build):
    model = build()
    batch = remote_batch(model, batch_size=4)
    with pytest.raises(RuntimeError):  # without the guard: the pixels, then the index put
        trainer_for(build(), batch).train()
    guard = PrecisionGuardCallback()
    trainer = trainer_for(model, batch, callbacks=[guard])
    projector = "mlp1" if isinstance(model, InternVLTiny) else "aligner"
    assert guard.handle.exit == [projector]
    head = model.get_submodule(projector)
    out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert {p.dtype for p in head.parameters()} == {torch.float32}  # kept as trained
    assert model.language_model.get_input_embeddings().weight.dtype == torch.bfloat16


def test_deepseek_vl_bf16_autocast_features_into_fp32_trainable_embeddings(trainer_for):
    """``bf16=True`` with the aligner and the LLM trained: the guard keeps trainable weights in
    fp32 (``embed_tokens`` too, so ``inputs_embeds`` are fp32) while autocast makes the
    aligner's output bf16; the exit hook hands it over in fp32."""
    model = _train_only(DeepSeekVLTiny(torch.bfloat16), "aligner", "language_model")
    batch = remote_batch(model, batch_size=4)
    trainer = trainer_for(model, batch, callbacks=[PrecisionGuardCallback()], bf16=True)
    emb = model.language_model.get_input_embeddings().weight
    assert emb.dtype == torch.float32 and emb.requires_grad
    out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
