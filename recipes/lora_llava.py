#!/usr/bin/env python
"""LoRA fine-tuning of LLaVA with the precision guard: one file, meant to be copied and edited.

Launch (tiny model built offline, synthetic shapes data, CPU, under a minute of CPU here)::

    python recipes/lora_llava.py --config recipes/configs/llava/tiny.yaml

A real checkpoint, from a local folder, on a GPU::

    python recipes/lora_llava.py --config recipes/configs/llava/llava-1.5-7b-bf16.yaml

Any field of the config can be overridden on the command line, e.g. ``--max_steps 5``,
``--lora_targets language_model,projector`` or ``--no_guard`` (train without the guard).

Reading order: 1 arguments, 2 data (LLaVA conversation JSON/JSONL -> ``datasets``), 3 model +
processor, 4 LoRA, 5 trainer (with ``PrecisionGuardCallback``) that answers eval questions with
``generate()``, 6 main: train, save the adapter and the precision report.

Data format (LLaVA-Instruct style; JSON list or JSONL, one record per line)::

    {"id": "0", "image": "images/00000.png",
     "conversations": [{"from": "human", "value": "<image>\\nwhat is in the image ?"},
                       {"from": "gpt", "value": "a red circle"}]}

``image`` is relative to ``--image_folder`` (default: the data file's folder). All turns but the
last are the prompt; the last ``gpt`` turn is the training target (the prompt is masked out of
the loss).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file
from transformers import HfArgumentParser, Trainer, TrainingArguments

from hf_precision import PrecisionGuardCallback, dtype_map
from hf_precision.report.wandb_tracker import wandb_offline_unless_logged_in

# peft still asks transformers 5 for the old name: not this recipe's concern, not its output
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")

# ----------------------------------------------------------------------------- 1. arguments


def arg(default: Any, help: str) -> Any:
    """A dataclass field with ``--help`` text (what ``HfArgumentParser`` shows)."""
    return field(default=default, metadata={"help": help})


@dataclass
class ModelArguments:
    model_name_or_path: str = arg(
        "tiny", "'tiny' (built offline from a config) or a local checkpoint folder"
    )
    dtype: str = arg(
        "bfloat16", "dtype the checkpoint is loaded in: bfloat16 | float16 | float32 | auto"
    )
    tiny_fp32_groups: str = arg(
        "vision_encoder,projector",
        "tiny only: groups left in float32 "
        "after loading, the split real checkpoints often arrive with "
        "(vision tower loaded separately, projector saved in fp32)",
    )
    attn_implementation: str = arg("sdpa", "sdpa | eager | ...")
    guard: bool = arg(True, "add PrecisionGuardCallback (--no_guard trains without it)")
    guard_mode: str = arg("fix", "audit | fix | raise")


@dataclass
class DataArguments:
    data_path: str | None = arg(
        None,
        "train JSON/JSONL in the LLaVA conversation format; "
        "None: generate the shapes set under <output_dir>/data",
    )
    eval_data_path: str | None = arg(None, "eval JSON/JSONL")
    image_folder: str | None = arg(
        None, "folder the 'image' paths are relative to (default: the data file's folder)"
    )
    num_synthetic_train: int = arg(64, "synthetic train size")
    num_synthetic_eval: int = arg(8, "synthetic eval size")
    num_generate: int = arg(4, "eval examples answered with generate() at every evaluation")
    max_new_tokens: int = arg(8, "generate() budget per answer")


@dataclass
class LoraArguments:
    lora_r: int = arg(8, "LoRA rank")
    lora_alpha: int = arg(16, "LoRA scaling numerator")
    lora_dropout: float = arg(0.05, "dropout on the LoRA input")
    lora_targets: str = arg(
        "language_model",
        "comma list of: language_model (attention q/k/v/o), projector, vision_encoder, lm_head",
    )
    lora_target_regex: str | None = arg(
        None, "full-match regex over module names; replaces lora_targets"
    )
    train_fully: str = arg(
        "",
        "comma list of modules trained in full next to the adapters "
        "(peft modules_to_save): projector, lm_head",
    )


# Module names in transformers 5.x LLaVA. The language-model pattern is anchored on
# `language_model`, so the vision tower's own q_proj/v_proj are never hit by default.
LORA_TARGETS = {
    "language_model": (
        r"model\.language_model\.layers\.\d+\.self_attn\."
        r"(q_proj|k_proj|v_proj|o_proj)"
    ),
    "projector": r"model\.multi_modal_projector\.linear_[12]",
    "vision_encoder": r"model\.vision_tower\..*\.self_attn\.(q_proj|k_proj|v_proj|out_proj)",
    "lm_head": r"lm_head",
}
#: --train_fully names -> the module peft copies and trains in full (modules_to_save)
FULLY_TRAINED = {"projector": "multi_modal_projector", "lm_head": "lm_head"}
ARG_CLASSES: tuple[Any, ...] = (ModelArguments, DataArguments, LoraArguments, TrainingArguments)


def parse_args(argv: list[str] | None = None) -> tuple[Any, ...]:
    """``--config file.yaml`` gives the defaults (``yaml.safe_load``); other flags override."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    parser = HfArgumentParser(ARG_CLASSES)
    if known.config:
        config = yaml.safe_load(Path(known.config).read_text()) or {}
        allowed = {f.name for cls in ARG_CLASSES for f in fields(cls) if f.init}
        unknown = sorted(set(config) - allowed)
        if unknown:
            raise SystemExit(
                f"{known.config}: unknown field(s) {unknown}; see "
                f"`python {sys.argv[0]} --help` for the allowed ones"
            )
        # Strings go through argparse's type conversion (so '1e-3' becomes a float).
        parser.set_defaults(**{k: str(v) if isinstance(v, float) else v for k, v in config.items()})
    model_args, data_args, lora_args, train_args = parser.parse_args_into_dataclasses(rest)
    for name in ("data_path", "eval_data_path", "image_folder"):
        value = getattr(data_args, name)
        if value:
            setattr(data_args, name, str(Path(value).expanduser().resolve()))
    train_args.output_dir = str(Path(train_args.output_dir).expanduser().resolve())
    if model_args.model_name_or_path != "tiny":
        model_args.model_name_or_path = str(
            Path(model_args.model_name_or_path).expanduser().resolve()
        )
    return model_args, data_args, lora_args, train_args


def check_paths(model_args: ModelArguments, data_args: DataArguments) -> None:
    """Fail before loading anything big when a local path is missing."""
    path = model_args.model_name_or_path
    if path != "tiny" and not Path(path).is_dir():
        raise SystemExit(
            f"model_name_or_path {path} is not a folder. Fix: download it once, "
            "e.g. `hf download llava-hf/llava-1.5-7b-hf --local-dir "
            f"{path}`, or pass --model_name_or_path tiny"
        )
    for name in ("data_path", "eval_data_path", "image_folder"):
        value = getattr(data_args, name)
        if value and not Path(value).exists():
            raise SystemExit(
                f"{name} {value} does not exist. Fix: point it at your data, or "
                f"drop --data_path to train on the generated shapes set"
            )


# ----------------------------------------------------------------------------- 2. data


def load_data(data_args: DataArguments, output_dir: str) -> tuple[Any, Any, str, str]:
    """Train/eval ``datasets`` splits and the image folder of each."""
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()  # two tiny JSONL files: no "Generating train split" bars
    if data_args.data_path is None:
        from hf_precision.tiny.data import make_shapes_dataset

        files = make_shapes_dataset(
            Path(output_dir) / "data",
            n_train=data_args.num_synthetic_train,
            n_eval=data_args.num_synthetic_eval,
        )
        data_args.data_path, data_args.eval_data_path = str(files["train"]), str(files["eval"])
    data_files = {"train": data_args.data_path}
    if data_args.eval_data_path:
        data_files["eval"] = data_args.eval_data_path
    ds = load_dataset("json", data_files=data_files)
    folder = data_args.image_folder or str(Path(data_args.data_path).parent)
    eval_folder = data_args.image_folder or str(Path(data_args.eval_data_path or ".").parent)
    return ds["train"], ds.get("eval"), folder, eval_folder


def to_messages(conversations: list[dict[str, str]]) -> tuple[list[dict[str, Any]], str]:
    """LLaVA turns -> chat messages (all but the last turn) and the target answer (last turn)."""
    *context, last = conversations
    if last["from"] != "gpt":
        raise ValueError(f"the last turn must come from 'gpt', got {last['from']!r}")
    messages = []
    for turn in context:
        role = {"human": "user", "gpt": "assistant"}.get(turn["from"], turn["from"])
        text = turn["value"]
        content: list[dict[str, str]] = []
        if "<image>" in text:
            content.append({"type": "image"})
            text = text.replace("<image>", "").strip()
        content.append({"type": "text", "text": text})
        messages.append({"role": role, "content": content})
    return messages, last["value"]


@dataclass
class ConversationCollator:
    """Rows -> model batch. Prompt tokens and padding get label -100, the answer is learnt."""

    processor: Any
    image_folder: str

    def encode(self, rows: list[dict[str, Any]], *, with_answers: bool) -> tuple[Any, list[str]]:
        from PIL import Image

        images, prompts, fulls, answers = [], [], [], []
        eos = self.processor.tokenizer.eos_token
        for row in rows:
            messages, answer = to_messages(row["conversations"])
            images.append(Image.open(os.path.join(self.image_folder, row["image"])).convert("RGB"))
            prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True)
            # The whole conversation through the template, so the answer is spaced and closed
            # exactly as the model will generate it; the prompt is a prefix of it.
            reply = {"role": "assistant", "content": [{"type": "text", "text": answer}]}
            full = self.processor.apply_chat_template([*messages, reply])
            full = full if full.startswith(prompt) else prompt + answer
            prompts.append(prompt)
            fulls.append(full if eos in full[len(prompt) :] else full + eos)
            answers.append(answer)
        texts = fulls if with_answers else prompts
        side = "right" if with_answers else "left"  # generation needs left padding
        batch = self.processor(
            images=images, text=texts, padding=True, padding_side=side, return_tensors="pt"
        )
        if with_answers:
            # The prompt alone, through the same processor, gives each row's prompt length
            # (image placeholders expanded exactly as in the full text).
            prompt_ids = self.processor(
                images=images, text=prompts, padding=True, return_tensors="pt"
            )["attention_mask"].sum(1)
            labels = batch["input_ids"].clone()
            labels[batch["attention_mask"] == 0] = -100
            for i, n in enumerate(prompt_ids.tolist()):
                labels[i, :n] = -100
            batch["labels"] = labels
        return batch, answers

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        return self.encode(rows, with_answers=True)[0]


# ----------------------------------------------------------------------------- 3. model


def load_model(model_args: ModelArguments) -> tuple[Any, Any]:
    """Model + processor: built offline for ``tiny``, else from a local folder."""
    from hf_precision.rules.dtypes import parse_dtype

    dtype = "auto" if model_args.dtype == "auto" else parse_dtype(model_args.dtype, call="--dtype")
    if model_args.model_name_or_path == "tiny":
        from hf_precision import find_module_groups
        from hf_precision.tiny import tiny_llava, tiny_llava_processor

        model: Any = tiny_llava()
        processor = tiny_llava_processor()
        if isinstance(dtype, torch.dtype):
            model.to(dtype)
            # Plant the split real checkpoints arrive with: some groups stay fp32.
            groups = find_module_groups(model)
            for group in filter(None, model_args.tiny_fp32_groups.split(",")):
                for module in groups.modules(group.strip()):
                    module.to(torch.float32)
        return model, processor
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = model_args.model_name_or_path
    model = LlavaForConditionalGeneration.from_pretrained(
        path, dtype=dtype, attn_implementation=model_args.attn_implementation, local_files_only=True
    )
    return model, AutoProcessor.from_pretrained(path, local_files_only=True)


# ----------------------------------------------------------------------------- 4. LoRA


def apply_lora(model: Any, lora_args: LoraArguments) -> Any:
    from peft import LoraConfig, get_peft_model

    regex = lora_args.lora_target_regex
    if regex is None:
        names = [t.strip() for t in lora_args.lora_targets.split(",") if t.strip()]
        bad = sorted(set(names) - set(LORA_TARGETS))
        if bad:
            raise SystemExit(f"--lora_targets: unknown {bad}; allowed: {sorted(LORA_TARGETS)}")
        regex = "|".join(f"({LORA_TARGETS[n]})" for n in names)
    full = [t.strip() for t in lora_args.train_fully.split(",") if t.strip()]
    bad = sorted(set(full) - set(FULLY_TRAINED))
    if bad:
        raise SystemExit(f"--train_fully: unknown {bad}; allowed: {sorted(FULLY_TRAINED)}")
    config = LoraConfig(
        r=lora_args.lora_r,
        lora_alpha=lora_args.lora_alpha,
        lora_dropout=lora_args.lora_dropout,
        target_modules=regex,
        task_type="CAUSAL_LM",
        modules_to_save=[FULLY_TRAINED[n] for n in full] or None,
    )
    return get_peft_model(model, config)


# ----------------------------------------------------------------------------- 5. trainer


class GenerateEvalTrainer(Trainer):
    """``evaluate()`` also answers a few eval questions with ``generate()`` (the path that
    pre-encodes images outside the training forward) and logs the exact-match accuracy."""

    def __init__(
        self,
        *args: Any,
        eval_collator: ConversationCollator | None = None,
        generate_rows: list[dict[str, Any]] | None = None,
        max_new_tokens: int = 8,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.eval_collator, self.generate_rows = eval_collator, generate_rows or []
        self.max_new_tokens = max_new_tokens
        self.generations: list[dict[str, Any]] = []

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        metrics = super().evaluate(*args, **kwargs)
        if self.generate_rows and self.eval_collator is not None:
            answers = self.generate_answers(self.generate_rows)
            accuracy = sum(a["prediction"] == a["answer"] for a in answers) / len(answers)
            self.generations.append(
                {"step": self.state.global_step, "answers": answers, "accuracy": accuracy}
            )
            metrics["eval_answer_accuracy"] = accuracy
            self.log({"eval_answer_accuracy": accuracy})
        return metrics

    @torch.no_grad()
    def generate_answers(self, rows: list[dict[str, Any]]) -> list[dict[str, str]]:
        assert self.eval_collator is not None
        batch, answers = self.eval_collator.encode(rows, with_answers=False)
        batch = self._prepare_inputs(dict(batch))  # to the model's device
        model: Any = self.model
        was_training = model.training
        model.eval()
        out = model.generate(**batch, max_new_tokens=self.max_new_tokens, do_sample=False)
        model.train(was_training)
        new = out[:, batch["input_ids"].shape[1] :]
        texts = self.eval_collator.processor.batch_decode(new, skip_special_tokens=True)
        return [{"answer": a, "prediction": t.strip()} for a, t in zip(answers, texts)]


def answers_table(
    before: list[dict[str, str]], after: list[dict[str, str]], *, step: int, rows: int = 8
) -> str:
    """Held-out answers before training and after ``step`` steps, and the accuracy of each."""

    def acc(answers: list[dict[str, str]]) -> str:
        right = sum(a["prediction"] == a["answer"] for a in answers)
        return f"{right}/{len(answers)} = {right / max(len(answers), 1):.0%}"

    lines = [
        f"\nHeld-out answers (exact match): before training {acc(before)}, after {step} "
        f"steps {acc(after)}",
        f"  {'want':<20}{'before training':<24}after",
    ]
    for b, a in list(zip(before, after))[:rows]:
        mark = "ok" if a["prediction"] == a["answer"] else "--"
        was = b["prediction"] if len(b["prediction"]) <= 20 else b["prediction"][:19] + "…"
        lines.append(f"  {a['answer']:<20}{was:<24}{a['prediction']:<20}{mark}")
    if len(after) > rows:
        lines.append(f"... {len(after) - rows} more in precision_report.json")
    text = "\n".join(lines)
    print(text)
    return text


def print_group_table(before: Any, after: Any) -> str:
    """Per group: dtypes as loaded, dtypes after the guard, trainable parameters."""

    def fmt(summary: Any) -> str:
        return ", ".join(f"{d}:{n:,}" for d, n in sorted(summary.numel.items())) or "-"

    rows = [("group", "as loaded", "after the guard", "trainable")]
    rows += [
        (
            name,
            fmt(before.groups[name]) if name in before.groups else "-",
            fmt(summary),
            f"{summary.trainable:,}",
        )
        for name, summary in after.groups.items()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(
            f"{c:<{w}}" if i < 3 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(row, widths))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    table = "\n".join(lines)
    print(table)
    return table


# ----------------------------------------------------------------------------- 6. main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    model_args, data_args, lora_args, train_args = parse_args(argv)
    check_paths(model_args, data_args)
    # The collator needs the raw 'image' and 'conversations' columns.
    train_args.remove_unused_columns = False
    if train_args.report_to and "wandb" in train_args.report_to:
        os.environ.setdefault("WANDB_DIR", str(Path(train_args.output_dir).resolve()))
        wandb_offline_unless_logged_in()  # no login: offline, one line, no traceback
    train_ds, eval_ds, folder, eval_folder = load_data(data_args, train_args.output_dir)
    model, processor = load_model(model_args)
    model = apply_lora(model, lora_args)
    before = dtype_map(model)

    callbacks = [PrecisionGuardCallback(mode=model_args.guard_mode)] if model_args.guard else []
    eval_collator = ConversationCollator(processor, eval_folder)
    trainer = GenerateEvalTrainer(
        model=model,
        args=train_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=ConversationCollator(processor, folder),
        eval_collator=eval_collator,
        processing_class=processor,
        callbacks=callbacks,
        max_new_tokens=data_args.max_new_tokens,
        generate_rows=[eval_ds[i] for i in range(min(data_args.num_generate, len(eval_ds)))]
        if eval_ds is not None
        else None,
    )
    # Answers before any training step (the guard is installed: generate() works on the split
    # model), for the before/after table.
    untrained = trainer.generate_answers(trainer.generate_rows) if trainer.generate_rows else []
    trainer.train()
    after = dtype_map(model)

    out = Path(train_args.output_dir)
    adapter_dir = out / "adapter"
    # Only the LoRA weights: frozen base weights (lm_head included) come from the checkpoint.
    model.save_pretrained(adapter_dir, save_embedding_layers=False)
    processor.save_pretrained(adapter_dir)
    # Last-position logits of the trained model on two eval rows: a reloaded adapter must give
    # the same (tests/test_recipes.py checks it).
    if eval_ds is not None:
        check = eval_collator([eval_ds[i] for i in range(min(2, len(eval_ds)))])
        model.eval()
        with torch.no_grad():
            _, outputs = trainer.compute_loss(
                model, trainer._prepare_inputs(dict(check)), return_outputs=True
            )
        # safetensors, not a pickle: nothing in the file runs when it is loaded
        save_file(
            {
                **{f"batch.{k}": v.contiguous() for k, v in dict(check).items()},
                "logits": outputs.logits[:, -1].float().cpu().contiguous(),
            },
            out / "logits_check.safetensors",
        )
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    guard = callbacks[0] if callbacks else None
    report = {
        "model": model_args.model_name_or_path,
        "guard": model_args.guard,
        "policy": guard.policy.to_dict() if guard and guard.policy else None,
        "guard_hooks": repr(guard.handle) if guard else None,
        "loss": {
            "first": losses[0] if losses else None,
            "last": losses[-1] if losses else None,
            "curve": losses,
        },
        "generations": trainer.generations,
        "adapter": str(adapter_dir),
        "dtype_map_before": before.to_dict(),
        "dtype_map_after": after.to_dict(),
    }
    report_path = out / "precision_report.json"

    print("\nPer-group dtypes (parameters per dtype):")
    report["table"] = print_group_table(before, after)
    if guard is not None:
        print(f"Guard hooks: {guard.handle!r}")
    if losses:
        trend = "went down" if losses[-1] < losses[0] else "did NOT go down"
        print(
            f"\nLoss: first {losses[0]:.4f} -> last {losses[-1]:.4f} over {len(losses)} "
            f"logged steps ({trend})"
        )
    if trainer.generations:
        last = trainer.generations[-1]
        report["answers_before"] = untrained
        report["accuracy"] = last["accuracy"]
        report["answers_table"] = answers_table(untrained, last["answers"], step=last["step"])
    print(
        f"Precision report: {report_path}\nPer-event dtype maps: {out / 'precision'}\n"
        f"Adapter: {adapter_dir}"
    )
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        run_dir = Path(wandb.run.dir).parent
        wandb.finish()
        print(f"W&B run (offline; `wandb sync {run_dir}` uploads it): {run_dir}")
        report["wandb_dir"] = str(run_dir)
    report_path.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
