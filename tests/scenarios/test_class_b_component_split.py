"""Class B — component dtype split: the vision encoder comes from an fp16 checkpoint, the LLaVA
pre-training stage saved the projector in fp32, the LM was loaded in bf16. Nothing casts the
groups together, so the projector receives another dtype than its weights."""

from __future__ import annotations

import pytest
import torch

from hf_precision import PrecisionGuardCallback, PrecisionPolicy, dtype_map
from hf_precision.tiny import tiny_batch, tiny_llava

# the fp16 tower's features reach the fp32 projector (CPU wording of the matmul check)
HALF_INTO_FP32 = r"expected m1 and m2 to have the same dtype, but got: c10::Half != float"


def _split_llava():
    model = tiny_llava(torch.bfloat16)
    model.model.vision_tower.to(torch.float16)
    model.model.multi_modal_projector.to(torch.float32)
    model.train()
    return model


def test_without_guard_the_split_fails_in_training(trainer_for):
    model = _split_llava()
    trainer = trainer_for(model, tiny_batch(model, batch_size=4))
    with pytest.raises(RuntimeError, match=HALF_INTO_FP32):
        trainer.train()


def test_guard_casts_the_groups_together(trainer_for):
    model = _split_llava()
    guard = PrecisionGuardCallback()
    trainer = trainer_for(
        model,
        tiny_batch(model, batch_size=4),
        callbacks=[guard],
        eval_strategy="steps",
        eval_steps=2,
    )
    assert guard.policy is not None and guard.policy.name == "bf16-true"  # the majority dtype
    dmap = dtype_map(model)
    for group in ("vision_encoder", "language_model", "lm_head"):
        assert dmap.groups[group].dtypes == ("bfloat16",), group
    # the projector is trained and was saved in fp32 on purpose: no flag lowers it
    assert dmap.groups["projector"].dtypes == ("float32",)

    out = trainer.train()

    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    projector = {id(p) for p in model.model.multi_modal_projector.parameters()}
    assert {p.dtype for p in model.parameters() if id(p) not in projector} == {torch.bfloat16}
    assert {p.dtype for p in model.model.multi_modal_projector.parameters()} == {torch.float32}
    assert guard.events[0] == ("on_init_end", guard.events[0][1]) and guard.events[0][1] > 0
    assert all(n == 0 for _, n in guard.events[1:])  # nothing drifted afterwards
    seq = model.generate(
        **{k: v for k, v in tiny_batch(model).items() if k != "labels"}, max_new_tokens=2
    )
    assert seq.shape[1] == tiny_batch(model)["input_ids"].shape[1] + 2


def test_a_deliberate_split_is_kept_and_bridged(trainer_for, record_inputs):
    # Per-group override: keep the frozen vision encoder in fp32, the rest in bf16 (a group
    # override applies to frozen weights; trainable ones follow trainable_dtype).
    model = _split_llava()
    model.model.vision_tower.requires_grad_(False)
    policy = PrecisionPolicy.from_preset("bf16-true", group_dtypes={"vision_encoder": "fp32"})
    trainer = trainer_for(
        model, tiny_batch(model, batch_size=4), callbacks=[PrecisionGuardCallback(policy)]
    )
    projector_in = record_inputs(model.model.multi_modal_projector)

    assert trainer.train().global_step == 2

    assert {p.dtype for p in model.model.vision_tower.parameters()} == {torch.float32}
    assert {p.dtype for p in model.model.multi_modal_projector.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.model.language_model.parameters()} == {torch.bfloat16}
    assert set(projector_in) == {torch.bfloat16}  # the boundary guard bridged fp32 -> bf16
