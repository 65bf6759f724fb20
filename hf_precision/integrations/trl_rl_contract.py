"""TRL's RL trainers: the contract between the sampler and the trainer, read from the trainer's
configuration and model (a part of :mod:`hf_precision.integrations.trl_rl`, which watches the
run): per group, the storage dtype, what the sampler and the trainer compute with (and whether
autocast applies), the fp8 matmul formats (:mod:`hf_precision.model.fp8`); the sync path; the
engine's dtype and log-prob mode where the configuration names them (TRL's vLLM arguments, read
without vLLM installed); the sampling truncation under importance sampling; and a finding per
mismatch with its fix in TRL's own arguments.

Never proposed (each widens the gap): an fp32 head on one side only; an fp32 VLM trainer against
a bf16 engine; upcasting adapters TRL keeps bf16 on purpose (ZeRO-3).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..base.wrapper_kinds import unwrap_model
from ..rules.dtypes import dtype_name
from ..watch.rl_gap import Correction

__all__ = [
    "RL_TRAINERS",
    "Contract",
    "GroupRow",
    "autocast_dtype",
    "config_value",
    "contract",
    "correction_of",
    "engine_of",
    "findings",
    "is_rl_trainer",
    "sampler_kind",
    "sync_path",
]

#: TRL's RL trainers, by class name (their subclasses too)
RL_TRAINERS = ("GRPOTrainer", "RLOOTrainer", "OnlineDPOTrainer", "AsyncGRPOTrainer")
GROUPS = ("vision_encoder", "resampler", "projector", "language_model", "adapters", "lm_head")
_FLOAT32 = "float32"


def is_rl_trainer(trainer: Any) -> bool:
    return any(c.__name__ in RL_TRAINERS for c in type(trainer).__mro__)


@dataclass
class GroupRow:
    """One group's numerics on each side: storage and compute dtypes, and where autocast
    applies (``trainer_autocast``)."""

    group: str
    storage: str
    sampler: str
    trainer: str
    trainer_autocast: bool
    matmul: str = "-"  # the group's fp8 matmul formats (hf_precision.model.fp8), "-" for none
    note: str = ""

    @property
    def matches(self) -> bool:
        return self.sampler == self.trainer


@dataclass
class Contract:
    """The sampler-trainer contract of one RL trainer."""

    trainer: str
    sampler: str  # generate | continuous_batching | vllm
    rows: list[GroupRow]
    sync: str
    engine: dict[str, Any]
    truncation: dict[str, Any]
    correction: dict[str, Any] | None
    findings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mismatched"] = [r.group for r in self.rows if not r.matches]
        return out

    def table(self) -> str:
        lines = [
            f"{self.trainer}: sampler {self.sampler}, sync {self.sync}",
            f"{'group':<16}{'storage':<18}{'sampler':<18}{'trainer':<26}",
        ]
        for r in self.rows:
            where = " (autocast)" if r.trainer_autocast else ""
            mark = "" if r.matches else "  <- differs"
            lines.append(
                f"{r.group:<16}{r.storage:<18}{r.sampler:<18}{r.trainer + where:<26}{mark}"
            )
        return "\n".join(lines)


def config_value(args: Any, name: str, default: Any = None) -> Any:
    """A field of the trainer's config (``default`` when this TRL version has none)."""
    return getattr(args, name, default)


def sampler_kind(args: Any) -> str:
    if config_value(args, "use_vllm", False):
        return "vllm"
    if config_value(args, "use_transformers_continuous_batching", False) or config_value(
        args, "use_transformers_paged", False
    ):
        return "continuous_batching"
    return "generate"


def autocast_dtype(args: Any) -> torch.dtype | None:
    """The trainer's autocast dtype (``accelerator.autocast()`` under ``bf16``/``fp16``)."""
    if config_value(args, "bf16", False):
        return torch.bfloat16
    if config_value(args, "fp16", False):
        return torch.float16
    return None


def correction_of(args: Any) -> Correction | None:
    """TRL's IS-correction thresholds (``vllm_importance_sampling_*``), ``None`` when off."""
    if not config_value(args, "vllm_importance_sampling_correction", False):
        return None
    clip_max = config_value(args, "vllm_importance_sampling_clip_max", None)
    if clip_max is None:  # TRL 1.16's deprecated name
        clip_max = config_value(args, "vllm_importance_sampling_cap", None)
    return Correction(
        str(config_value(args, "vllm_importance_sampling_mode", "sequence_mask")),
        config_value(args, "vllm_importance_sampling_clip_min", None),
        clip_max,
    )


def _storage(params: list[torch.Tensor]) -> str:
    names = sorted({dtype_name(p.dtype) for p in params if p.is_floating_point()})
    return "/".join(names) or "-"


def _group_params(
    model: nn.Module,
) -> tuple[dict[str, list[torch.Tensor]], Callable[[str], str]]:
    """The model's parameters by group (the guard's group rules; PEFT's ``lora_`` tensors are
    ``adapters``; the output embedding is ``lm_head`` whatever its path)."""
    from ..rules.groups.module_groups import find_module_groups

    root, _ = unwrap_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = find_module_groups(root)
    head: Any = getattr(root, "get_output_embeddings", lambda: None)()
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    out: dict[str, list[torch.Tensor]] = {}
    for name, p in root.named_parameters():
        if "lora_" in name or ".adapter" in name:
            g = "adapters"
        elif id(p) in head_ids:
            g = "lm_head"
        else:
            g = groups.group_of(name)
        out.setdefault(g, []).append(p)
    return out, groups.group_of


def _group_matmul(model: nn.Module, group_of: Callable[[str], str]) -> dict[str, str]:
    """The fp8 matmul formats of each group's modules (torchao, TransformerEngine, ...)."""
    from ..model.fp8 import matmul_format

    found: dict[str, set[str]] = {}
    for name, module in unwrap_model(model)[0].named_modules():
        fmt = matmul_format(module)
        if fmt is not None:
            g = "adapters" if "lora_" in name else group_of(name)
            found.setdefault(g, set()).add(str(fmt))
    return {g: ", ".join(sorted(v)) for g, v in found.items()}


def engine_of(args: Any, model: nn.Module) -> dict[str, Any]:
    """The engine's dtype and log-prob mode, where the configuration names them."""
    kind = sampler_kind(args)
    if kind != "vllm":
        return {"kind": kind, "dtype": None, "logprobs": "generate logits (raw)"}
    root, _ = unwrap_model(model)
    config = getattr(root, "config", None)
    ckpt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if ckpt is None:  # built from a config: save_pretrained writes the model's dtype
        ckpt = getattr(root, "dtype", None)
    ckpt_name = dtype_name(ckpt) if isinstance(ckpt, torch.dtype) else str(ckpt)
    dtype = "bfloat16" if ckpt_name in (_FLOAT32, "None") else ckpt_name
    mode = config_value(args, "vllm_mode", "colocate")
    logprobs = (
        "processed_logprobs" if mode == "colocate" else "the server's --logprobs-mode (TRL checks)"
    )
    return {
        "kind": "vllm",
        "mode": mode,
        "dtype": dtype,
        "checkpoint": ckpt_name,
        "logprobs": logprobs,
    }


def _sides(
    group: str, storage: str, args: Any, kind: str, engine: dict[str, Any], match: bool
) -> tuple[str, str, bool]:
    """(sampler compute, trainer compute, whether autocast applies on the trainer's side)."""
    ac = autocast_dtype(args)
    fp32_head = group == "lm_head" and bool(config_value(args, "cast_lm_head_to_fp32", False))
    if fp32_head:
        trainer, on = _FLOAT32, False
    elif ac is not None:
        trainer, on = dtype_name(ac), True
    else:
        trainer, on = storage, False
    if kind == "vllm":
        sampler = engine["dtype"] or storage
    elif kind == "continuous_batching":
        sampler = _FLOAT32 if fp32_head else (dtype_name(ac) if ac is not None else storage)
    else:
        sampler = trainer if match else storage
    return sampler, trainer, on


def sync_path(args: Any, model: nn.Module) -> str:
    kind = sampler_kind(args)
    peft = hasattr(model, "peft_config") or hasattr(unwrap_model(model)[0], "peft_config")
    if kind == "generate":
        return "none (the sampler is the trained model)"
    if kind == "continuous_batching":
        return "none; the live model is cast in place to the autocast dtype and not cast back"
    if peft:
        return "merged in place (merge_adapter/unmerge_adapter on the live model), then streamed"
    return "full weights streamed, cast to the engine's dtype"


def contract(trainer: Any, *, match: bool = False, name: str | None = None) -> Contract:
    """The contract of ``trainer`` (a TRL RL trainer): one row per group, the sync path, the
    engine, the truncation with importance sampling on, and the findings (mismatches with their
    fix in TRL's arguments). ``match``: the guard runs ``generate`` as the trainer computes."""
    args, model = trainer.args, trainer.model
    kind, engine = sampler_kind(args), engine_of(trainer.args, trainer.model)
    rows = []
    by_group, group_of = _group_params(model)
    matmul = _group_matmul(model, group_of)
    for group, params in sorted(
        by_group.items(), key=lambda kv: GROUPS.index(kv[0]) if kv[0] in GROUPS else 99
    ):
        storage = _storage(params)
        sampler, trainer_side, on = _sides(group, storage, args, kind, engine, match)
        rows.append(GroupRow(group, storage, sampler, trainer_side, on, matmul.get(group, "-")))
    correction = correction_of(args) if kind == "vllm" else None
    truncation = {
        "top_p": config_value(args, "top_p", 1.0),
        "top_k": config_value(args, "top_k", 0),
        "min_p": config_value(args, "min_p", None),
    }
    c = Contract(
        name or type(trainer).__name__,
        kind,
        rows,
        sync_path(args, model),
        engine,
        truncation,
        None if correction is None else asdict(correction),
    )
    c.findings = findings(c, args, vlm=any(r.group == "vision_encoder" for r in rows))
    return c


def findings(c: Contract, args: Any, *, vlm: bool) -> list[str]:
    """Each mismatch of ``c``, with its fix in TRL's own arguments (never a one-sided fp32 head,
    never an fp32 VLM trainer against a bf16 engine, never upcast adapters TRL keeps bf16)."""
    out: list[str] = []
    off = [r for r in c.rows if not r.matches]
    head_fp32 = bool(config_value(args, "cast_lm_head_to_fp32", False))
    if c.sampler == "generate" and off:
        out.append(
            f"{c.trainer}: generate() samples outside autocast while the trainer scores inside it: "
            + ", ".join(f"{r.group} {r.sampler} vs {r.trainer}" for r in off)
            + ". Fix: hf-precision's match (PrecisionGuardCallback(rl='match'), on by default in "
            "fix mode) runs generate under the trainer's autocast; or bf16=False in the "
            "trainer's config (both sides compute in the weights' dtypes). TRL applies no "
            "importance-sampling correction with use_vllm=False."
        )
    if c.sampler == "vllm" and head_fp32:
        out.append(
            f"{c.trainer}: cast_lm_head_to_fp32=True makes the trainer's head fp32 while the vLLM "
            f"engine's runs {c.engine['dtype']}: an fp32 head on one side only widens the gap. "
            "Fix: cast_lm_head_to_fp32=False."
        )
    if c.sampler == "vllm" and vlm and autocast_dtype(args) is None:
        lm = next((r for r in c.rows if r.group == "language_model"), None)
        if lm is not None and _FLOAT32 in lm.trainer and c.engine["dtype"] != _FLOAT32:
            out.append(
                f"{c.trainer}: the VLM trainer computes float32 against a {c.engine['dtype']} "
                "engine: the vision encoder's features differ on the two sides. Fix: bf16=True "
                "(never upcast the trainer alone)."
            )
    top_p, top_k = c.truncation["top_p"], c.truncation["top_k"]
    if c.correction is not None and ((top_p or 1.0) < 1.0 or (top_k or 0) > 0):
        out.append(
            f"{c.trainer}: top_p={top_p}, top_k={top_k} with vllm_importance_sampling_correction="
            "True: the engine's processed log-probs are renormalised over the truncated "
            "vocabulary, the trainer's are not, so every ratio is biased. Fix: top_p=1.0, "
            "top_k=0 (or vllm_importance_sampling_correction=False)."
        )
    if c.sampler == "continuous_batching":
        half = dtype_name(autocast_dtype(args) or torch.float32)
        out.append(
            f"{c.trainer}: use_transformers_continuous_batching=True casts the trained model to "
            f"{half} in place before each generation and never casts it back: fp32 adapters and "
            "trainable weights become half precision under the optimizer. Fix: "
            "use_transformers_continuous_batching=False."
        )
    return out
