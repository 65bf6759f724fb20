"""TRL's trainers are ``Trainer`` subclasses: the callback works with them unchanged. SFTTrainer
on a tiny LLaVA (a real processor, images in the conversation, LoRA through ``peft_config``)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from peft import LoraConfig

from hf_precision import PrecisionGuardCallback
from hf_precision.tiny import tiny_llava, tiny_llava_processor
from hf_precision.tiny.data import shape_image
from hf_precision.tiny.rl import rl_llama, text_prompts, tiny_grpo

trl = pytest.importorskip("trl", reason="TRL is in the 'integrations' test extra")
LM_ATTN = r".*language_model.*\.(q_proj|v_proj)"


def _dataset() -> Any:
    from datasets import Dataset

    pairs = [("circle", "red"), ("square", "blue"), ("triangle", "green"), ("circle", "yellow")]
    return Dataset.from_list(
        [
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image"},
                            {"type": "text", "text": "what is in the image ?"},
                        ],
                    },
                    {"role": "assistant", "content": [{"type": "text", "text": f"a {c} {s}"}]},
                ],
                "images": [shape_image(s, c)],
            }
            for s, c in pairs
        ]
    )


def _split_llava() -> Any:
    model = tiny_llava(torch.bfloat16)
    model.model.vision_tower.float()  # the tower from another checkpoint, in fp32
    return model


def _trainer(
    kind: str,
    tmp_path: Any,
    model: Any,
    data: Any,
    callbacks: list[Any],
    trainer_kw: dict[str, Any] | None = None,
    **kw: Any,
):
    """``trl.SFTTrainer`` or ``trl.DPOTrainer`` (``kind``): LoRA on the LM's attention, two
    steps on CPU, the tiny LLaVA processor; ``trainer_kw`` go to the trainer (``ref_model``),
    ``kw`` to its config."""
    config = getattr(trl, f"{kind}Config")(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=2,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        max_length=None,
        **kw,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(trl, f"{kind}Trainer")(
            model=model,
            args=config,
            train_dataset=data,
            eval_dataset=data,
            processing_class=tiny_llava_processor(),
            peft_config=LoraConfig(r=4, target_modules=LM_ATTN),
            callbacks=callbacks,
            **(trainer_kw or {}),
        )


def _sft(tmp_path: Any, model: Any, callbacks: list[Any], **kw: Any) -> Any:
    return _trainer("SFT", tmp_path, model, _dataset(), callbacks, **kw)


# SFTConfig turns bf16 on by default: "no flag" is bf16=False said explicitly
@pytest.mark.parametrize("flag", [{"bf16": True}, {"bf16": False}], ids=["bf16", "no-flag"])
def test_sft_trainer_on_a_split_vlm_with_the_callback(tmp_path: Any, flag: dict[str, Any]):
    cb = PrecisionGuardCallback(report=False)
    trainer = _sft(tmp_path, _split_llava(), [cb], **flag)
    model = trainer.model
    out = trainer.train()
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor([out.training_loss, metrics["eval_loss"]])).all()
    assert cb.policy is not None and cb.policy.name == ("bf16" if flag["bf16"] else "bf16-true")
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    lora = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert frozen == {torch.bfloat16} and lora == {torch.float32}  # adapters kept fp32


def test_sft_trainer_without_a_flag_fails_without_the_guard(tmp_path: Any):
    # no autocast: the fp32 tower's features meet the bf16 projector
    trainer = _sft(tmp_path, _split_llava(), [], bf16=False)
    with pytest.raises(RuntimeError, match="same dtype"):
        trainer.train()


def _preferences() -> Any:
    from datasets import Dataset

    pairs = [("circle", "red"), ("square", "blue"), ("triangle", "green"), ("circle", "yellow")]
    ask = [{"type": "image"}, {"type": "text", "text": "what is in the image ?"}]

    def say(text: str) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]

    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": ask}],
                "chosen": say(f"a {c} {s}"),
                "rejected": say(f"a {c} {'circle' if s == 'square' else 'square'}"),
                "images": [shape_image(s, c)],
            }
            for s, c in pairs
        ]
    )


def _dpo(tmp_path: Any, callbacks: list[Any]) -> Any:
    # bf16=False: no flag (DPOConfig, like SFTConfig, defaults to bf16)
    return _trainer("DPO", tmp_path, _split_llava(), _preferences(), callbacks, bf16=False)


def test_dpo_trainer_on_a_split_vlm_fails_without_the_guard_and_trains_with_it(tmp_path: Any):
    """A preference trainer: DPO with LoRA (the reference is the adapter-free base) on the
    split tiny LLaVA, images in the prompts."""
    with pytest.raises(RuntimeError, match="same dtype"):
        _dpo(tmp_path / "bare", []).train()
    cb = PrecisionGuardCallback(report=False)
    trainer = _dpo(tmp_path / "guarded", [cb])
    out = trainer.train()
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor([out.training_loss, metrics["eval_loss"]])).all()
    assert "eval_rewards/margins" in metrics  # the DPO loss ran, chosen against rejected
    model = trainer.model
    lora = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert lora == {torch.float32} and frozen == {torch.bfloat16}


# ---------------------------------------------------------------------- GRPO's fp32 lm_head


def test_grpo_cast_lm_head_to_fp32_keeps_the_head_fp32(tmp_path: Any):
    """TRL's ``cast_lm_head_to_fp32=True`` casts ``lm_head`` to fp32 after the Trainer's
    ``on_init_end``; with the LM frozen under LoRA, rule 5 ("fp32 shared by the whole group")
    cast it back to bf16 at ``on_train_begin``. The callback reads the flag from the trainer's
    arguments: the head is kept (rule ``deliberate_fp32``, its reason naming TRL), bit for bit."""
    model, tok = rl_llama()
    cb = PrecisionGuardCallback()
    trainer = tiny_grpo(
        tmp_path / "grpo",
        model,
        callbacks=[cb],
        peft_config=LoraConfig(r=2, target_modules=["q_proj", "v_proj"]),
        train_dataset=text_prompts(4),
        processing_class=tok,
        max_completion_length=4,
        cast_lm_head_to_fp32=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        head = trainer.model.base_model.model.lm_head.weight
        assert head.dtype == torch.float32 and not head.requires_grad  # TRL's cast
        exact = head.detach().clone()
        result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    head = trainer.model.base_model.model.lm_head.weight
    assert head.dtype == torch.float32 and torch.equal(head, exact)
    assert cb.policy is not None and cb.policy.keep_fp32_head
    kept = {n: (rule, why) for n, _, rule, why in cb.last_report.kept}
    assert kept["lm_head.weight"][0] == "deliberate_fp32"
    assert "cast_lm_head_to_fp32" in kept["lm_head.weight"][1]
    assert [n for e, n in cb.events if e == "on_train_begin"] == [0]
