"""Build what a framework's command line needs for a tiny VLM LoRA job, all made locally.

Run with the framework's own interpreter (its transformers writes the checkpoint it will read):

    .venv-llamafactory/bin/python tests/integrations/make_fixtures.py llamafactory DIR [k=v...]

``DIR/model``: a tiny LLaVA (``hf_precision.tiny``) saved in bf16 with its processor (a PIL image
processor: no torchvision needed) and chat template; ``DIR/data``: four generated shape images
and the framework's dataset files; ``DIR/cfg.yaml`` (LLaMA-Factory) or ``DIR/args.json``
(ms-swift's argument list). ``k=v`` pairs add to or replace keys of the YAML (values are YAML).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PAIRS = [("circle", "red"), ("square", "blue"), ("triangle", "green"), ("circle", "yellow")]
QUESTION = "what is in the image ?"


def build_model(root: Path, dtype: str = "bfloat16") -> Path:
    """A tiny LLaVA checkpoint in ``dtype`` and its processor, saved under ``root/model``."""
    import torch

    from hf_precision.tiny import tiny_llava, tiny_llava_processor

    path = root / "model"
    model = tiny_llava(getattr(torch, dtype))
    model.save_pretrained(path)
    tiny_llava_processor(str(path))  # saves the processor + chat template there
    return path


def build_images(root: Path) -> list[Path]:
    from hf_precision.tiny.data import shape_image

    (root / "data").mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (shape, colour) in enumerate(PAIRS):
        path = root / "data" / f"img{i}.png"
        shape_image(shape, colour).save(path)
        paths.append(path)
    return paths


def llamafactory(root: Path, overrides: dict[str, Any]) -> Path:
    """A sharegpt-format dataset with images, its ``dataset_info.json`` and a LoRA SFT YAML
    (3 steps, CPU). The defaults are the failing case of the issue: a bf16 checkpoint,
    ``upcast_layernorm: true``, no bf16 flag."""
    import yaml

    model = build_model(root, overrides.pop("checkpoint_dtype", "bfloat16"))
    images = build_images(root)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"<image>{QUESTION}"},
                {"role": "assistant", "content": f"a {colour} {shape}"},
            ],
            "images": [str(image)],
        }
        for image, (shape, colour) in zip(images, PAIRS, strict=True)
    ]
    (root / "data" / "shapes.json").write_text(json.dumps(rows))
    info = {
        "shapes": {
            "file_name": "shapes.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": {
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
            },
        }
    }
    (root / "data" / "dataset_info.json").write_text(json.dumps(info))
    cfg: dict[str, Any] = {
        "model_name_or_path": str(model),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_target": "q_proj,v_proj",
        "lora_rank": 4,
        "upcast_layernorm": True,
        "dataset": "shapes",
        "dataset_dir": str(root / "data"),
        "template": "llava",
        "cutoff_len": 96,
        "overwrite_cache": True,
        "output_dir": str(root / "out"),
        "overwrite_output_dir": True,
        "per_device_train_batch_size": 2,
        "max_steps": 3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "disable_gradient_checkpointing": True,
    }
    cfg.update(overrides)
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def swift(root: Path, overrides: dict[str, Any]) -> Path:
    """A messages-format JSONL dataset with images and the ``swift sft`` arguments for LoRA on
    the tiny LLaVA (3 steps, CPU), written as a JSON list to ``root/args.json``."""
    model = build_model(root, overrides.pop("checkpoint_dtype", "float32"))
    images = build_images(root)
    with open(root / "data" / "shapes.jsonl", "w") as f:
        for image, (shape, colour) in zip(images, PAIRS, strict=True):
            row = {
                "messages": [
                    {"role": "user", "content": f"<image>{QUESTION}"},
                    {"role": "assistant", "content": f"a {colour} {shape}"},
                ],
                "images": [str(image)],
            }
            f.write(json.dumps(row) + "\n")
    args: dict[str, Any] = {
        "model": str(model),
        "model_type": "llava1_5_hf",
        "template": "llava1_5_hf",
        "tuner_type": "lora",
        "target_modules": "q_proj v_proj",
        "lora_rank": "4",
        "dataset": str(root / "data" / "shapes.jsonl"),
        "split_dataset_ratio": "0",
        "max_length": "96",
        "output_dir": str(root / "out"),
        "add_version": "false",
        "per_device_train_batch_size": "2",
        "max_steps": "3",
        "logging_steps": "1",
        "save_strategy": "no",
        "report_to": "none",
        "dataloader_num_workers": "0",
        "dataset_num_proc": "1",
        "gradient_checkpointing": "false",
        "check_model": "false",
        "use_hf": "true",
    }
    args.update({k: str(v) for k, v in overrides.items()})
    argv = [part for k, v in args.items() for part in (f"--{k}", *v.split(" "))]
    path = root / "args.json"
    path.write_text(json.dumps(argv))
    return path


def main(argv: list[str]) -> None:
    import yaml

    kind, root = argv[0], Path(argv[1])
    overrides = {k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in argv[2:])}
    root.mkdir(parents=True, exist_ok=True)
    print({"llamafactory": llamafactory, "swift": swift}[kind](root, overrides))


if __name__ == "__main__":
    main(sys.argv[1:])
