#!/usr/bin/env python
"""LoRA fine-tuning of MiniCPM-V with the precision guard: one file, meant to be copied and edited.

Launch (tiny MiniCPM-V 2.x layout built offline, bf16, synthetic shapes data, CPU)::

    python recipes/lora_minicpmv.py --config recipes/configs/minicpmv/tiny.yaml

Real checkpoints from a local folder, on a GPU::

    python recipes/lora_minicpmv.py --config recipes/configs/minicpmv/minicpm-v-4_6-bf16.yaml
    python recipes/lora_minicpmv.py --config recipes/configs/minicpmv/minicpm-v-2_6-remote-bf16.yaml

Two layouts are supported: the native transformers model (``minicpmv4_6``:
``model.vision_tower`` / ``model.merger`` / ``model.language_model``) and the MiniCPM-V 2.x
remote-code layout (``vpm`` / ``resampler`` / ``llm``), which is loaded only with an explicit
``trust_remote_code: true``. The 2.x resampler adds a numpy sin-cos table to its keys in fp32,
so a bf16 model fails in ``generate()`` with ``mat1 and mat2 must have the same dtype, but got
Float and BFloat16``; ``--no_guard`` shows it, the default (guard on) trains and answers.

Data: the LLaVA conversation format documented in ``recipes/lora_llava.py`` (JSON/JSONL records
with ``image`` and ``conversations``); without ``--data_path`` the shapes set is generated.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import save_file
from transformers import HfArgumentParser, Trainer, TrainingArguments

from hf_precision import PrecisionGuardCallback, dtype_map
from hf_precision.report.wandb_tracker import wandb_offline_unless_logged_in

# ----------------------------------------------------------------------------- 1. arguments


def arg(default: Any, help: str) -> Any:
    """A dataclass field with ``--help`` text (what ``HfArgumentParser`` shows)."""
    return field(default=default, metadata={"help": help})


@dataclass
class ModelArguments:
    model_name_or_path: str = arg(
        "tiny", "'tiny' (the MiniCPM-V 2.x layout built offline) or a local checkpoint folder"
    )
    trust_remote_code: bool = arg(
        False, "run the checkpoint's own Python code (MiniCPM-V 2.x); read it first"
    )
    dtype: str = arg(
        "bfloat16", "dtype the checkpoint is loaded in: bfloat16 | float16 | float32 | auto"
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
        "comma list of: language_model (attention "
        "q/k/v/o), projector (resampler / merger), "
        "vision_encoder, lm_head",
    )
    lora_target_regex: str | None = arg(
        None, "full-match regex over module names; replaces lora_targets"
    )


# Module names per layout. The language-model patterns are anchored on `llm.` /
# `language_model.`, so the vision tower's own q_proj/v_proj are never hit by default.
LORA_TARGETS = {
    "remote": {  # MiniCPM-V 2.x (as OpenBMB's finetune/finetune.py, plus o_proj)
        "language_model": r"llm\.model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)",
        "projector": r"resampler\.kv_proj",
        "vision_encoder": r"vpm\..*\.(q_proj|k_proj|v_proj|out_proj|qkv)",
        "lm_head": r"llm\.lm_head",
    },
    "native": {  # transformers MiniCPMV4_6ForConditionalGeneration
        "language_model": (
            r"model\.language_model\.layers\.\d+\.self_attn\."
            r"(q_proj|k_proj|v_proj|o_proj)"
        ),
        "projector": r"model\.merger\..*linear_[12]",
        "vision_encoder": r"model\.vision_tower\..*\.self_attn\.(q_proj|k_proj|v_proj|out_proj)",
        "lm_head": r"lm_head",
    },
}
ARG_CLASSES: tuple[Any, ...] = (ModelArguments, DataArguments, LoraArguments, TrainingArguments)
# MiniCPM-V 2.x chat prompts mark the image with this string; its processor expands it.
REMOTE_IMAGE_PLACEHOLDER = "(<image>./</image>)"


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
        repo = "openbmb/MiniCPM-V-2_6" if model_args.trust_remote_code else "openbmb/MiniCPM-V-4.6"
        raise SystemExit(
            f"model_name_or_path {path} is not a folder. Fix: download it once, "
            f"e.g. `hf download {repo} --local-dir {path}`, or pass "
            "--model_name_or_path tiny"
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
    from datasets import load_dataset

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


def to_messages(
    conversations: list[dict[str, str]], remote_code: bool
) -> tuple[list[dict[str, Any]], str]:
    """LLaVA turns -> chat messages (all but the last turn) and the target answer (last turn).

    Native processors take typed content (``{"type": "image"}``); MiniCPM-V 2.x remote code
    takes a string with its image placeholder."""
    *context, last = conversations
    if last["from"] != "gpt":
        raise ValueError(f"the last turn must come from 'gpt', got {last['from']!r}")
    messages = []
    for turn in context:
        role = {"human": "user", "gpt": "assistant"}.get(turn["from"], turn["from"])
        text, has_image = turn["value"].replace("<image>", "").strip(), "<image>" in turn["value"]
        content: Any
        if remote_code:
            content = f"{REMOTE_IMAGE_PLACEHOLDER}\n{text}" if has_image else text
        else:
            content = ([{"type": "image"}] if has_image else []) + [{"type": "text", "text": text}]
        messages.append({"role": role, "content": content})
    return messages, last["value"]


@dataclass
class ConversationCollator:
    """Rows -> model batch. Prompt tokens and padding get label -100, the answer is learnt."""

    processor: Any
    image_folder: str
    remote_code: bool = False

    def _process(self, images: list[Any], texts: list[str], side: str) -> Any:
        if self.remote_code:  # MiniCPM-V 2.x processor: text first, one image list per row
            return self.processor(text=texts, images=[[im] for im in images], return_tensors="pt")
        return self.processor(
            images=images, text=texts, padding=True, padding_side=side, return_tensors="pt"
        )

    def encode(self, rows: list[dict[str, Any]], *, with_answers: bool) -> tuple[Any, list[str]]:
        from PIL import Image

        images, prompts, fulls, answers = [], [], [], []
        template = self.processor.tokenizer if self.remote_code else self.processor
        eos = self.processor.tokenizer.eos_token
        for row in rows:
            messages, answer = to_messages(row["conversations"], self.remote_code)
            images.append(Image.open(os.path.join(self.image_folder, row["image"])).convert("RGB"))
            prompt = template.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            # The whole conversation through the template, so the answer is spaced and closed
            # exactly as the model will generate it; the prompt is a prefix of it.
            text = answer if self.remote_code else [{"type": "text", "text": answer}]
            full = template.apply_chat_template(
                [*messages, {"role": "assistant", "content": text}], tokenize=False
            )
            full = full if full.startswith(prompt) else prompt + answer
            prompts.append(prompt)
            fulls.append(full if eos in full[len(prompt) :] else full + eos)
            answers.append(answer)
        texts = fulls if with_answers else prompts
        batch = self._process(images, texts, "right" if with_answers else "left")
        if with_answers:
            # Answer length = full length - prompt length (both through the processor, so
            # image placeholders expand the same); the answer is the last real tokens of a row,
            # whichever side the processor pads.
            n_prompt = self._process(images, prompts, "right")["attention_mask"].sum(1)
            mask = batch["attention_mask"].bool()
            labels = torch.full_like(batch["input_ids"], -100)
            for i, n_full in enumerate(mask.sum(1).tolist()):
                real = mask[i].nonzero().flatten()
                keep = real[int(n_prompt[i]) : n_full]
                labels[i, keep] = batch["input_ids"][i, keep]
            batch["labels"] = labels
        return batch, answers

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        return self.encode(rows, with_answers=True)[0]


# ----------------------------------------------------------------------------- 3. model


def tiny_processor() -> Any:
    """Stand-in for the checkpoint's processor, for the tiny 2.x model: the tiny tokenizer and
    a ``LlavaProcessor`` sized so ``<image>`` expands to the resampler's 4 query tokens."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    from hf_precision.tiny import tiny_llava_processor
    from hf_precision.tiny.vlm import CHAT_TEMPLATE

    images = CLIPImageProcessorPil(
        size={"shortest_edge": 30},
        crop_size={"height": 30, "width": 30},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tiny_llava_processor().tokenizer,
        patch_size=15,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=0,
        chat_template=CHAT_TEMPLATE,
    )


def load_model(model_args: ModelArguments) -> tuple[Any, Any, str]:
    """Model, processor and layout (``"remote"`` or ``"native"``)."""
    from hf_precision.rules.dtypes import parse_dtype

    dtype = "auto" if model_args.dtype == "auto" else parse_dtype(model_args.dtype, call="--dtype")
    if model_args.model_name_or_path == "tiny":
        from hf_precision.tiny import MiniCPMV2Tiny

        # Loaded whole in the training dtype, as OpenBMB's finetune does (torch_dtype=bf16).
        model: Any = MiniCPMV2Tiny(dtype=dtype if isinstance(dtype, torch.dtype) else None)
        return model, tiny_processor(), "remote"
    from transformers import AutoModel, AutoModelForImageTextToText, AutoProcessor

    path = model_args.model_name_or_path
    config = json.loads((Path(path) / "config.json").read_text())
    if "auto_map" in config and not model_args.trust_remote_code:
        raise SystemExit(
            f"{path} is a remote-code checkpoint (config.json has auto_map), e.g. "
            "MiniCPM-V 2.x. Fix: read its *.py files, then pass "
            "--trust_remote_code true (or set it in the config)"
        )
    kwargs = dict(
        dtype=dtype, attn_implementation=model_args.attn_implementation, local_files_only=True
    )
    if model_args.trust_remote_code:
        model = AutoModel.from_pretrained(path, trust_remote_code=True, **kwargs)
        processor = AutoProcessor.from_pretrained(
            path, trust_remote_code=True, local_files_only=True
        )
        return model, processor, "remote"
    model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    return model, AutoProcessor.from_pretrained(path, local_files_only=True), "native"


# ----------------------------------------------------------------------------- 4. LoRA


def apply_lora(model: Any, lora_args: LoraArguments, layout: str) -> Any:
    from peft import LoraConfig, get_peft_model

    targets = LORA_TARGETS[layout]
    regex = lora_args.lora_target_regex
    if regex is None:
        names = [t.strip() for t in lora_args.lora_targets.split(",") if t.strip()]
        bad = sorted(set(names) - set(targets))
        if bad:
            raise SystemExit(f"--lora_targets: unknown {bad}; allowed: {sorted(targets)}")
        regex = "|".join(f"({targets[n]})" for n in names)
    # Remote-code models are not GenerationMixin models: a plain PeftModel (task_type=None)
    # forwards forward() and generate() to them unchanged.
    config = LoraConfig(
        r=lora_args.lora_r,
        lora_alpha=lora_args.lora_alpha,
        lora_dropout=lora_args.lora_dropout,
        target_modules=regex,
        task_type=None if layout == "remote" else "CAUSAL_LM",
    )
    return get_peft_model(model, config)


# ----------------------------------------------------------------------------- 5. trainer


class GenerateEvalTrainer(Trainer):
    """``evaluate()`` also answers a few eval questions with ``generate()`` (the path that
    encodes images outside the training forward: where the 2.x resampler breaks) and logs the
    exact-match accuracy. Real MiniCPM-V 2.x code takes ``forward(data=batch)`` and returns
    logits only: the loss is computed here then, as OpenBMB's ``finetune/trainer.py`` does."""

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

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if "data" not in inspect.signature(base.forward).parameters:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs.pop("labels")
        inputs.setdefault("position_ids", inputs["attention_mask"].long().cumsum(-1) - 1)
        outputs = base(data=inputs, use_cache=False)
        loss = F.cross_entropy(
            outputs.logits[:, :-1].flatten(0, 1).float(),
            labels[:, 1:].flatten().to(outputs.logits.device),
            ignore_index=-100,
        )
        return (loss, outputs) if return_outputs else loss

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        metrics = super().evaluate(*args, **kwargs)
        if self.generate_rows and self.eval_collator is not None:
            answers = self.generate_answers(self.generate_rows)
            accuracy = sum(a["prediction"] == a["answer"] for a in answers) / len(answers)
            self.generations.append({"step": self.state.global_step, "answers": answers})
            metrics["eval_answer_accuracy"] = accuracy
            self.log({"eval_answer_accuracy": accuracy})
        return metrics

    @torch.no_grad()
    def generate_answers(self, rows: list[dict[str, Any]]) -> list[dict[str, str]]:
        assert self.eval_collator is not None
        batch, answers = self.eval_collator.encode(rows, with_answers=False)
        batch = self._prepare_inputs(dict(batch))  # to the model's device, nested lists too
        model: Any = self.model
        # Greedy answers; the tiny 2.x stand-in's generate() takes no generation kwargs.
        extra: dict[str, Any] = {"do_sample": False} if hasattr(model, "generation_config") else {}
        if self.eval_collator.remote_code and "image_bound" in batch:  # real 2.x generate()
            extra["tokenizer"] = self.eval_collator.processor.tokenizer
        was_training = model.training
        model.eval()
        out = model.generate(**batch, **extra, max_new_tokens=self.max_new_tokens)
        model.train(was_training)
        n = batch["input_ids"].shape[1]
        # HF generate returns prompt + answer; 2.x remote generate returns the answer only.
        new = (
            out[:, n:] if out.shape[1] > n and torch.equal(out[:, :n], batch["input_ids"]) else out
        )
        texts = self.eval_collator.processor.batch_decode(new, skip_special_tokens=True)
        return [{"answer": a, "prediction": t.strip()} for a, t in zip(answers, texts)]


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
    model, processor, layout = load_model(model_args)
    model = apply_lora(model, lora_args, layout)
    before = dtype_map(model)

    callbacks = [PrecisionGuardCallback(mode=model_args.guard_mode)] if model_args.guard else []
    # The tiny 2.x model takes a transformers-style processor; real 2.x code its own.
    remote = model_args.trust_remote_code
    eval_collator = ConversationCollator(processor, eval_folder, remote)
    trainer = GenerateEvalTrainer(
        model=model,
        args=train_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=ConversationCollator(processor, folder, remote),
        eval_collator=eval_collator,
        processing_class=processor,
        callbacks=callbacks,
        max_new_tokens=data_args.max_new_tokens,
        generate_rows=[eval_ds[i] for i in range(min(data_args.num_generate, len(eval_ds)))]
        if eval_ds is not None
        else None,
    )
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
        "layout": layout,
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
        print(
            f"Answers at step {last['step']}: "
            + "; ".join(f"{a['prediction']!r} (want {a['answer']!r})" for a in last["answers"])
        )
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
