"""TRL's RL trainers (``GRPOTrainer``, ``RLOOTrainer``, the experimental ``OnlineDPOTrainer`` and
``AsyncGRPOTrainer``): the contract between the sampler and the trainer, the match on the
HF-generate path, and the gap over the first generations.

Read from TRL 1.16's source:

* **the trainer** scores completions with ``_get_per_token_logps_and_entropies``: the model's
  forward with a fused LM head (``add_fused_lm_head``: ``lm_head.weight`` read directly, logits
  never built) inside ``accelerator.autocast()``; with ``cast_lm_head_to_fp32=True`` the head runs
  fp32 with autocast off.
* **the sampler** is one of three:

  - ``use_vllm=False`` (HF ``generate``): the same model, called *outside* autocast, keeping no
    log-probs. Each group computes in its storage dtype: fp32 LoRA adapters (PEFT's
    ``autocast_adapter_dtype``) when sampling, bf16 under autocast when scoring. TRL applies no
    importance-sampling correction on this path.
  - ``use_transformers_continuous_batching=True``: ``unwrapped_model.to(torch.bfloat16)`` (or
    fp16) on the live model, never cast back; the head back to fp32 when
    ``cast_lm_head_to_fp32``.
  - ``use_vllm=True``: an engine built from ``model.name_or_path`` with vLLM's default dtype (the
    checkpoint's; a float32 one runs bfloat16), log-probs in ``processed_logprobs`` mode
    (colocate; a server's ``--logprobs-mode`` is checked by TRL), weights synced by
    ``merge_adapter()`` / ``unmerge_adapter()`` on the live PEFT model (merged in place) or
    streamed whole. TRL carries the engine's log-probs (``sampling_per_token_logps``) and
    corrects with ``vllm_importance_sampling_*``.

:func:`contract` builds the table per group, the sync path, the engine and the truncation, with a
finding per mismatch and its fix in TRL's own arguments. :class:`RLWatch` runs on the trainer:
on the HF-generate path it reads the sampler's log-probs from ``generate``'s logits and, with
``match``, runs ``generate`` under the trainer's autocast (the fp32 head outside it, as the
trainer's); where TRL carries the engine's log-probs it reads those. The gap of the first
``steps`` generations (:mod:`hf_precision.engine.rl_gap`) goes to the ``rl_gap`` section of the
event JSON, W&B and TensorBoard.

Casts this module never proposes (each makes the gap worse): an fp32 head on one side only; an
fp32 VLM trainer against a bf16 engine; upcasting adapters TRL keeps bf16 on purpose (ZeRO-3,
``autocast_adapter_dtype=False``).

Nothing here imports TRL or vLLM: the configuration is read from the trainer's ``args``.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..base.wrappers import unwrap_model
from ..engine.rl_gap import WARN_MEAN_ABS, Correction, GapRecord, GapWatch, gap_record
from ..engine.rl_gap import sampler_logps as logps_from_logits
from ..rules.dtypes import dtype_name

logger = logging.getLogger("hf_precision")

__all__ = ["RL_TRAINERS", "Contract", "GroupRow", "RLWatch", "attach", "contract", "is_rl_trainer"]

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


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def sampler_kind(args: Any) -> str:
    if _arg(args, "use_vllm", False):
        return "vllm"
    if _arg(args, "use_transformers_continuous_batching", False) or _arg(
        args, "use_transformers_paged", False
    ):
        return "continuous_batching"
    return "generate"


def autocast_dtype(args: Any) -> torch.dtype | None:
    """The trainer's autocast dtype (``accelerator.autocast()`` under ``bf16``/``fp16``)."""
    if _arg(args, "bf16", False):
        return torch.bfloat16
    if _arg(args, "fp16", False):
        return torch.float16
    return None


def correction_of(args: Any) -> Correction | None:
    """TRL's IS-correction thresholds (``vllm_importance_sampling_*``), ``None`` when off."""
    if not _arg(args, "vllm_importance_sampling_correction", False):
        return None
    clip_max = _arg(args, "vllm_importance_sampling_clip_max", None)
    if clip_max is None:  # TRL 1.16's deprecated name
        clip_max = _arg(args, "vllm_importance_sampling_cap", None)
    return Correction(
        str(_arg(args, "vllm_importance_sampling_mode", "sequence_mask")),
        _arg(args, "vllm_importance_sampling_clip_min", None),
        clip_max,
    )


def _storage(params: list[torch.Tensor]) -> str:
    names = sorted({dtype_name(p.dtype) for p in params if p.is_floating_point()})
    return "/".join(names) or "-"


def _group_params(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """The model's parameters by group (the guard's group rules; PEFT's ``lora_`` tensors are
    ``adapters``; the output embedding is ``lm_head`` whatever its path)."""
    from ..rules.groups import find_module_groups

    root, _ = unwrap_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = find_module_groups(root)
    head = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
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
    return out


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
    mode = _arg(args, "vllm_mode", "colocate")
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
    fp32_head = group == "lm_head" and bool(_arg(args, "cast_lm_head_to_fp32", False))
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
    for group, params in sorted(
        _group_params(model).items(), key=lambda kv: GROUPS.index(kv[0]) if kv[0] in GROUPS else 99
    ):
        storage = _storage(params)
        sampler, trainer_side, on = _sides(group, storage, args, kind, engine, match)
        rows.append(GroupRow(group, storage, sampler, trainer_side, on))
    correction = correction_of(args) if kind == "vllm" else None
    truncation = {
        "top_p": _arg(args, "top_p", 1.0),
        "top_k": _arg(args, "top_k", 0),
        "min_p": _arg(args, "min_p", None),
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
    head_fp32 = bool(_arg(args, "cast_lm_head_to_fp32", False))
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


def say(text: str) -> None:
    """One RL finding: a :class:`~hf_precision.errors.PrecisionWarning` (and the log)."""
    from ..errors import PrecisionWarning

    logger.info("hf-precision: %s", text)
    warnings.warn(text, PrecisionWarning, stacklevel=3)


#: the trainer's inputs a re-score passes on (TRL 1.16's ``_compute_loss``)
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class RLWatch:
    """On a TRL RL trainer: the sampler's log-probs of the first ``steps`` generations against
    the trainer's, and (``match``) ``generate`` under the trainer's autocast.

    It wraps, on the instances only, the trainer's ``_generate_and_score_completions`` (whose
    output carries the completions and, with vLLM, the engine's ``sampling_per_token_logps`` and
    the trainer's ``old_per_token_logps``) and, on the HF-generate path, the unwrapped model's
    ``generate`` (asked for its raw logits). After the watched generations both come off, the
    ``generate`` wrapper stays while ``match`` is on (it then only enters the autocast)."""

    def __init__(
        self,
        trainer: Any,
        *,
        match: bool = False,
        steps: int = 2,
        on_done: Callable[[GapRecord | None], None] | None = None,
    ) -> None:
        self.trainer, self.match, self.on_done = trainer, match, on_done
        self.kind = sampler_kind(trainer.args)
        self.watch = GapWatch(steps)
        self.correction = correction_of(trainer.args)
        self.temperature = float(_arg(trainer.args, "temperature", 1.0) or 1.0)
        accelerator = getattr(trainer, "accelerator", None)
        model = trainer.model
        self.model = accelerator.unwrap_model(model) if accelerator is not None else model
        self._pending: tuple[torch.Tensor, Any] | None = None
        self._undo: list[Callable[[], None]] = []
        self._undo_generate: Callable[[], None] | None = None

    # -- wrapping -------------------------------------------------------------------------
    def attach(self) -> RLWatch:
        trainer = self.trainer
        score = getattr(trainer, "_generate_and_score_completions", None)
        if score is not None:
            self._undo.append(_wrap(trainer, "_generate_and_score_completions", self._scored))
        if self.kind == "generate" and hasattr(self.model, "generate"):
            self._undo_generate = _wrap(self.model, "generate", self._generate)
        return self

    def detach(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        if self._undo_generate is not None:
            self._undo_generate()
            self._undo_generate = None

    def _generate(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        config = kw.get("generation_config")
        measure = not self.watch.done and not kw.get("return_dict_in_generate")
        measure = measure and not getattr(config, "return_dict_in_generate", False)
        if measure:
            if config is None:
                kw.update(output_logits=True, return_dict_in_generate=True)
            else:  # the caller's config, asking for the raw logits too (never mutated)
                kw["generation_config"] = config = copy.deepcopy(config)
                config.output_logits = config.return_dict_in_generate = True
        with self.sampler_numerics():
            out = original(*a, **kw)
        if not measure:
            return out
        prompt = kw.get("input_ids", a[0] if a else None)
        start = prompt.size(1) if isinstance(prompt, torch.Tensor) else 0
        self._pending = (out.sequences[:, start:], out.logits)
        return out.sequences

    @contextmanager
    def sampler_numerics(self) -> Iterator[None]:
        """The trainer's numerics around ``generate`` when matching: its autocast, and TRL's
        fp32 head (``cast_lm_head_to_fp32``) outside it, as the fused head runs it."""
        if not self.match or autocast_dtype(self.trainer.args) is None:
            yield
            return
        accelerator = getattr(self.trainer, "accelerator", None)
        ctx = accelerator.autocast() if accelerator is not None else nullcontext()
        undo = None
        if _arg(self.trainer.args, "cast_lm_head_to_fp32", False):
            head = unwrap_model(self.model)[0].get_output_embeddings()
            undo = _wrap(head, "forward", _outside_autocast)
        try:
            with ctx:
                yield
        finally:
            if undo is not None:
                undo()

    def _scored(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        output = original(*a, **kw)
        if self.watch.done:
            return output
        try:
            record = self.record(output)
        except Exception as err:  # a layout this watch does not know: say it, never break the run
            logger.info("hf-precision: RL gap not measured (%s: %s)", type(err).__name__, err)
            record = None
        self._pending = None
        if record is not None:
            self.watch.add(record)
        else:
            self.watch.steps -= 1  # a generation it could not read does not count
        if self.watch.done:
            self.finish()
        return output

    def finish(self) -> None:
        """Report the watched generations (once) and take the measuring wrappers off."""
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        if not self.match and self._undo_generate is not None:
            self._undo_generate()
            self._undo_generate = None
        if self.on_done is not None:
            done, self.on_done = self.on_done, None
            done(self.watch.result())

    def close(self) -> None:
        """At the end of training: report what was watched, take every wrapper off."""
        self.finish()
        self.detach()

    # -- measuring ------------------------------------------------------------------------
    def record(self, output: dict[str, Any]) -> GapRecord | None:
        """The gap of one generation batch from ``_generate_and_score_completions``'s output."""
        ids, mask = output["completion_ids"], output["completion_mask"]
        sampling = output.get("sampling_per_token_logps")
        if sampling is not None:
            source = "engine log-probs (sampling_per_token_logps)"
        else:
            sampling = self._from_generate(ids, mask)
            if sampling is None:
                return None
            source = "generate logits"
        trainer = output.get("old_per_token_logps")
        if trainer is None:
            trainer = self.rescore(output)
        return gap_record(trainer, sampling, mask, correction=self.correction, source=source)

    def _from_generate(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        if self._pending is None:
            return None
        tokens, logits = self._pending
        if tokens.size(0) != ids.size(0):
            return None
        s = logps_from_logits(logits, tokens, self.temperature).to(ids.device)
        width = ids.size(1)
        if s.size(1) < width:
            s = torch.cat([s, s.new_full((s.size(0), width - s.size(1)), float("nan"))], 1)
        s, tokens = s[:, :width], tokens[:, :width].to(ids.device)
        keep = mask[:, : tokens.size(1)].bool()
        if not torch.equal(tokens[keep], ids[:, : tokens.size(1)][keep]):
            return None  # not the completions TRL kept (a multi-turn/tool rollout)
        return s

    def rescore(self, output: dict[str, Any]) -> torch.Tensor:
        """The trainer's log-probs of the completions: TRL's own
        ``_get_per_token_logps_and_entropies`` on the trained model, without gradients."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        extra = {k: output[k] for k in _FORWARD_KEYS if output.get(k) is not None}
        with torch.no_grad():
            logps, _, _ = self.trainer._get_per_token_logps_and_entropies(
                self.trainer.model,
                input_ids,
                attention,
                output["completion_ids"].size(1),
                **extra,
            )
        return logps


def _outside_autocast(original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
    x = a[0] if a else next(iter(kw.values()))
    with torch.autocast(x.device.type, enabled=False):
        return original(*a, **kw)


def _wrap(obj: Any, name: str, wrapper: Callable[..., Any]) -> Callable[[], None]:
    """Put ``wrapper(original, *a, **kw)`` on the instance ``obj`` as ``name``; the returned
    function takes it off (giving back an instance attribute that was there)."""
    had = name in vars(obj)
    before = vars(obj).get(name)
    original = getattr(obj, name)

    def wrapped(*a: Any, **kw: Any) -> Any:
        return wrapper(original, *a, **kw)

    object.__setattr__(obj, name, wrapped)

    def undo() -> None:
        if had:
            object.__setattr__(obj, name, before)
        elif name in vars(obj):
            object.__delattr__(obj, name)

    return undo


def attach(trainer: Any, guard: Any, *, rl: str = "auto", steps: int = 2) -> RLWatch | None:
    """The RL contract of ``trainer`` (a TRL RL trainer) into ``guard``'s ``rl_contract``
    section, its findings said, and an :class:`RLWatch` whose gap goes to the ``rl_gap``
    section and event. ``rl``: ``"auto"`` (match in the guard's fix mode), ``"match"``,
    ``"measure"`` (no match) or ``"off"``."""
    if rl == "off" or not is_rl_trainer(trainer):
        return None
    policy = getattr(guard, "policy", None)
    match = rl == "match" or (rl == "auto" and getattr(policy, "mode", "fix") == "fix")
    match = match and sampler_kind(trainer.args) == "generate"
    c = contract(trainer, match=match)
    guard.sections["rl_contract"] = c.to_dict()
    logger.info("hf-precision: RL contract\n%s", c.table())
    for text in c.findings:
        say(text)

    def done(result: GapRecord | None) -> None:
        if result is None:
            return
        guard.sections["rl_gap"] = {**result.to_dict(), "match": match}
        if result.mean_abs > WARN_MEAN_ABS:
            say(f"{c.trainer}: sampler-trainer gap over the first generations: {result.line()}")
        guard.log_sections("rl_gap", step=int(getattr(trainer.state, "global_step", 0) or 0))

    return RLWatch(trainer, match=match, steps=steps, on_done=done).attach()
