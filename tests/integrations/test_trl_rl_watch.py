"""The RL watchers on a real TRL ``GRPOTrainer`` (``use_vllm=False``, a real reward function):
the tiny LLaVA with LoRA on a bf16 base, and a full fine-tune; a tiny Llama with TRL's
continuous-batching generate (TRL refuses it for a VLM)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

from hf_precision import PrecisionGuardCallback
from hf_precision.integrations.trl_rl_watch import completion_batch
from hf_precision.tiny import tiny_llava
from hf_precision.tiny.rl import image_prompts, rl_llama, text_prompts, tiny_grpo
from hf_precision.watch.rl_attribution import attribute_gap, token_log_probs

trl = pytest.importorskip("trl", reason="TRL is in the 'integrations' test extra")
LM_ATTN = r".*language_model.*\.(q_proj|v_proj)"


def _grpo(tmp_path: Any, model: Any, callbacks: list[Any], *, peft: Any, **kw: Any) -> Any:
    """One GRPO step of 6 tokens; the images in a list (TRL's ``images`` column)."""
    kw.setdefault("train_dataset", image_prompts(column="images"))
    kw.setdefault("max_completion_length", 6)
    return tiny_grpo(tmp_path, model, callbacks=callbacks, peft_config=peft, **kw)


def _lora() -> LoraConfig:
    # random B, scaled up: the adapters take part from the first generation on
    return LoraConfig(r=4, lora_alpha=32, target_modules=LM_ATTN, init_lora_weights=False)


def test_lora_on_a_bf16_base_the_adapters_make_the_gap(
    tmp_path: Any, caplog: Any, monkeypatch: Any
):
    """TRL's HF-generate sampler runs the PEFT model outside autocast (fp32 adapters), the
    trainer under bf16 autocast (bf16 adapters): the attribution names the adapters, ~100 %."""
    from hf_precision.watch import rl_attribution

    monkeypatch.setattr(rl_attribution, "GAP_THRESHOLD", 1e-4)  # this tiny model's gap: ~3e-4
    torch.manual_seed(0)
    cb = PrecisionGuardCallback(report=False, rl="measure")  # no match: the gap stays
    trainer = _grpo(tmp_path, tiny_llava(torch.bfloat16), [cb], peft=_lora())
    params = {n: p for n, p in trainer.model.named_parameters()}
    with caplog.at_level(logging.WARNING, logger="hf_precision"):
        trainer.train()
    found = cb.guard.sections["rl_attribution"]
    assert found["top"] == "adapters" and found["shares"]["adapters"] > 0.95
    assert found["gap_mean"] > 0 and found["first_parted_group"] == "adapters"
    assert "adapters: " in caplog.text and "% of the gap; fix:" in caplog.text
    # nothing of the model was replaced; the watchers came off at the end of training
    assert all(p is params[n] for n, p in trainer.model.named_parameters())
    assert "_generate_single_turn" not in vars(trainer)
    assert "merge_adapter" not in vars(trainer.model)


def test_full_fine_tune_the_head_makes_the_largest_share(tmp_path: Any):
    """A full fine-tune (fp32 weights, bf16 autocast): TRL's generate runs under accelerate's
    autocast wrapper, so no gap is attributed in the run; the same tokens scored by a sampler
    outside autocast part mostly at ``lm_head``. The model comes back bit for bit."""
    torch.manual_seed(0)
    cb = PrecisionGuardCallback(report=False)
    trainer = _grpo(tmp_path, tiny_llava(torch.float32), [cb], peft=None)
    seen: list[dict[str, Any]] = []
    inner = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: seen.append(inner(inputs)) or seen[-1]
    trainer.train()
    assert "rl_attribution" not in cb.guard.sections  # the sampler ran under the same autocast
    model = trainer.model
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    optimizer_params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    batch, keep, mask = completion_batch(seen[0])
    found = attribute_gap(model, batch, keep=keep, score=token_log_probs, mask=mask)
    assert found.top == "lm_head" and found.shares["lm_head"] > 0.3, found.line()
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]) and p.dtype == torch.float32
    assert [p for g in trainer.optimizer.param_groups for p in g["params"]] == optimizer_params
    assert model.training  # the Trainer's mode back


class _Sync(TrainerCallback):
    """What TRL's vLLM weight sync does to a PEFT model before each generation
    (``vllm_generation._iter_named_params``): merge the adapters into the base, read, unmerge."""

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        model.merge_adapter()
        model.unmerge_adapter()


def test_merge_unmerge_sync_drifts_the_bf16_base(tmp_path: Any, caplog: Any):
    torch.manual_seed(0)
    cb = PrecisionGuardCallback(report=False)
    trainer = _grpo(
        tmp_path,
        tiny_llava(torch.bfloat16),
        [cb, _Sync()],
        peft=_lora(),
        max_steps=2,
        max_completion_length=2,
    )
    with caplog.at_level(logging.WARNING, logger="hf_precision"):
        trainer.train()
    found = cb.guard.sections["sync_integrity"]["findings"]
    syncs = [f for f in found if f["event"] == "merge/unmerge sync"]
    assert len(syncs) == 2 and all(f["changed"] > 0 for f in syncs)
    assert all("q_proj.base_layer.weight" in f["changed_tensors"][0] for f in syncs)
    assert syncs[0]["max_drift"] > 0 and syncs[-1]["since_first_max_drift"] > 0
    assert "merge/unmerge sync changed" in caplog.text and "sync only the adapters" in caplog.text
    assert caplog.text.count("merge/unmerge sync changed") == 1  # said once, kept in the section


def test_continuous_batching_cast_is_restored_under_the_optimizer(tmp_path: Any, caplog: Any):
    """TRL 1.16's continuous-batching generate casts the live model to bf16 and never casts
    back: the fp32 adapters come back fp32, the same Parameter objects the optimizer holds."""
    model, tok = rl_llama()
    cb = PrecisionGuardCallback(report=False)
    trainer = _grpo(
        tmp_path,
        model,
        [cb],
        peft=LoraConfig(r=2, target_modules=["q_proj", "v_proj"]),
        train_dataset=text_prompts(),
        processing_class=tok,
        use_transformers_continuous_batching=True,
        # a small paged cache: sized from the memory by default, which takes long on a CPU
        transformers_continuous_batching_config={"num_blocks": 16, "max_batch_tokens": 64},
        max_completion_length=2,
    )
    adapters = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    with caplog.at_level(logging.WARNING, logger="hf_precision"):
        trainer.train()
    assert {p.dtype for p in adapters.values()} == {torch.float32}
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert {id(p) for p in adapters.values()} <= in_optimizer
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values() if s)
    found = cb.guard.sections["sync_integrity"]["findings"][0]
    assert found["event"] == "generation" and found["restored"] == len(adapters)
    assert {(c["was"], c["is"]) for c in found["dtype_changes"]} == {("float32", "bfloat16")}
    assert "cast" in caplog.text and "use_transformers_continuous_batching" in caplog.text
