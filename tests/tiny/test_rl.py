"""``hf_precision.tiny.rl``: the prompts, the Llama over the tiny tokenizer, and a real
``trl.GRPOTrainer`` built with the tiny defaults and the caller's overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_precision.tiny import tiny_llava, tiny_llava_processor
from hf_precision.tiny.rl import (
    PROMPT_SHAPES,
    grpo_config,
    image_prompts,
    length_reward,
    rl_llama,
    text_prompts,
    tiny_grpo,
)

trl = pytest.importorskip("trl", reason="TRL is in the 'integrations' test extra")


def test_prompts_hold_the_images_as_asked_and_the_texts_in_turn() -> None:
    one = image_prompts(4)
    assert len(one) == 4 and len(PROMPT_SHAPES) == 4
    assert one[0]["prompt"][0]["content"][1]["text"] == "what is in the image ?"
    assert one[1]["image"].size == (30, 30) and "images" not in one.column_names
    listed = image_prompts(column="images")
    assert len(listed) == 2 and len(listed[0]["images"]) == 1
    assert text_prompts(3)["prompt"] == ["a red square", "a blue circle", "a red square"]
    assert length_reward(["ab", ["c"]]) == [2.0, 5.0]


def test_the_llama_speaks_the_tiny_tokenizer_and_is_seeded() -> None:
    model, tok = rl_llama()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.vocab_size == len(tok) == len(tiny_llava_processor().tokenizer)
    assert model.config.pad_token_id == tok.pad_token_id and model.config.hidden_size == 16
    again, _ = rl_llama(None, hidden_size=32, num_hidden_layers=2)
    assert {p.dtype for p in again.parameters()} == {torch.float32}
    assert again.config.hidden_size == 32 and again.config.num_hidden_layers == 2
    same, _ = rl_llama()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))


def test_the_config_is_a_tiny_cpu_step_and_overrides_win(tmp_path: Path) -> None:
    args = grpo_config(tmp_path, max_completion_length=4, seed=3)
    assert isinstance(args, trl.GRPOConfig) and args.output_dir == str(tmp_path)
    assert args.use_cpu and args.bf16 and args.max_steps == 1 and args.beta == 0.0
    assert (args.per_device_train_batch_size, args.num_generations) == (2, 2)
    assert args.max_completion_length == 4 and args.seed == 3 and args.report_to == []


def test_a_real_grpo_trainer_on_the_tiny_llava(tmp_path: Path) -> None:
    from transformers import TrainerCallback

    class Seen(TrainerCallback):
        pass

    seen = Seen()
    trainer = tiny_grpo(tmp_path, tiny_llava(), callbacks=[seen], max_completion_length=4)
    assert isinstance(trainer, trl.GRPOTrainer)
    assert trainer.args.max_completion_length == 4 and trainer.args.bf16
    assert [f.__name__ for f in trainer.reward_funcs] == ["length_reward"]
    assert len(trainer.train_dataset) == 2 and seen in trainer.callback_handler.callbacks
    assert type(trainer.processing_class).__name__ == type(tiny_llava_processor()).__name__
