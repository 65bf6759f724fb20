"""Attribution of the sampler/trainer log-prob gap of an RL run to one part of the model.

An RL trainer (TRL's ``GRPOTrainer``, RLOO, online DPO) samples completions with one engine and
scores the same tokens with another. On TRL's HF-``generate`` path both are the same model: the
sampler runs it outside autocast, the trainer under ``accelerator.autocast()`` (bf16). When the
log-probs of the two sides part, :func:`attribute_gap` says which part of the model makes it:

* it scores the same tokens three ways under ``torch.no_grad``: as the sampler does (no
  autocast), as the trainer does (autocast in the trainer's dtype), and as the sampler does with
  one group switched to the trainer's numerics (autocast entered at that group's modules only, by
  forward hooks that come off afterwards);
* a group's share is how much of the gap switching it alone removes:
  ``(gap - gap_with_group_switched) / gap`` (shares of groups that interact need not sum to 1; the
  rest is said as ``unattributed``);
* the first module where the two sides part is the first leaf module, in the order the forward
  ran, whose output differs once both sides are rounded to the lower of their two dtypes (a fixed
  sample of at most :data:`OUTPUT_SAMPLE` elements per output, compared bit for bit).

Nothing of the model changes: no parameter is cast, replaced or written (the switch is an
autocast scope, not a cast), the hooks come off even when a forward raises, and every module's
``training`` flag comes back as it was. Groups: ``adapters`` (PEFT's ``lora_*`` leaves),
``lm_head`` (the output embedding), ``norms`` (leaf modules whose class is a norm),
``vision_encoder`` and ``projector`` (the model's groups, :mod:`hf_precision.rules.groups`).

>>> import torch
>>> head = torch.nn.Linear(4, 8)
>>> model = torch.nn.Sequential(torch.nn.Embedding(8, 4), head)
>>> ids = torch.tensor([[1, 2, 3, 4]])
>>> def score(m, b, k):
...     logits = m(b["input_ids"])[:, -k - 1 : -1].float()
...     return logits.log_softmax(-1).gather(-1, b["input_ids"][:, -k:, None])[..., 0]
>>> found = attribute_gap(model, {"input_ids": ids}, keep=3, score=score,
...                       groups={"lm_head": [head]})
>>> found.shares["lm_head"] > 0.99
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .rl_gap import WARN_MEAN_ABS, gap_record

#: at most this many elements of each leaf module's output are compared, at fixed positions
OUTPUT_SAMPLE = 1024
#: the mean per-token |delta log-prob| (nats) above which the RL watchers attribute the gap: the
#: gap measurement's own finding threshold
GAP_THRESHOLD = WARN_MEAN_ABS
#: the groups switched one at a time, in this order
GROUPS: tuple[str, ...] = ("adapters", "lm_head", "norms", "vision_encoder", "projector")

#: what to change when a group makes the gap (the sampler runs it outside autocast, the
#: trainer under autocast), in TRL's GRPOConfig words or the guard's policy
FIXES: dict[str, str] = {
    "adapters": "the adapters compute in float32 when sampling (outside autocast) and in the "
    "autocast dtype when scoring: sample under the trainer's autocast (the guard's match on "
    "the generate path), or keep the adapters in the base's dtype on both sides "
    "(get_peft_model(..., autocast_adapter_dtype=False), as TRL does under ZeRO-3)",
    "lm_head": "one head dtype on both sides: GRPOConfig(cast_lm_head_to_fp32=True) (TRL casts "
    "the head of the sampler too); never an fp32 head on one side only",
    "norms": "the norms in one dtype on both sides (the guard's policy keeps them where the "
    "trainer computes them; sample under the trainer's autocast)",
    "vision_encoder": "the vision encoder must give the same features on both sides: one "
    "dtype (bf16) for the tower on both sides; never an fp32 VLM trainer against a bf16 engine",
    "projector": "the projector in the language model's dtype on both sides",
}

#: ``score(model, batch, keep)``: per-token log-probs ``(B, keep)``; ``model`` is the module or,
#: on the sampler's side, the bare forward accelerate keeps when it wraps the model in autocast
Score = Callable[[Any, Mapping[str, Any], int], torch.Tensor]


@dataclass
class GapAttribution:
    """What :func:`attribute_gap` found (``to_dict`` is the ``rl_attribution`` section)."""

    gap: float  # mean per-token |sampler - trainer| log-prob (nats), over the scored tokens
    gap_max: float
    tokens: int
    dtype: str  # the trainer's autocast dtype
    shares: dict[str, float] = field(default_factory=dict)  # group -> share of the gap
    modules: dict[str, int] = field(default_factory=dict)  # group -> modules switched
    first_parted: str | None = None  # the first leaf module whose outputs part
    first_parted_group: str | None = None

    @property
    def top(self) -> str | None:
        """The group with the largest share (``None`` when no group removes any gap)."""
        best = max(self.shares.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best is not None and best[1] > 0 else None

    @property
    def unattributed(self) -> float:
        return max(0.0, 1.0 - sum(max(s, 0.0) for s in self.shares.values()))

    def line(self) -> str:
        """``lm_head: 86 % of the gap; fix: ...`` and the rest, in one sentence."""
        ranked = sorted(self.shares.items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{g} {s:.0%}" for g, s in ranked)
        top = self.top
        head = f"{top}: {self.shares[top]:.0%} of the gap; fix: {FIXES[top]}" if top else ""
        where = (
            f" The two sides' outputs first part at {self.first_parted}"
            f" ({self.first_parted_group})."
            if self.first_parted
            else ""
        )
        return (
            f"hf-precision: sampler/trainer log-prob gap {self.gap:.4g} nats/token mean, "
            f"{self.gap_max:.3g} max over {self.tokens} tokens (trainer autocast {self.dtype}). "
            f"{head or 'no single group explains it'}. Shares: {parts or 'none'}"
            f" (unattributed {self.unattributed:.0%}).{where}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "gap_mean": round(self.gap, 8),
            "gap_max": round(self.gap_max, 8),
            "tokens": self.tokens,
            "trainer_autocast": self.dtype,
            "shares": {g: round(s, 6) for g, s in self.shares.items()},
            "unattributed": round(self.unattributed, 6),
            "modules_switched": dict(self.modules),
            "top": self.top,
            "fix": FIXES.get(self.top or ""),
            "first_parted": self.first_parted,
            "first_parted_group": self.first_parted_group,
            "how": "each group re-scored alone under the trainer's autocast, the rest as the "
            "sampler; share = gap removed / gap",
        }


def rl_groups(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The modules of each group of :data:`GROUPS` found in ``model`` (a group with none is
    left out)."""
    from ..base.wrapper_kinds import unwrap_model
    from ..rules.groups.module_groups import find_module_groups

    root, _ = unwrap_model(model)
    found: dict[str, list[nn.Module]] = {g: [] for g in GROUPS}
    for name, mod in model.named_modules():
        if any(True for _ in mod.children()) or not any(True for _ in mod.parameters()):
            continue  # leaves with weights only (not PEFT's empty dicts, dropouts)
        if any(part.startswith("lora_") for part in name.split(".")):
            found["adapters"].append(mod)
        elif "norm" in type(mod).__name__.lower():
            found["norms"].append(mod)
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    if isinstance(head, nn.Module):
        found["lm_head"].append(head)
    try:
        groups = find_module_groups(root)
    except Exception:  # a model no rule knows: the name-based groups only
        groups = None
    for group in ("vision_encoder", "projector"):
        if groups is not None and group in groups:
            found[group].extend(groups.modules(group))
    return {g: mods for g, mods in found.items() if mods}


@contextlib.contextmanager
def _autocast_at(modules: Sequence[nn.Module], device: str, dtype: torch.dtype) -> Iterator[None]:
    """Run ``modules`` (and what they call) under autocast, the rest as it is."""
    stack: list[Any] = []

    def enter(mod: nn.Module, args: Any) -> None:
        ctx = torch.autocast(device, dtype=dtype)
        ctx.__enter__()
        stack.append(ctx)

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        if stack:
            stack.pop().__exit__(None, None, None)

    handles = [m.register_forward_pre_hook(enter) for m in modules]
    handles += [m.register_forward_hook(leave, always_call=True) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while stack:
            stack.pop().__exit__(None, None, None)


class _OutputSample:
    """Forward hooks on every leaf: a fixed sample of each leaf's first output (first call
    only), in the order the forward ran."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: dict[str, torch.Tensor] = {}
        self._handles = [
            mod.register_forward_hook(self._hook(name))
            for name, mod in model.named_modules()
            if not any(True for _ in mod.children())
        ]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            t = out[0] if isinstance(out, tuple) and out else out
            if name in self.seen or not isinstance(t, torch.Tensor) or not t.is_floating_point():
                return
            flat = t.detach().reshape(-1)
            n = min(flat.numel(), OUTPUT_SAMPLE)
            idx = torch.arange(n, device=flat.device) * (flat.numel() - 1) // max(n - 1, 1)
            self.seen[name] = flat[idx].clone()

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def first_parted(
    sampler: Mapping[str, torch.Tensor], trainer: Mapping[str, torch.Tensor]
) -> str | None:
    """The first leaf (in the sampler's forward order) whose sampled output differs once both
    are rounded to the lower of their two dtypes."""
    for name, a in sampler.items():
        b = trainer.get(name)
        if b is None or a.shape != b.shape:
            continue
        low = a.dtype if torch.finfo(a.dtype).bits <= torch.finfo(b.dtype).bits else b.dtype
        if not torch.equal(a.to(low), b.to(low)):
            return name
    return None


def _gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    d = (a.float() - b.float()).abs()
    return d[mask.bool()] if mask is not None else d.reshape(-1)


@contextlib.contextmanager
def _scoring(model: nn.Module) -> Iterator[None]:
    """No gradient, evaluation mode (no dropout on either side), every module's ``training``
    flag back as it was afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, was in modes:
            m.training = was


def attribute_gap(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    keep: int,
    score: Score,
    dtype: torch.dtype = torch.bfloat16,
    mask: torch.Tensor | None = None,
    groups: Mapping[str, Sequence[nn.Module]] | None = None,
    threshold: float = 0.0,
) -> GapAttribution:
    """Score ``batch``'s last ``keep`` tokens as the sampler (no autocast) and as the trainer
    (autocast ``dtype``), then once per group with that group alone under autocast; ``score``
    returns per-token log-probs ``(B, keep)`` (``mask`` marks the completion tokens counted).
    A gap at or under ``threshold`` is returned without the group passes (no shares)."""
    device = _device_of(model)
    groups = rl_groups(model) if groups is None else groups
    # the sampler calls the forward generate calls: accelerate's autocast wrapper (its
    # ``_original_forward`` is the bare one) is not on that path
    bare: Any = getattr(model, "_original_forward", model)
    with _scoring(model):
        sampled = _OutputSample(model)
        try:
            sampler = score(bare, batch, keep)
        finally:
            sampled.remove()
        scored = _OutputSample(model)
        try:
            with torch.autocast(device, dtype=dtype):
                trainer = score(model, batch, keep)
        finally:
            scored.remove()
        record = gap_record(trainer, sampler, mask, source="attribution: the same tokens")
        gap = record.mean_abs
        shares: dict[str, float] = {}
        for group, mods in groups.items() if gap > threshold else ():
            with _autocast_at(list(mods), device, dtype):
                switched = score(bare, batch, keep)
            left = _gap(switched, trainer, mask)
            rest = float(left.mean()) if left.numel() else 0.0
            shares[group] = (gap - rest) / gap if gap > 0 else 0.0
    parted = first_parted(sampled.seen, scored.seen)
    return GapAttribution(
        gap=gap,
        gap_max=record.max_abs,
        tokens=record.tokens,
        dtype=str(dtype).removeprefix("torch."),
        shares=shares,
        modules={g: len(m) for g, m in groups.items()},
        first_parted=parted,
        first_parted_group=_group_of(model, parted, groups) if parted else None,
    )


def _device_of(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _group_of(model: nn.Module, name: str, groups: Mapping[str, Sequence[nn.Module]]) -> str:
    """The switched group holding the leaf ``name``, else ``language_model``/``other`` from the
    model's groups."""
    leaf = model.get_submodule(name)
    for group, mods in groups.items():
        for mod in mods:
            if leaf is mod or any(leaf is m for m in mod.modules()):
                return group
    from ..base.wrapper_kinds import unwrap_model
    from ..rules.groups.module_groups import find_module_groups

    try:
        return find_module_groups(unwrap_model(model)[0]).group_of(name)
    except Exception:
        return "other"


def token_log_probs(model: Any, batch: Mapping[str, Any], keep: int) -> torch.Tensor:
    """The log-prob of each of the last ``keep`` tokens of ``batch["input_ids"]`` given the ones
    before (logits in float32, as ``generate``'s scores are): the default ``score``."""
    ids = batch["input_ids"]
    out = model(**batch)
    logits = out.logits if hasattr(out, "logits") else out[0]
    logits = logits[:, -keep - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, -keep:, None])[..., 0]
