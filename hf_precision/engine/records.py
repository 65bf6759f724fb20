"""The plan's records: a :class:`Change` per tensor, the :class:`PlannedCast` behind it, the
frozen :class:`Plan` (:func:`~hf_precision.engine.plan.plan_policy`) and the :class:`EnforceReport`
:func:`~hf_precision.engine.enforce.apply_plan` returns. Values only: nothing here reads a model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from ..model.view import ModelView
from ..rules.groups.module_groups import ModuleGroups
from ..rules.policy.precedence import Rule
from ..rules.policy.precision_policy import PrecisionPolicy

__all__ = ["Change", "Decided", "EnforceReport", "Plan", "PlannedCast", "TensorKind"]

TensorKind = Literal["param", "buffer"]

_MAX_LISTED = 12


@dataclass
class Change:
    """One tensor the policy wants changed (applied or not, see :attr:`EnforceReport.applied`)."""

    name: str
    kind: TensorKind
    group: str
    before: str
    after: str
    reason: str
    device_before: str = ""
    device_after: str = ""

    def describe(self) -> str:
        dev = (
            f", {self.device_before} -> {self.device_after}"
            if self.device_after and self.device_after != self.device_before
            else ""
        )
        return f"{self.name} [{self.group}]: {self.before} -> {self.after}{dev} ({self.reason})"


class Decided(NamedTuple):
    """One parameter as the plan decided it, cast or not: what the wrapper check
    (:func:`~hf_precision.engine.wrappers.check.classify`)
    sorts into expected, noted and violations."""

    name: str  # its path in the model (FSDP1's segments still in it)
    group: str
    tensor: torch.Tensor
    storage: torch.dtype  # the dtype it is stored in (a ZeRO-3 partition's)
    target: torch.dtype  # what the policy wants
    reason: str
    keeps_fp32: bool  # a keep rule decided (:attr:`Decision.keeps_fp32`)
    trainable: bool  # ``requires_grad``


@dataclass
class PlannedCast:
    """One tensor the plan casts or moves: where it lives, the tensor, what and why."""

    module: nn.Module
    key: str  # the attribute name in ``module._parameters`` / ``module._buffers``
    tensor: torch.Tensor
    change: Change
    dtype: torch.dtype
    device: torch.device
    #: the exact values to write instead of a cast (a rotary table recomputed from the config)
    value: torch.Tensor | None = None


@dataclass
class EnforceReport:
    """What :func:`enforce_policy` changed (or, in ``audit`` mode, would change)."""

    policy: PrecisionPolicy
    groups: ModuleGroups
    applied: bool
    changes: list[Change] = field(default_factory=list)
    kept_fp32: list[tuple[str, str]] = field(default_factory=list)
    #: every tensor a keep rule held on purpose: (name, group, rule, reason), the rule one of
    #: ``rotary``, ``keep_fp32``, ``keep_fp32_strict``, ``deliberate_fp32`` (float32,
    #: :data:`KEEP_RULES`) or ``wrapper_master_fp32`` (a trainable half
    #: weight DeepSpeed ZeRO-3 keeps fp32 master copies of, left in its dtype)
    kept: list[tuple[str, str, Rule, str]] = field(default_factory=list)
    overflow: list[tuple[str, float]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    group_dtypes: dict[str, set[torch.dtype]] = field(default_factory=dict)
    #: what a wrapper (DeepSpeed, FSDP) cast against the policy: reported, never cast back
    wrapper_casts: list[Change] = field(default_factory=list)
    #: the message (with the fix) that goes with ``wrapper_casts``
    wrapper_note: str | None = None
    #: what a wrapper's own settings do to the outputs (FSDP2's ``output_dtype``), with fixes
    wrapper_findings: list[str] = field(default_factory=list)
    device: torch.device | None = None
    #: weights read outside their module (fused LM heads, raw parameters): set by the guard
    #: (:mod:`hf_precision.engine.outside_reads`), reported, never cast for it
    outside_reads: list[Any] = field(default_factory=list)
    #: the plan behind ``changes`` (:func:`apply_plan` carries it out) and the tensors found on
    #: the meta device while the model is elsewhere
    planned: list[PlannedCast] = field(default_factory=list, repr=False, compare=False)
    meta: list[str] = field(default_factory=list, repr=False, compare=False)

    def __bool__(self) -> bool:
        return bool(self.changes)

    def __iter__(self) -> Iterator[Change]:
        return iter(self.changes)

    @property
    def mixed_groups(self) -> tuple[str, ...]:
        """Groups whose floating parameters end up in more than one dtype (leaf guards go there)."""
        return tuple(g for g, d in self.group_dtypes.items() if len(d) > 1)

    def listed_changes(self) -> list[str]:
        """The first changes, one line each, and how many more there are."""
        lines = [c.describe() for c in self.changes[:_MAX_LISTED]]
        if len(self.changes) > _MAX_LISTED:
            lines.append(f"... and {len(self.changes) - _MAX_LISTED} more")
        return lines

    def summary(self) -> str:
        verb = "cast" if self.applied else "would cast"
        lines = [f"enforce_policy[{self.policy.describe()}]: {verb} {len(self.changes)} tensor(s)"]
        lines += ["  " + line for line in self.listed_changes()]
        by_rule: dict[str, list[str]] = {}
        for kept in self.kept:
            by_rule.setdefault(kept[2], []).append(kept[0])
        for rule, names in by_rule.items():
            held = "as they are" if rule == "wrapper_master_fp32" else "in float32"
            lines.append(f"  kept {len(names)} {held} ({rule}), e.g. {', '.join(names[:3])}")
        for name, value in self.overflow:
            lines.append(f"  kept {name}: max |value| {value:g} exceeds fp16 range")
        for name, why in self.skipped[:_MAX_LISTED]:
            lines.append(f"  skipped {name}: {why}")
        for read in self.outside_reads[:_MAX_LISTED]:
            lines.append(f"  read outside its module: {read.describe()}")
        return "\n".join(lines)

    __str__ = summary

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.to_dict(),
            "applied": self.applied,
            "changes": [c.__dict__ for c in self.changes],
            "wrapper_casts": [c.__dict__ for c in self.wrapper_casts],
            "wrapper_findings": self.wrapper_findings,
            "kept_fp32": self.kept_fp32,
            "kept": [
                {"name": n, "group": g, "rule": r, "reason": why} for n, g, r, why in self.kept
            ],
            "overflow": self.overflow,
            "skipped": self.skipped,
            "mixed_groups": list(self.mixed_groups),
            "rule": self.groups.rule,
            "outside_reads": [r.to_dict() for r in self.outside_reads],
        }


@dataclass(frozen=True)
class Plan:
    """What a policy wants changed in one walk of a model (:func:`plan_policy`): frozen, a
    value; :func:`~hf_precision.engine.enforce.apply_plan` carries it out and returns a fresh
    :class:`EnforceReport` each time."""

    view: ModelView
    policy: PrecisionPolicy
    device: torch.device | None
    changes: tuple[Change, ...]
    #: the casts behind ``changes``, in order
    planned: tuple[PlannedCast, ...]
    kept_fp32: tuple[tuple[str, str], ...]
    kept: tuple[tuple[str, str, Rule, str], ...]
    overflow: tuple[tuple[str, float], ...]
    skipped: tuple[tuple[str, str], ...]
    warnings: tuple[str, ...]
    group_dtypes: tuple[tuple[str, frozenset[torch.dtype]], ...]
    #: tensors on the meta device while the model is elsewhere
    meta: tuple[str, ...]
    #: every floating parameter of the model's tree as decided (cast or not), for the wrapper
    #: check; parameters of modules held outside the tree are not among them
    decided: tuple[Decided, ...] = ()

    @property
    def groups(self) -> ModuleGroups:
        return self.view.groups

    def __bool__(self) -> bool:
        return bool(self.changes)

    def report(self, *, applied: bool = False) -> EnforceReport:
        """A new :class:`EnforceReport` of this plan (its lists the caller's to extend)."""
        return EnforceReport(
            self.policy,
            self.view.groups,
            applied=applied,
            changes=list(self.changes),
            kept_fp32=list(self.kept_fp32),
            kept=list(self.kept),
            overflow=list(self.overflow),
            skipped=list(self.skipped),
            warnings=list(self.warnings),
            group_dtypes={g: set(d) for g, d in self.group_dtypes},
            device=self.device,
            planned=list(self.planned),
            meta=list(self.meta),
        )
