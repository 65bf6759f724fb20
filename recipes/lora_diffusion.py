#!/usr/bin/env python
"""LoRA fine-tuning of a Stable-Diffusion-style UNet with the precision guard, in a plain
accelerate loop: one file, meant to be copied and edited.

Launch (tiny UNet + VAE + CLIP text encoder built offline from configs, generated images, CPU,
a few seconds)::

    python recipes/lora_diffusion.py --config recipes/configs/diffusion/tiny.yaml

A real checkpoint in the diffusers layout (``unet/``, ``vae/``, ``text_encoder/``,
``tokenizer/``, ``scheduler/``), from a local folder, on a GPU::

    python recipes/lora_diffusion.py --config recipes/configs/diffusion/tiny.yaml \\
        --pretrained_model_name_or_path /models/sd15 --data_dir /data/pets \\
        --resolution 512 --cpu false --max_steps 1000

Any field of the config can be overridden on the command line (``--max_steps 3``,
``--precision bf16-vae32``, ``--no_guard``).

The models are loaded in ``weight_dtype`` (fp16, as OneTrainer's "weight data type" does), and
the training loop below contains no dtype casts: it is the code that fails with
``mat1 and mat2 must have the same dtype`` (timestep embedding), ``Input type (float) and bias
type (c10::Half)`` (VAE) and ``Input type (c10::Half) and bias type (float)`` (decoding into an
fp32 VAE) without the guard. With it, the policy (default ``fp16-vae32``: UNet and text encoder
fp16, LoRA weights fp32, VAE fp32) is enforced once and the guards cast at every boundary.

Reading order: 1 arguments, 2 data (``data_dir/metadata.jsonl`` lines ``{"file_name": ...,
"text": ...}``, the diffusers ImageFolder convention, or generated coloured squares), 3 models,
4 LoRA, 5 the guard, 6 training loop and sampling.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
import yaml
from transformers import HfArgumentParser

# ----------------------------------------------------------------------------- 1. arguments


@dataclass
class RecipeArguments:
    # model
    pretrained_model_name_or_path: str = field(
        default="tiny",
        metadata={
            "help": "'tiny' (built offline from configs) or a local diffusers checkpoint folder"
        },
    )
    weight_dtype: str = field(
        default="float16",
        metadata={"help": "dtype every model is loaded in (OneTrainer's weight data type)"},
    )
    resolution: int = field(default=16, metadata={"help": "image side in pixels"})
    # data
    data_dir: str | None = field(
        default=None,
        metadata={
            "help": "folder with metadata.jsonl ({'file_name', 'text'} per line); None: generate"
        },
    )
    num_images: int = field(default=16, metadata={"help": "generated images (no data_dir)"})
    # LoRA
    lora_r: int = field(default=4, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=4, metadata={"help": "LoRA scaling numerator"})
    lora_targets: str = field(
        default="to_q,to_k,to_v,to_out.0",
        metadata={"help": "comma list of UNet attention module names"},
    )
    # precision
    precision: str = field(
        default="fp16-vae32",
        metadata={"help": "hf_precision preset: fp16-vae32 | bf16-vae32 | fp16 | bf16 | fp32 ..."},
    )
    guard: bool = field(default=True, metadata={"help": "use the guard (--no_guard: without)"})
    guard_mode: str = field(default="fix", metadata={"help": "audit | fix | raise"})
    precision_report: bool = field(
        default=True, metadata={"help": "write dtype maps per event under <output_dir>/precision"}
    )
    mixed_precision: str = field(
        default="fp16",
        metadata={
            "help": "accelerate: no | fp16 | bf16 (fp16 on CPU neither autocasts nor scales)"
        },
    )
    cpu: bool = field(default=False, metadata={"help": "train on CPU"})
    # training
    output_dir: str = field(default="outputs/diffusion-tiny", metadata={"help": "outputs"})
    max_steps: int = field(default=8, metadata={"help": "optimizer steps"})
    train_batch_size: int = field(default=4, metadata={"help": "images per step"})
    learning_rate: float = field(default=1e-3, metadata={"help": "AdamW learning rate"})
    sample_steps: int = field(default=2, metadata={"help": "denoising steps of the final sample"})
    report_to: str = field(default="none", metadata={"help": "none | wandb"})
    seed: int = field(default=0, metadata={"help": "random seed"})


def parse_args(argv: list[str] | None = None) -> RecipeArguments:
    """``--config file.yaml`` gives the defaults (``yaml.safe_load``); other flags override."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    parser = HfArgumentParser(cast(Any, RecipeArguments))
    if known.config:
        config = yaml.safe_load(Path(known.config).read_text()) or {}
        unknown = sorted(set(config) - {f.name for f in fields(RecipeArguments)})
        if unknown:
            raise SystemExit(
                f"{known.config}: unknown field(s) {unknown}; see "
                f"`python {sys.argv[0]} --help` for the allowed ones"
            )
        parser.set_defaults(**{k: str(v) if isinstance(v, float) else v for k, v in config.items()})
    (args,) = parser.parse_args_into_dataclasses(rest)
    return args


# ----------------------------------------------------------------------------- 2. data

COLOURS = {
    "red": (1.0, -0.8, -0.8),
    "green": (-0.8, 0.8, -0.8),
    "blue": (-0.8, -0.6, 1.0),
    "yellow": (1.0, 0.9, -0.9),
}
WORDS = ["<pad>", "<eos>", "a", "square", "on", "white", *COLOURS]


def generated_images(n: int, size: int, seed: int) -> list[tuple[torch.Tensor, str]]:
    """``n`` images in [-1, 1] (a coloured square on white) and their captions."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        name = list(COLOURS)[i % len(COLOURS)]
        img = torch.ones(3, size, size)
        side = size // 2
        x, y = (int(v) for v in torch.randint(0, size - side + 1, (2,), generator=g))
        img[:, y : y + side, x : x + side] = torch.tensor(COLOURS[name])[:, None, None]
        out.append((img, f"a {name} square on white"))
    return out


def folder_images(data_dir: str, size: int) -> list[tuple[torch.Tensor, str]]:
    """``metadata.jsonl`` rows -> (image in [-1, 1], caption)."""
    import numpy as np
    from PIL import Image

    rows = [
        json.loads(line)
        for line in (Path(data_dir) / "metadata.jsonl").read_text().splitlines()
        if line.strip()
    ]
    out = []
    for row in rows:
        img = Image.open(Path(data_dir) / row["file_name"]).convert("RGB").resize((size, size))
        arr = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 127.5 - 1
        out.append((arr, row["text"]))
    return out


class Tokenize:
    """Captions -> ``input_ids``: a word-level toy vocabulary for the tiny text encoder, the
    checkpoint's CLIP tokenizer otherwise."""

    def __init__(self, tokenizer: Any = None, length: int = 8) -> None:
        self.tokenizer, self.length = tokenizer, length

    def __call__(self, texts: list[str]) -> torch.Tensor:
        if self.tokenizer is not None:
            return self.tokenizer(
                texts,
                padding="max_length",
                truncation=True,
                max_length=self.tokenizer.model_max_length,
                return_tensors="pt",
            ).input_ids
        ids = [[*[WORDS.index(w) for w in t.split()][: self.length - 1], 1] for t in texts]
        return torch.tensor([row + [0] * (self.length - len(row)) for row in ids])


def collate(rows: list[tuple[torch.Tensor, str]], tokenize: Tokenize) -> dict[str, torch.Tensor]:
    # fp32 images, as every data pipeline makes them; the guard puts them in the VAE's dtype
    return {
        "pixel_values": torch.stack([r[0] for r in rows]),
        "input_ids": tokenize([r[1] for r in rows]),
    }


# ----------------------------------------------------------------------------- 3. models


def tiny_models(resolution: int, seed: int) -> dict[str, Any]:
    """UNet2DConditionModel + AutoencoderKL + CLIPTextModel from tiny configs (~100k params)."""
    from diffusers import DDPMScheduler

    from hf_precision.tiny.diffusion import tiny_text_encoder, tiny_unet, tiny_vae

    torch.manual_seed(seed)  # one seed for the three, drawn in this order
    return {
        "vae": tiny_vae(seed=None, sample_size=resolution),
        "unet": tiny_unet(seed=None, sample_size=resolution // 2),
        "text_encoder": tiny_text_encoder(seed=None, vocab_size=len(WORDS)),
        "tokenize": Tokenize(),
        "scheduler": DDPMScheduler(num_train_timesteps=100),
    }


def load_models(args: RecipeArguments) -> dict[str, Any]:
    """The models in ``weight_dtype``, frozen; a checkpoint is read from a local folder only."""
    from hf_precision.rules.dtypes import parse_dtype

    dtype = parse_dtype(args.weight_dtype, call="--weight_dtype")
    path = args.pretrained_model_name_or_path
    if path == "tiny":
        models = tiny_models(args.resolution, args.seed)
    else:
        if not Path(path).is_dir():
            raise SystemExit(
                f"pretrained_model_name_or_path {path} is not a folder. Fix: "
                "download a diffusers checkpoint once, or pass 'tiny'"
            )
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        kw: dict[str, Any] = {"local_files_only": True}
        models = {
            "unet": UNet2DConditionModel.from_pretrained(path, subfolder="unet", **kw),
            "vae": AutoencoderKL.from_pretrained(path, subfolder="vae", **kw),
            "text_encoder": CLIPTextModel.from_pretrained(path, subfolder="text_encoder", **kw),
            "tokenize": Tokenize(CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kw)),
            "scheduler": DDPMScheduler.from_pretrained(path, subfolder="scheduler", **kw),
        }
    for name in ("unet", "vae", "text_encoder"):
        models[name].requires_grad_(False).to(dtype)  # as loaded with torch_dtype=weight_dtype
    return models


# ----------------------------------------------------------------------------- 4. LoRA


def add_lora(unet: Any, args: RecipeArguments) -> list[torch.nn.Parameter]:
    """LoRA on the UNet's attention projections (diffusers' peft integration, in place)."""
    from peft import LoraConfig

    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    unet.add_adapter(
        LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            target_modules=targets,
            init_lora_weights="gaussian",
        )
    )
    return [p for p in unet.parameters() if p.requires_grad]


#: what diffusers' save_lora_weights writes and load_lora_weights reads
LORA_FILE = "pytorch_lora_weights.safetensors"


def save_lora(unet: Any, adapter_dir: Path, is_main_process: bool = True) -> Path:
    """The UNet's LoRA in diffusers' own format (safetensors, diffusers key names, the LoRA
    config as metadata): ``pipe.load_lora_weights(adapter_dir)`` loads it back.

    Also ``unet_check.safetensors``: the trained UNet's output (computed in fp32) on fixed
    inputs, so a reload can be checked against it."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapter_dir.mkdir(parents=True, exist_ok=True)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(
        adapter_dir,
        unet_lora_layers=layers,
        is_main_process=is_main_process,
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
        safe_serialization=True,
    )
    if is_main_process:
        save_file(unet_check(unet), adapter_dir / "unet_check.safetensors")
    return adapter_dir


@torch.no_grad()
def unet_check(unet: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fixed inputs and the UNet's fp32 output on them (a copy is run: ``unet`` is unchanged)."""
    import copy

    config = unet.config
    gen = torch.Generator().manual_seed(seed)
    side = config.sample_size
    inputs = {
        "sample": torch.randn(1, config.in_channels, side, side, generator=gen),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(1, 8, config.cross_attention_dim, generator=gen),
    }
    from hf_precision import remove_guards

    twin = copy.deepcopy(unet).to("cpu", torch.float32).eval()
    remove_guards(twin)  # the copied guards would cast its inputs to the run's fp16
    return {**inputs, "output": twin(**inputs).sample.contiguous()}


# ----------------------------------------------------------------------------- 5.-6. main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from hf_precision import PrecisionGuardPlugin, PrecisionPolicy, dtype_map
    from hf_precision.frontends.diffusion import guard_diffusion
    from hf_precision.rules.groups.diffusion import diffusion_batch_rules

    args = parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_to == "wandb":
        from hf_precision.report.wandb_tracker import wandb_offline_unless_logged_in

        wandb_offline_unless_logged_in()  # no login: offline, one line, no traceback
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        cpu=args.cpu,
        project_dir=str(out),
        log_with=None if args.report_to == "none" else args.report_to,
    )
    if args.report_to != "none":  # before the guard, so its dtype maps reach the tracker
        accelerator.init_trackers("lora-diffusion", config=asdict(args))
    set_seed(args.seed)
    m = load_models(args)
    unet, vae, text_encoder, scheduler = m["unet"], m["vae"], m["text_encoder"], m["scheduler"]
    # The frozen models are not prepared by accelerate: place them before guarding them (the
    # guards record the device inputs must go to).
    vae.to(accelerator.device)
    text_encoder.to(accelerator.device)
    params = add_lora(unet, args)
    rows = (
        folder_images(args.data_dir, args.resolution)
        if args.data_dir
        else generated_images(args.num_images, args.resolution, args.seed)
    )
    loader: Any = torch.utils.data.DataLoader(
        cast(Any, rows),
        batch_size=args.train_batch_size,
        shuffle=True,
        collate_fn=lambda r: collate(r, m["tokenize"]),
    )
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate)

    guard = None
    if args.guard:
        # The frozen VAE and text encoder are not prepared by accelerate: guard them directly.
        policy = diffusion_batch_rules(
            PrecisionPolicy.from_preset(args.precision, mode=args.guard_mode)
        )
        guard_diffusion({"vae": vae, "text_encoder": text_encoder}, policy)
        guard = PrecisionGuardPlugin(
            policy, report=args.precision_report, report_dir=out / "precision"
        )
        unet, optimizer, loader = guard.prepare(accelerator, unet, optimizer, loader)
    else:
        unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)

    # The training code: no .to(dtype) anywhere; that is the guard's job.
    scaling = getattr(vae.config, "scaling_factor", 0.18215)
    losses: list[float] = []
    step = 0
    unet.train()
    while step < args.max_steps:
        for batch in loader:
            with torch.no_grad():
                latents = vae.encode(batch["pixel_values"]).latent_dist.sample() * scaling
                encoder_hidden_states = text_encoder(batch["input_ids"])[0]
            noise = torch.randn_like(latents)
            timesteps = torch.randint(
                0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device
            )
            noisy_latents = scheduler.add_noise(latents, noise, timesteps)
            with accelerator.autocast():
                pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
            loss = F.mse_loss(pred.float(), noise.float())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            accelerator.log({"train/loss": losses[-1]}, step=step)
            step += 1
            if step >= args.max_steps:
                break
    if not all(math.isfinite(v) for v in losses):
        raise SystemExit(f"non-finite loss: {losses}")

    # Sampling: the scheduler works in fp32, the UNet in fp16, the VAE decodes in fp32.
    unet.eval()
    with torch.no_grad():
        hidden = text_encoder(m["tokenize"](["a red square on white"]).to(accelerator.device))[0]
        scheduler.set_timesteps(args.sample_steps)
        side = args.resolution // 2 ** (len(vae.config.block_out_channels) - 1)
        channels = accelerator.unwrap_model(unet).config.in_channels
        latents = torch.randn(1, channels, side, side, device=accelerator.device)
        for t in scheduler.timesteps:
            latents = scheduler.step(unet(latents, t, hidden).sample, t, latents).prev_sample
        image = vae.decode(latents / scaling).sample
    unwrapped = accelerator.unwrap_model(unet)
    adapter_dir = save_lora(unwrapped, out / "adapter", accelerator.is_main_process)
    maps = {
        name: dtype_map(model).group_rows()
        for name, model in (("unet", unwrapped), ("vae", vae), ("text_encoder", text_encoder))
    }
    report = {
        "guard": args.guard,
        "precision": args.precision,
        "policy": guard.policy.to_dict() if guard and guard.policy else None,
        "loss": {"first": losses[0], "last": losses[-1], "curve": losses},
        "sample": {
            "dtype": str(image.dtype),
            "shape": list(image.shape),
            "finite": bool(torch.isfinite(image).all()),
        },
        "dtype_groups": maps,
        "adapter": str(adapter_dir / LORA_FILE),
    }
    (out / "precision_report.json").write_text(json.dumps(report, indent=1))
    for name, rows_ in maps.items():
        print(f"{name:<13} " + "; ".join(f"{r['group']}: {r['dtypes']}" for r in rows_))
    print(
        f"Loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} over {len(losses)} steps; "
        f"sample {tuple(image.shape)} {image.dtype}"
    )
    print(f"Precision report: {out / 'precision_report.json'}")
    accelerator.end_training()
    if guard is not None:
        guard.remove()
    return report


if __name__ == "__main__":
    main()
