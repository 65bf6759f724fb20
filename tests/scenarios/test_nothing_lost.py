"""Nothing lost: enforcing a policy keeps tied weights tied, keeps the optimizer's parameters the
model's parameters, and upcasts values bit-exactly; the callback works when added late."""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig, get_peft_model

from hf_precision import PrecisionGuardCallback, enforce_policy
from hf_precision.tiny import tiny_batch, tiny_llava, tiny_paligemma


def _tied(model) -> bool:
    head, embed = model.lm_head.weight, model.model.language_model.embed_tokens.weight
    return head is embed and head.data_ptr() == embed.data_ptr()


def test_tied_weights_share_storage_after_enforcement(trainer_for):
    model = tiny_paligemma()
    assert _tied(model)
    enforce_policy(model, "bf16-true")
    assert _tied(model) and model.lm_head.weight.dtype == torch.bfloat16

    # Through Trainer: the tied pair is trainable, upcast to fp32 once, and trained as one.
    model = tiny_paligemma(torch.bfloat16)
    model.train()
    trainer = trainer_for(
        model,
        tiny_batch(model, 4),
        bf16=True,
        lr_scheduler_type="constant",
        callbacks=[PrecisionGuardCallback()],
    )
    before = model.lm_head.weight.detach().clone()
    assert _tied(model) and model.lm_head.weight.dtype == torch.float32
    trainer.train()
    assert _tied(model) and not torch.equal(before, model.lm_head.weight)
    in_optimizer = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert sum(p is model.lm_head.weight for p in in_optimizer) == 1


def test_optimizer_holds_the_models_parameters_after_a_repair_at_train_begin(trainer_for):
    # Added after construction: no on_init_end, so the first cast happens at on_train_begin,
    # after the optimizer exists. The optimizer must still hold the very same Parameters.
    model = tiny_llava(torch.bfloat16)
    model.train()
    trainer = trainer_for(model, tiny_batch(model, 4), bf16=True)
    trainer.create_optimizer()
    held = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in held} == {torch.bfloat16}
    guard = PrecisionGuardCallback()
    trainer.add_callback(guard)

    out = trainer.train()

    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert guard.events[0][0] == "on_train_begin" and guard.events[0][1] > 0  # it repaired
    now = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert [id(p) for p in now] == [id(p) for p in held]
    assert {id(p) for p in now} == {id(p) for p in model.parameters() if p.requires_grad}
    assert {p.dtype for p in now} == {torch.float32}
    states = [trainer.optimizer.state[p] for p in now if trainer.optimizer.state[p]]
    assert states  # (weights that got no gradient, e.g. CLIP's unused last layer, have none)
    for state in states:  # Adam moments were created for the fp32 weights
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_upcast_of_trainable_values_is_bit_exact(trainer_for):
    base: Any = tiny_llava(torch.bfloat16)
    # adapters left in bf16 (peft upcasts them to fp32 by default), the projector trained too
    model = get_peft_model(
        base,
        LoraConfig(r=4, target_modules=r".*language_model.*q_proj"),
        autocast_adapter_dtype=False,
    )
    base.model.multi_modal_projector.requires_grad_(True)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert {p.dtype for p in before.values()} == {torch.bfloat16}
    trainer_for(model, tiny_batch(base, 4), bf16=True, callbacks=[PrecisionGuardCallback()])
    after = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(after) == set(before)
    for name, p in after.items():
        assert p.dtype == torch.float32
        assert torch.equal(p, before[name].float()), name  # bf16 -> fp32 loses nothing
        assert torch.equal(p.to(torch.bfloat16), before[name]), name


def test_add_callback_after_construction_enforces_at_train_begin(trainer_for):
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)  # a component split (class B)
    model.train()
    trainer = trainer_for(model, tiny_batch(model, 4), eval_strategy="steps", eval_steps=1)
    guard = PrecisionGuardCallback()
    trainer.add_callback(guard)
    assert guard.events == []  # on_init_end is long gone
    assert trainer.train().global_step == 2
    assert [e for e, _ in guard.events][:2] == ["on_train_begin", "before_evaluate"]
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # fp32 majority, coherent
