"""The sampler-trainer gap of an RL run: how far the log-probs the sampler drew its tokens with are
from the log-probs the trainer scores the same tokens with.

An RL trainer (GRPO, RLOO, online DPO) samples completions with one engine (vLLM, SGLang or
``generate``) and scores them with another (its training forward). When the two compute with
different precision (an fp32 LoRA adapter when sampling, bf16 under autocast when scoring; a bf16
head on one side and an fp32 head on the other), the policy gradient is off-policy by that gap.

Per completion token, with ``s`` the sampler's log-prob and ``t`` the trainer's:

* ``|δ| = |t - s|``: its mean and max over the tokens;
* ``k3 = exp(t - s) - 1 - (t - s)``: the k3 estimate of KL(sampler ‖ trainer), its mean;
* the share of sequences the configured importance-sampling correction would mask or clip (TRL's
  ``vllm_importance_sampling_mode`` / ``_clip_min`` / ``_clip_max``: a ratio ``exp(t - s)`` per
  token, or per sequence ``exp(Σ (t - s))``, outside ``[clip_min, clip_max]``).

:func:`gap_record` takes the two log-prob tensors; :func:`measure_gap` takes the model, the token
ids and the sampler's log-probs, re-scores the tokens as the trainer does (its autocast) and
returns the record. :func:`sampler_logps` reads the sampler's log-probs from ``generate``'s
logits. :class:`GapWatch` sums the records of the first generations of a run. Nothing here
changes the model.

>>> import torch
>>> s = torch.tensor([[-1.0, -2.0, -0.5]])
>>> t = torch.tensor([[-1.0, -2.5, -0.5]])
>>> r = gap_record(t, s, torch.tensor([[1, 1, 0]]), correction=Correction("token_mask", None, 3.0))
>>> r.tokens, r.mean_abs, r.max_abs, r.corrected_share
(2, 0.25, 0.5, 0.0)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "Correction",
    "GapRecord",
    "GapWatch",
    "GenerateTap",
    "gap_record",
    "measure_gap",
    "outside_autocast",
    "sampler_logps",
    "score_logps",
    "wrap_method",
]

#: the mean per-token |δ| (nats) above which a gap is a finding
WARN_MEAN_ABS = 1e-3


@dataclass(frozen=True)
class Correction:
    """An importance-sampling correction, in TRL's words: ``mode`` is one of ``token_mask``,
    ``token_truncate``, ``sequence_mask``, ``sequence_truncate``; a ratio outside
    ``[clip_min, clip_max]`` is masked (set to 0) or clipped (truncated); ``None`` is no bound."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0

    @property
    def action(self) -> str:
        return "mask" if self.mode.endswith("mask") else "clip"

    @property
    def per_sequence(self) -> bool:
        return self.mode.startswith("sequence")


@dataclass
class GapRecord:
    """The gap over some completions: per-token |δ| mean and max, mean k3, and the share of
    sequences (and of tokens) the correction would mask or clip (``None`` with no correction)."""

    tokens: int
    sequences: int
    mean_abs: float
    max_abs: float
    k3: float
    corrected_share: float | None = None
    corrected_tokens: float | None = None
    correction: dict[str, Any] | None = None
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        said = (
            f"{self.tokens} tokens of {self.sequences} sequences: |δ| mean {self.mean_abs:.3g} "
            f"max {self.max_abs:.3g} nats, k3 {self.k3:.3g}"
        )
        if self.corrected_share is not None and self.correction is not None:
            what = "mask" if str(self.correction["mode"]).endswith("mask") else "clip"
            said += (
                f"; {self.correction['mode']} would {what} {self.corrected_share:.0%} of "
                f"sequences ({self.corrected_tokens:.0%} of tokens)"
            )
        return said


def gap_record(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    correction: Correction | None = None,
    source: str = "",
) -> GapRecord:
    """The gap between ``trainer_logps`` and ``sampler_logps`` (both ``(sequences, tokens)``)
    over the tokens ``mask`` keeps (all when ``None``); ``correction`` adds the share it would
    mask or clip. NaN sampler log-probs (a token the engine could not score) are left out."""
    t = trainer_logps.detach().float()
    s = sampler_logps.detach().float().to(t.device)
    keep = torch.ones_like(t, dtype=torch.bool) if mask is None else mask.to(t.device).bool()
    keep = keep & ~torch.isnan(s) & ~torch.isnan(t)
    diff = torch.where(keep, t - s, torch.zeros_like(t))
    n = int(keep.sum())
    rows = int(keep.any(dim=-1).sum())
    if n == 0:
        return GapRecord(0, 0, 0.0, 0.0, 0.0, source=source)
    d = diff[keep]
    k3 = torch.expm1(d) - d
    record = GapRecord(
        tokens=n,
        sequences=rows,
        mean_abs=float(d.abs().mean()),
        max_abs=float(d.abs().max()),
        k3=float(k3.mean()),
        source=source,
    )
    if correction is not None:
        lo = -math.inf if correction.clip_min is None else correction.clip_min
        hi = math.inf if correction.clip_max is None else correction.clip_max
        live = keep.any(dim=-1)
        if correction.per_sequence:
            ratio = torch.exp(diff.sum(dim=-1))
            out_seq = ((ratio < lo) | (ratio > hi)) & live
            out_tok = out_seq.unsqueeze(-1) & keep
        else:
            ratio = torch.exp(diff)
            out_tok = ((ratio < lo) | (ratio > hi)) & keep
            out_seq = out_tok.any(dim=-1)
        record.corrected_share = float(out_seq.sum()) / rows
        record.corrected_tokens = float(out_tok.sum()) / n
        record.correction = asdict(correction)
    return record


def sampler_logps(
    logits: torch.Tensor | Sequence[torch.Tensor], tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """The log-probs of ``tokens`` (``(sequences, steps)``) under the sampler's raw logits
    (``generate(..., output_logits=True)``: one ``(sequences, vocab)`` tensor per step, before
    any logits processor), at ``temperature`` (as the trainer divides them)."""
    if not isinstance(logits, torch.Tensor):
        logits = torch.stack(tuple(logits), dim=1)
    steps = min(logits.size(1), tokens.size(1))
    logp = torch.log_softmax(logits[:, :steps].float() / temperature, dim=-1)
    return logp.gather(-1, tokens[:, :steps].unsqueeze(-1).to(logp.device)).squeeze(-1)


def score_logps(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    autocast: AbstractContextManager[Any] | None = None,
    **inputs: Any,
) -> torch.Tensor:
    """The log-probs of the last ``logits_to_keep`` tokens of ``input_ids`` under ``model``'s
    forward, inside ``autocast`` (the trainer's), without gradients: ``(sequences,
    logits_to_keep)``."""
    with torch.no_grad(), autocast if autocast is not None else nullcontext():
        out = model(input_ids=input_ids, attention_mask=attention_mask, **inputs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    logits = logits[:, -logits_to_keep - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    target = input_ids[:, -logits_to_keep:].to(logp.device)
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)


def measure_gap(
    model: nn.Module,
    input_ids: torch.Tensor,
    sampler: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    autocast: AbstractContextManager[Any] | None = None,
    correction: Correction | None = None,
    score: Callable[..., torch.Tensor] | None = None,
    source: str = "",
    **inputs: Any,
) -> GapRecord:
    """Re-score the completion tokens of ``input_ids`` (the last ``sampler.size(1)``) as the
    trainer does and compare with the sampler's log-probs ``sampler``.

    ``score(model, input_ids, attention_mask, logits_to_keep, **inputs)`` is the trainer's
    scoring (default :func:`score_logps` under ``autocast`` at ``temperature``); ``inputs`` are
    the model's other inputs (``pixel_values``, ...). Attribution re-scores with one group
    switched by passing its own ``score`` or ``autocast``."""
    keep = sampler.size(1)
    if score is None:
        trainer = score_logps(
            model,
            input_ids,
            attention_mask,
            keep,
            temperature=temperature,
            autocast=autocast,
            **inputs,
        )
    else:
        trainer = score(model, input_ids, attention_mask, keep, **inputs)
    return gap_record(trainer, sampler, completion_mask, correction=correction, source=source)


@dataclass
class GapWatch:
    """The records of the first ``steps`` generations of a run, summed (token-weighted means,
    the largest max, sequence-weighted shares)."""

    steps: int = 2
    records: list[GapRecord] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.records) >= self.steps

    def add(self, record: GapRecord) -> None:
        self.records.append(record)

    def result(self) -> GapRecord | None:
        rs = [r for r in self.records if r.tokens]
        if not rs:
            return None
        n, rows = sum(r.tokens for r in rs), sum(r.sequences for r in rs)
        out = GapRecord(
            tokens=n,
            sequences=rows,
            mean_abs=sum(r.mean_abs * r.tokens for r in rs) / n,
            max_abs=max(r.max_abs for r in rs),
            k3=sum(r.k3 * r.tokens for r in rs) / n,
            correction=rs[0].correction,
            source=rs[0].source,
        )
        if all(r.corrected_share is not None for r in rs):
            out.corrected_share = sum((r.corrected_share or 0.0) * r.sequences for r in rs) / rows
            out.corrected_tokens = sum((r.corrected_tokens or 0.0) * r.tokens for r in rs) / n
        return out


class GenerateTap:
    """``model.generate`` wrapped on the instance: while ``measuring()`` it asks for the raw
    logits (on a copy of the caller's ``generation_config``) and keeps the completion tokens and
    their logits in :attr:`pending`, returning the token ids as the caller asked; every call runs
    inside ``numerics()`` (the trainer's autocast when matching)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        numerics: Callable[[], AbstractContextManager[Any]] | None = None,
        measuring: Callable[[], bool] = lambda: True,
    ) -> None:
        self.model, self.numerics, self.measuring = model, numerics, measuring
        self.pending: tuple[torch.Tensor, Any] | None = None
        self._undo: Callable[[], None] | None = None

    def attach(self) -> GenerateTap:
        if self._undo is None:
            self._undo = wrap_method(self.model, "generate", self._generate)
        return self

    def detach(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def _generate(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        config = kw.get("generation_config")
        asked = kw.get("return_dict_in_generate") or getattr(
            config, "return_dict_in_generate", False
        )
        measure = self.measuring() and not asked
        if measure:
            if config is None:
                kw.update(output_logits=True, return_dict_in_generate=True)
            else:  # never the caller's object
                kw["generation_config"] = config = copy.deepcopy(config)
                config.output_logits = config.return_dict_in_generate = True
        with self.numerics() if self.numerics is not None else nullcontext():
            out = original(*a, **kw)
        if not measure:
            return out
        prompt = kw.get("input_ids", a[0] if a else None)
        start = prompt.size(1) if isinstance(prompt, torch.Tensor) else 0
        self.pending = (out.sequences[:, start:], out.logits)
        return out.sequences

    def completion_logps(
        self, ids: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor | None:
        """The sampler's log-probs of the completions ``ids`` (``(sequences, width)``, padded
        right, ``mask`` their tokens) from the pending generation; ``None`` when none is pending
        or its tokens are not ``ids`` (a multi-turn rollout). Positions past the generated
        steps are NaN."""
        if self.pending is None:
            return None
        tokens, logits = self.pending
        if tokens.size(0) != ids.size(0):
            return None
        s = sampler_logps(logits, tokens, temperature).to(ids.device)
        width = ids.size(1)
        if s.size(1) < width:
            s = torch.cat([s, s.new_full((s.size(0), width - s.size(1)), float("nan"))], 1)
        s, tokens = s[:, :width], tokens[:, :width].to(ids.device)
        keep = mask[:, : tokens.size(1)].bool()
        if not torch.equal(tokens[keep], ids[:, : tokens.size(1)][keep]):
            return None
        return s


def outside_autocast(original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
    """A :func:`wrap_method` wrapper: the call with autocast off (an fp32 head kept fp32)."""
    x = a[0] if a else next(iter(kw.values()))
    with torch.autocast(x.device.type, enabled=False):
        return original(*a, **kw)


def wrap_method(obj: Any, name: str, wrapper: Callable[..., Any]) -> Callable[[], None]:
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
