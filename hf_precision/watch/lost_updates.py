"""The lost-update check: how many elements of half-precision trainable weights an optimizer step
left unchanged.

A bf16 weight near 1.0 moves in steps of 2**-7; one AdamW step at lr 1e-5 moves it by about
1e-5, which rounds back to the same bf16 value. ``Trainer(bf16=True)`` is autocast with no fp32
master copy, and transformers 5 loads a checkpoint in its own dtype: a full fine-tune of a bf16
checkpoint trains bf16 weights and most of its updates vanish without a word.

:class:`LostUpdateCheck` watches the first ``steps`` optimizer steps through the optimizer's own
step pre/post hooks (it sees the real step, whoever calls it: the Trainer, accelerate, a
GradScaler that skips a step calls no hook). Per trainable weight (float32 ones too, to compare;
only half-precision ones are warned about) it keeps a fixed
random sample of at most ``sample`` flat indices and, before each step, the sampled values and
whether their gradient is non-zero. After the step it counts, among the sampled elements whose
gradient was non-zero (an unused embedding row has none: it is not counted), those whose value is
bit for bit the same. No full copy is made; the hooks come off after the last watched step.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
>>> opt = torch.optim.AdamW([w], lr=1e-5, weight_decay=0.0)
>>> check = LostUpdateCheck({"w": w}, steps=1).attach(opt)
>>> w.grad = torch.full_like(w, 0.5); opt.step()
>>> check.result().share
1.0
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..base.wrapper_kinds import is_sharded
from ..rules.dtypes import dtype_name
from .finding import Finding, Severity

LostUpdates = Literal["auto", "off"]
LOST_UPDATES: tuple[str, ...] = ("auto", "off")
#: the share of counted elements left unchanged above which the check warns
WARN_SHARE = 0.1
_HALF_NAMES = ("bfloat16", "float16")
_NAMED = 3


@dataclass
class WeightLoss:
    """One weight's tally over the watched steps."""

    name: str
    dtype: str
    numel: int
    counted: int = 0  # sampled elements with a non-zero gradient, summed over the steps
    unchanged: int = 0  # of those, the ones the step left bit for bit the same

    @property
    def share(self) -> float:
        return self.unchanged / self.counted if self.counted else 0.0


@dataclass
class LostUpdateResult:
    """What the watched steps showed (``to_dict`` is the ``lost_updates`` section of the event
    JSON)."""

    steps: int
    sample: int
    weights: list[WeightLoss] = field(default_factory=list)

    @property
    def counted(self) -> int:
        return sum(w.counted for w in self.weights)

    @property
    def unchanged(self) -> int:
        return sum(w.unchanged for w in self.weights)

    @property
    def share(self) -> float:
        return self.unchanged / self.counted if self.counted else 0.0

    def _half(self) -> list[WeightLoss]:
        return [w for w in self.weights if w.dtype in _HALF_NAMES]

    @property
    def half_share(self) -> float:
        """The share over the half-precision weights only."""
        counted = sum(w.counted for w in self._half())
        return sum(w.unchanged for w in self._half()) / counted if counted else 0.0

    @property
    def lossy(self) -> list[WeightLoss]:
        """The half-precision weights above :data:`WARN_SHARE`, most lost first."""
        return sorted(
            (w for w in self.weights if w.dtype in _HALF_NAMES and w.share > WARN_SHARE),
            key=lambda w: -w.share,
        )

    @property
    def half_numel(self) -> int:
        return sum(w.numel for w in self.weights if w.dtype in _HALF_NAMES)

    def fp32_cost(self) -> dict[str, int]:
        """Bytes fp32 trainables add over the watched half weights: the weights (+2 bytes an
        element for bf16/fp16 -> fp32), and with them the gradients and AdamW's two moments,
        which follow the weight's dtype (+2 bytes each)."""
        weights = 2 * self.half_numel
        return {"weights": weights, "with_grads_and_adamw": 4 * weights}

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "sample_per_tensor": self.sample,
            "counted": self.counted,
            "unchanged": self.unchanged,
            "share": round(self.share, 6),
            "half_share": round(self.half_share, 6),
            "what_is_counted": "sampled elements of trainable weights whose "
            "gradient was non-zero at that step; unchanged = bit for bit equal after the step",
            "fp32_cost_bytes": self.fp32_cost(),
            "weights": [
                {
                    "name": w.name,
                    "dtype": w.dtype,
                    "numel": w.numel,
                    "counted": w.counted,
                    "unchanged": w.unchanged,
                    "share": round(w.share, 6),
                }
                for w in self.weights
            ],
        }

    def warning(self, fix: str) -> str | None:
        """The one-line warning, or ``None`` when no weight lost more than :data:`WARN_SHARE`."""
        lossy = self.lossy
        if not lossy:
            return None
        from ..base.tables import fmt_bytes

        names = ", ".join(f"{w.name} {w.share:.0%}" for w in lossy[:_NAMED])
        more = f" and {len(lossy) - _NAMED} more" if len(lossy) > _NAMED else ""
        dtypes = "/".join(sorted({w.dtype for w in lossy}))
        cost = self.fp32_cost()
        half_counted = sum(w.counted for w in self._half())
        half_unchanged = sum(w.unchanged for w in self._half())
        return (
            f"hf-precision: updates lost in {dtypes}: over the first {self.steps} optimizer "
            f"step(s), {self.half_share:.0%} of the sampled {dtypes} elements with a gradient "
            f"({half_unchanged}/{half_counted}) came out of the step unchanged, in "
            f"{len(lossy)} trainable weight(s) ({names}{more}). Fix: {fix}; it costs "
            f"+{fmt_bytes(cost['weights'])} to hold the "
            f"{self.half_numel:,} half-precision trainable elements in fp32 "
            f"(+{fmt_bytes(cost['with_grads_and_adamw'])} with their gradients and AdamW moments)."
        )

    def group_shares(self, group_of: Callable[[str], str]) -> dict[str, float]:
        """The unchanged share per module group (``group_of``: weight name -> group), over the
        weights with counted elements, most lost first: the finding's picture."""
        counted: dict[str, list[int]] = {}
        for w in self.weights:
            if w.counted:
                tally = counted.setdefault(group_of(w.name), [0, 0])
                tally[0] += w.unchanged
                tally[1] += w.counted
        shares = {g: u / c for g, (u, c) in counted.items()}
        return dict(sorted(shares.items(), key=lambda kv: -kv[1]))

    def finding(self, fix: str, group_of: Callable[[str], str] | None = None) -> Finding:
        """The result as one :class:`~hf_precision.watch.finding.Finding`: a warning
        (:meth:`warning`, with ``fix``) when half-precision weights lost updates, else what was
        measured (info)."""
        groups = self.group_shares(group_of) if group_of is not None else {}
        said = self.warning(fix)
        if said is None:
            dtypes = "/".join(sorted({w.dtype for w in self.weights if w.counted})) or "none"
            said = (
                f"hf-precision: update check passed: over the first {self.steps} optimizer "
                f"step(s), {self.unchanged}/{self.counted} sampled trainable elements with a "
                f"gradient ({dtypes}) came out of the step unchanged"
            )
        severity: Severity = "warning" if self.lossy else "info"
        return Finding(
            "lost_updates",
            severity,
            said,
            numbers=self.to_dict(),
            groups=groups,
            measure="share of sampled elements with a gradient left unchanged by the step",
        )


class LostUpdateCheck:
    """Watch ``steps`` optimizer steps of the trainable weights in ``named`` (name ->
    parameter; float32 ones are measured too, for comparison: only half-precision ones are
    warned about); see the module docstring."""

    def __init__(
        self,
        named: Mapping[str, torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
        *,
        steps: int = 3,
        sample: int = 4096,
        seed: int = 0,
    ) -> None:
        items = named.items() if isinstance(named, Mapping) else named
        self.params = {  # a DTensor shard (FSDP2) is not sampled: its flat index is not global
            n: p
            for n, p in items
            if p.requires_grad and p.is_floating_point() and p.numel() > 0 and not is_sharded(p)
        }
        self.steps, self.sample = steps, sample
        gen = torch.Generator().manual_seed(seed)
        self._index = {n: _sample_index(p.numel(), sample, gen) for n, p in self.params.items()}
        self._tally = {
            n: WeightLoss(n, dtype_name(p.dtype), p.numel()) for n, p in self.params.items()
        }
        self._before: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles: list[Any] = []
        self.seen = 0
        #: called with the :class:`LostUpdateResult` once the last watched step is done
        self.on_done: Callable[[LostUpdateResult], None] | None = None
        self.root: Any = None  # the model watched, when :func:`watch` started the check

    @property
    def active(self) -> bool:
        return bool(self._handles)

    @property
    def done(self) -> bool:
        return self.seen >= self.steps

    def attach(self, optimizer: Any) -> LostUpdateCheck:
        """Hook the torch optimizer (inside accelerate's ``AcceleratedOptimizer`` if wrapped)."""
        opt = getattr(optimizer, "optimizer", optimizer)
        if not self.params or self.done or self._handles:
            return self
        if not hasattr(opt, "register_step_pre_hook"):
            return self
        self._handles = [
            opt.register_step_pre_hook(self._pre),
            opt.register_step_post_hook(self._post),
        ]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._before = {}

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            self._snapshot()
        except Exception as err:  # an observer never stops training
            self._give_up(err)

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            self._compare()
        except Exception as err:
            self._give_up(err)
            return
        self.seen += 1
        if self.done:
            self.detach()
            if self.on_done is not None:
                self.on_done(self.result())

    def _give_up(self, err: Exception) -> None:
        from ..errors import PrecisionWarning

        self.detach()
        warnings.warn(
            f"hf-precision: the lost-update check stopped ({type(err).__name__}: {err}); "
            "training goes on. Fix: lost_updates='off' silences this.",
            PrecisionWarning,
            stacklevel=3,
        )

    def _snapshot(self) -> None:
        self._before = {}
        for n, p in self.params.items():
            if p.grad is None:
                continue
            idx = self._index[n].to(p.device)
            flat, grad = p.detach().reshape(-1), p.grad.detach().reshape(-1)
            self._before[n] = (flat[idx].clone(), grad[idx] != 0)

    def _compare(self) -> None:
        for n, (before, moved) in self._before.items():
            p = self.params[n]
            after = p.detach().reshape(-1)[self._index[n].to(p.device)]
            same = after == before
            tally = self._tally[n]
            tally.counted += int(moved.sum())
            tally.unchanged += int((same & moved).sum())
        self._before = {}

    def result(self) -> LostUpdateResult:
        return LostUpdateResult(self.seen, self.sample, list(self._tally.values()))


def _sample_index(numel: int, sample: int, gen: torch.Generator) -> torch.Tensor:
    """A fixed random set of at most ``sample`` distinct flat indices (all when fewer)."""
    if numel <= sample:
        return torch.arange(numel)
    return torch.unique(torch.randint(numel, (sample,), generator=gen))


def lost_updates_fix(args: Any = None, *, tool: Any = None) -> str:
    """The fix in the user's tool's words: fp32 trainable weights (the guard upcasts them when
    the run says ``bf16``: the ``bf16`` policy holds trainables in float32)."""
    from ..rules.flags import flag

    return (
        f"train with {flag('bf16', True, args=args, tool=tool)} and this guard (its bf16 policy "
        "holds trainable weights in float32 and computes in bf16), or "
        "PrecisionGuardCallback(PrecisionPolicy.from_preset('bf16')) when the flag cannot change"
    )


def watch(
    guard: Any,
    optimizer: Any,
    *,
    args: Any = None,
    tool: Any = None,
    steps: int = 3,
    fix: str | None = None,
) -> LostUpdateCheck:
    """Start the check on ``optimizer`` for the trainable weights of ``guard``'s model (a
    :class:`~hf_precision.engine.guard.PrecisionGuard`); when the watched steps are done, the
    result goes into ``guard.sections["lost_updates"]`` (every later event's JSON) and, as one
    :class:`~hf_precision.watch.finding.Finding` through ``guard.emit`` (the console through
    ``logging``, ``precision.log``, ``<step>-lost_updates.json`` and its picture of the
    unchanged share per group, W&B / TensorBoard): a warning with ``fix`` (default: the fix in
    the user's tool's words) when half-precision weights lost updates, else what was
    measured."""
    check = LostUpdateCheck(guard.root.named_parameters(), steps=steps)

    def done(result: LostUpdateResult) -> None:
        guard.sections["lost_updates"] = result.to_dict()
        said = fix if fix is not None else lost_updates_fix(args, tool=tool)
        guard.emit(result.finding(said, guard.groups.group_of), step=check.seen)

    check.on_done, check.root = done, guard.root
    return check.attach(optimizer)


def check_option(value: str, *, call: str) -> LostUpdates:
    if value not in LOST_UPDATES:
        from ..errors import PrecisionError

        raise PrecisionError(
            f"{call}: lost_updates={value!r} is not one of {', '.join(map(repr, LOST_UPDATES))}. "
            "Fix: lost_updates='auto' (watch the first optimizer steps) or 'off'."
        )
    return value  # type: ignore[return-value]
