"""Sync integrity: did a weight sync or a generation change the weights the trainer holds?

An RL trainer hands its weights to a sampler at every sync and generates between steps. Two
things in that path change the trainer's own weights without any dtype map seeing it:

* PEFT's ``merge_adapter()`` / ``unmerge_adapter()`` on a bf16 base (TRL merges in place to push
  merged weights to vLLM, then unmerges): ``W + BA - BA`` rounded twice in bf16 is not ``W``. The
  dtype never changes; the values drift, sync after sync.
* an in-place cast before generating (TRL 1.16's continuous-batching generate runs
  ``unwrapped_model.to(torch.bfloat16)`` and never casts back): float32 adapters (and float32
  norms or head) become bf16 under the optimizer, and most small updates then round away.

:class:`SyncIntegrity` keeps a fixed sample of at most ``sample`` elements of every frozen
floating tensor (the same flat positions every time) and compares it bit for bit around each
watched call (:meth:`SyncIntegrity.around`) or round trip (:meth:`SyncIntegrity.round_trip`),
and against the first sample (the drift accumulated over all syncs so far). It also notes every
parameter whose dtype changed across the call and, with ``restore=True``, puts back the tensor it
held before: the ``.to()`` of a module replaces ``param.data`` and leaves the old tensor intact,
so holding a reference to it for the length of the call restores the exact values and dtype, in
the same ``Parameter`` object the optimizer holds (no copy is made; a tensor a sharding wrapper
owns, or one whose gradient is in another dtype, is not touched).

Methods are wrapped on the instance (an attribute that shadows the class's method), never on the
class; :meth:`SyncIntegrity.remove` takes them off.

>>> import torch
>>> lin = torch.nn.Linear(4, 4).requires_grad_(False)
>>> watch = SyncIntegrity(lin)
>>> def bump():
...     lin.weight.data += 1e-3
>>> holder = type("Holder", (), {})()
>>> holder.bump = bump
>>> watch.around(holder, "bump", event="sync")
>>> holder.bump()
>>> watch.findings[0].changed_share  # the weight's 16 elements of 20: the bias did not move
0.8
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..base.wrapper_kinds import is_sharded
from ..rules.dtypes import dtype_name

logger = logging.getLogger("hf_precision")

#: elements sampled per frozen tensor (fixed flat positions)
SAMPLE = 64
_NAMED = 3

FIXES: dict[str, str] = {
    "round_trip": "sync only the adapters (serve the LoRA adapters in the engine instead of "
    "merging them into the base), or merge from an fp32 copy of the base (load the base in "
    "float32 and train with bf16 autocast: GRPOConfig(bf16=True, "
    "model_init_kwargs={'dtype': 'float32'})); TRL 1.16 merges in place at every sync",
    "cast": "restore the dtypes the optimizer holds after generation "
    "(PrecisionGuardCallback does, for tensors no wrapper owns), or generate without "
    "GRPOConfig(use_transformers_continuous_batching=True), which casts the live model with "
    "model.to(torch.bfloat16) and never casts back",
}


@dataclass
class SyncFinding:
    """One watched call that changed the weights (``to_dict`` goes to the event JSON)."""

    event: str
    calls: int  # how many times this event had been watched, this one included
    sampled: int = 0
    changed: int = 0
    max_drift: float = 0.0
    changed_tensors: list[str] = field(default_factory=list)
    total_changed_share: float = 0.0  # against the first sample: drift accumulated so far
    total_max_drift: float = 0.0
    dtype_changes: list[tuple[str, str, str, bool]] = field(
        default_factory=list
    )  # name, was, is, trainable
    restored: int = 0

    @property
    def changed_share(self) -> float:
        return self.changed / self.sampled if self.sampled else 0.0

    def line(self) -> str:
        parts = []
        if self.changed:
            names = ", ".join(self.changed_tensors[:_NAMED])
            more = self.changed_tensors[_NAMED:]
            names += f" and {len(more)} more" if more else ""
            parts.append(
                f"{self.event} changed {self.changed_share:.1%} of the sampled frozen elements "
                f"({self.changed}/{self.sampled}; {names}),"
                f" max drift {self.max_drift:.3g}; since the first sample "
                f"{self.total_changed_share:.1%} changed, max drift {self.total_max_drift:.3g}"
                f" (call {self.calls}). Fix: {FIXES['round_trip']}"
            )
        if self.dtype_changes:
            casts = sorted({f"{a}->{b}" for _, a, b, _ in self.dtype_changes})
            names = ", ".join(n for n, *_ in self.dtype_changes[:_NAMED])
            trainable = sum(1 for *_, t in self.dtype_changes if t)
            done = (
                f"restored {self.restored} (same values, same Parameter objects)"
                if self.restored
                else "left as they are"
            )
            parts.append(
                f"{self.event} cast {len(self.dtype_changes)} parameter(s) in place "
                f"({'/'.join(casts)}; {trainable} trainable, held by the optimizer; {names}); "
                f"{done}. Fix: {FIXES['cast']}"
            )
        return "hf-precision: " + " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "event": self.event,
            "call": self.calls,
            "sampled": self.sampled,
            "changed": self.changed,
            "changed_share": round(self.changed_share, 6),
            "max_drift": self.max_drift,
            "changed_tensors": self.changed_tensors,
            "since_first_changed_share": round(self.total_changed_share, 6),
            "since_first_max_drift": self.total_max_drift,
            "dtype_changes": [
                {"name": n, "was": a, "is": b, "trainable": t} for n, a, b, t in self.dtype_changes
            ],
            "restored": self.restored,
        }


def _positions(numel: int, sample: int) -> torch.Tensor:
    """At most ``sample`` fixed flat positions, spread over the tensor."""
    if numel <= sample:
        return torch.arange(numel)
    return torch.arange(sample, dtype=torch.int64) * (numel - 1) // max(sample - 1, 1)


class SyncIntegrity:
    """Checksum samples of ``model``'s frozen weights around watched calls; see the module
    docstring. Each finding goes to :attr:`findings` and to ``on_finding``."""

    def __init__(
        self,
        model: nn.Module,
        *,
        sample: int = SAMPLE,
        on_finding: Callable[[SyncFinding], None] | None = None,
    ) -> None:
        self.params = dict(model.named_parameters())
        self.frozen = {
            n: p
            for n, p in self.params.items()
            if not p.requires_grad and p.is_floating_point() and p.numel() and not is_sharded(p)
        }
        self._pos = {n: _positions(p.numel(), sample) for n, p in self.frozen.items()}
        self.first = self.take()
        self.findings: list[SyncFinding] = []
        self.calls: dict[str, int] = {}
        self.on_finding = on_finding
        self._wrapped: list[tuple[Any, str, Any, bool]] = []

    def take(self) -> dict[str, torch.Tensor]:
        """The sampled values of every frozen tensor (a copy, on the tensor's device)."""
        return {
            n: p.detach().reshape(-1)[self._pos[n].to(p.device)].clone()
            for n, p in self.frozen.items()
        }

    def _held(self) -> dict[str, tuple[torch.dtype, torch.Tensor]]:
        return {n: (p.dtype, p.data) for n, p in self.params.items()}

    def check(
        self,
        event: str,
        before: dict[str, torch.Tensor],
        held: dict[str, tuple[torch.dtype, torch.Tensor]],
        *,
        restore: bool = False,
    ) -> SyncFinding | None:
        """Compare now against ``before`` (and the first sample); note dtype changes against
        ``held`` and, with ``restore``, put the held tensors back."""
        self.calls[event] = self.calls.get(event, 0) + 1
        found = SyncFinding(event, self.calls[event])
        self._dtypes(found, held, restore)
        after = self.take()
        total_changed = 0
        for n, now in after.items():
            was, first = before[n], self.first[n]
            found.sampled += now.numel()
            same_dtype = now.dtype == was.dtype
            diff = now.float() - was.float()
            moved = int((now != was).sum()) if same_dtype else int((diff != 0).sum())
            if moved:
                found.changed += moved
                found.changed_tensors.append(n)
                found.max_drift = max(found.max_drift, float(diff.abs().max()))
            since = now.float() - first.float()
            total_changed += int((since != 0).sum())
            found.total_max_drift = max(found.total_max_drift, float(since.abs().max()))
        found.total_changed_share = total_changed / found.sampled if found.sampled else 0.0
        if not found.changed and not found.dtype_changes:
            return None
        self.findings.append(found)
        if self.on_finding is not None:
            self.on_finding(found)
        return found

    def _dtypes(
        self, found: SyncFinding, held: dict[str, tuple[torch.dtype, torch.Tensor]], restore: bool
    ) -> None:
        for n, p in self.params.items():
            was, data = held[n]
            if p.dtype == was:
                continue
            found.dtype_changes.append((n, dtype_name(was), dtype_name(p.dtype), p.requires_grad))
            safe = (
                data.shape == p.shape
                and not is_sharded(p)
                and not hasattr(p, "ds_id")  # DeepSpeed ZeRO-3 owns it
                and (p.grad is None or p.grad.dtype == was)
            )
            if restore and safe:
                p.data = data
                found.restored += 1

    # ------------------------------------------------------------------ wrapping
    def around(self, obj: Any, method: str, *, event: str, restore: bool = False) -> None:
        """Watch each call of ``obj.<method>`` (wrapped on the instance)."""
        inner = getattr(obj, method)

        @functools.wraps(inner)
        def watched(*args: Any, **kwargs: Any) -> Any:
            before, held = self.take(), self._held()
            try:
                return inner(*args, **kwargs)
            finally:
                self._safe(lambda: self.check(event, before, held, restore=restore))

        self._shadow(obj, method, watched)

    def round_trip(self, obj: Any, start: str, end: str, *, event: str) -> None:
        """Watch ``obj.<start>()`` ... ``obj.<end>()`` as one event (PEFT's merge/unmerge)."""
        first, last = getattr(obj, start), getattr(obj, end)
        pending: list[tuple[dict[str, torch.Tensor], dict[str, Any]]] = []

        @functools.wraps(first)
        def opened(*args: Any, **kwargs: Any) -> Any:
            pending[:] = [(self.take(), self._held())]
            return first(*args, **kwargs)

        @functools.wraps(last)
        def closed(*args: Any, **kwargs: Any) -> Any:
            out = last(*args, **kwargs)
            if pending:
                before, held = pending.pop()
                self._safe(lambda: self.check(event, before, held))
            return out

        self._shadow(obj, start, opened)
        self._shadow(obj, end, closed)

    def _shadow(self, obj: Any, method: str, fn: Callable[..., Any]) -> None:
        had = method in vars(obj)
        self._wrapped.append((obj, method, vars(obj).get(method) if had else None, had))
        object.__setattr__(obj, method, fn)

    def remove(self) -> None:
        """Take the wrappers off (the instance's own attribute comes back, or none)."""
        for obj, method, old, had in reversed(self._wrapped):
            if had:
                object.__setattr__(obj, method, old)
            else:
                object.__delattr__(obj, method)
        self._wrapped = []

    def _safe(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as err:  # an observer never stops training
            logger.warning(
                "hf-precision: the sync integrity check failed (%s: %s)", type(err).__name__, err
            )
