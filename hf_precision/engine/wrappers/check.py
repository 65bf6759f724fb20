"""The wrapper check: what a wrapper that owns the parameters (FSDP2, FSDP1, DeepSpeed) does on
purpose, sorted from what breaks the policy, read off the plan. Nothing is cast.

The plan (:func:`~hf_precision.engine.plan.plan_policy`) decided every parameter already; its
``decided`` records are classified here against the wrapper's record in
:data:`~hf_precision.base.wrapper_kinds.WRAPPERS`
(which dtypes it is expected to hold them in) and the
dtype it computes each in (:func:`~hf_precision.base.wrapper_kinds.wrapper_compute_dtypes`), with no
second walk and no second decision:

* **expected**: stored in one dtype that the wrapper computes in the policy's; trainable weights
  FSDP upcast to float32 (master weights); every weight in DeepSpeed's config dtype (its optimizer
  keeps fp32 master weights; ZeRO-3's trainable half weights are the plan's rule
  ``wrapper_master_fp32``);
* **casts**: a weight the policy keeps in float32 that the wrapper cast to its config dtype;
* **notes**: a float32 weight the wrapper computes in another dtype;
* **violations**: the rest, raised (warned in ``audit``) by :func:`explain_wrapped`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...base.wrapper_kinds import (
    HOLDING_WRAPPERS,
    WrapperKind,
    clean_name,
    detect_wrapper,
    settle_shards,
    wrapper_compute_dtypes,
    wrapper_kind,
    wrapper_of,
)
from ...errors import PrecisionError
from ...model.view import ModelView
from ...rules.deepspeed_config import check_training_args
from ...rules.dtypes import dtype_name
from ...rules.groups.module_groups import ModuleGroups
from ...rules.policy.precision_policy import PrecisionPolicy
from ..plan import plan_policy
from ..records import Change, Decided, EnforceReport, Plan

__all__ = ["WrapperCheck", "check_wrapped", "classify", "explain_wrapped"]

_MAX_LISTED = 8


@dataclass
class WrapperCheck:
    """What :func:`check_wrapped` found on a model a wrapper holds (nothing was cast)."""

    wrapper: str
    violations: list[str] = field(default_factory=list)  # the policy is broken: cannot cast
    names: set[str] = field(default_factory=set)  # parameters behind the violations
    expected: dict[str, int] = field(default_factory=dict)  # why deviations are fine -> count
    notes: list[str] = field(default_factory=list)  # allowed but worth a warning
    #: parameters the wrapper itself cast against the policy (a keep-fp32 or fp32 group held in
    #: DeepSpeed's dtype): (name, group, held dtype, wanted dtype, rule)
    casts: list[tuple[str, str, torch.dtype, torch.dtype, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.violations)

    def cast_message(self, where: str) -> str:
        """One message naming what the wrapper cast against the policy, and the fix."""
        by_group: dict[str, list[str]] = {}
        for name, group, _, _, _ in self.casts:
            by_group.setdefault(group, []).append(name)
        _, _, held, want, rule = self.casts[0]
        listed = "; ".join(f"{g}: {len(n)} parameter(s), e.g. {n[0]}" for g, n in by_group.items())
        kind = wrapper_kind(self.wrapper)
        fix = (
            kind.cast_fix
            if kind is not None and kind.cast_fix
            else f"Fix: configure {self.wrapper}'s mixed precision to leave these parameters in "
            f"{dtype_name(want)}, or drop the rule from the policy"
        )
        return (
            f"{where}: {self.wrapper} holds {len(self.casts)} parameter(s) in "
            f"{dtype_name(held)} that the policy keeps in {dtype_name(want)} ({rule}): "
            f"{listed}. {fix}; mode='raise' stops here instead of warning."
        )

    def error(self, where: str, policy: PrecisionPolicy) -> PrecisionError:
        listed = self.violations[:_MAX_LISTED]
        more = len(self.violations) - len(listed)
        return PrecisionError(
            f"{where}: {len(self.violations)} parameter(s) violate {policy.describe()} and "
            f"{self.wrapper} holds them, so the guard will not cast them:\n  "
            + "\n  ".join(listed + ([f"... and {more} more"] if more > 0 else []))
            + "\nFix: let the guard cast before wrapping (guard.prepare(accelerator, model, ...) "
            "or PrecisionGuardCallback in Trainer(callbacks=[...])), or load the model in the "
            "policy's dtypes; for FSDP set MixedPrecisionPolicy(param_dtype=...) to the policy's "
            "compute dtype."
        )

    def add(self, d: Decided, verdict: str, why: str, runs: torch.dtype) -> None:
        """File one parameter under ``verdict`` (see :func:`_verdict`)."""
        if verdict == "cast":
            self.casts.append((d.name, d.group, d.storage, d.target, d.reason))
        elif verdict == "note":
            self.notes.append(why)
        elif verdict == "expected":
            self.expected[why] = self.expected.get(why, 0) + 1
        elif verdict == "violation":
            how = f", computed in {dtype_name(runs)}" if runs != d.storage else ""
            self.names.add(d.name)
            self.violations.append(
                f"{d.name} [{d.group}]: {dtype_name(d.storage)}{how}; the policy wants "
                f"{dtype_name(d.target)} ({d.reason})"
            )


def _verdict(
    d: Decided,
    kind: WrapperKind,
    runs: torch.dtype,
    config: torch.dtype | None,
    compute: torch.dtype,
) -> tuple[str, str]:
    """``(verdict, why)`` for one parameter the wrapper ``kind`` holds, computed in ``runs``:
    ``ok``, ``cast`` (the wrapper cast it to its ``config`` dtype against the policy), ``note``,
    ``expected`` (``why``: the reason, counted) or ``violation``."""
    storage, target, name = d.storage, d.target, kind.name
    config_cast = kind.holds_config_dtype and storage != target and storage == (config or storage)
    if d.keeps_fp32:
        if storage == target == runs:
            return "ok", ""
        if config_cast:
            return "cast", ""
        if storage == target or kind.holds_config_dtype:
            why = f"{d.name} [{d.group}] should stay float32 ({d.reason}) but {name} computes it in"
            return "note", f"{why} {dtype_name(runs)}"
        return "violation", ""
    if config_cast and not d.trainable and target == torch.float32:
        return "cast", ""
    if runs not in (target, compute):
        return "violation", ""
    if storage == target:
        return "ok", ""
    if runs == target:
        return "expected", f"stored {dtype_name(storage)}, computed {dtype_name(runs)} by {name}"
    if kind.upcasts_trainable and d.trainable and storage == torch.float32:
        return "expected", f"trainable weights upcast to float32 by {name} (master weights)"
    if kind.holds_config_dtype and storage == (config or storage):
        return (
            "expected",
            f"held in {dtype_name(storage)} by {name} (fp32 master weights: optimizer)",
        )
    return "violation", ""


def _cleaned(d: Decided, groups: ModuleGroups) -> Decided:
    """``d`` named without wrapper segments (FSDP1's ``_fsdp_wrapped_module``), in the group
    that name is in."""
    name = clean_name(d.name)
    return d if name == d.name else d._replace(name=name, group=groups.group_of(name))


def classify(
    plan: Plan, wrapper: str, *, deepspeed_dtype: torch.dtype | None = None
) -> WrapperCheck:
    """Sort the plan's parameters (``plan.decided``) under the wrapper called ``wrapper``: what
    it does on purpose, what it cast against the policy, and the violations. Reads the model
    only for the dtypes the wrapper computes in (its modules, from the plan's walk)."""
    view = plan.view
    modules = [m for _, _, m in view.modules]
    if view.model is not view.root:  # FSDP1's outermost unit wraps the root
        modules.insert(0, view.model)
    compute = wrapper_compute_dtypes(view.model, modules)
    kind = wrapper_kind(wrapper) or WrapperKind(wrapper)
    out = WrapperCheck(wrapper)
    for d in map(_cleaned, plan.decided, [plan.groups] * len(plan.decided)):
        runs = compute.get(id(d.tensor), d.storage)
        verdict, why = _verdict(d, kind, runs, deepspeed_dtype, plan.policy.compute_dtype)
        out.add(d, verdict, why, runs)
    return out


def check_wrapped(
    model: nn.Module,
    policy: PrecisionPolicy,
    groups: ModuleGroups | None = None,
    *,
    wrapper: str | None = None,
    deepspeed_dtype: torch.dtype | None = None,
    master_fp32: torch.dtype | None = None,
    plan: Plan | None = None,
) -> WrapperCheck:
    """Verify, without casting, a model FSDP (1 or 2) or DeepSpeed holds: :func:`classify` of
    ``plan`` (the event's plan of ``model`` under ``policy``), or of a plan made here.

    Expected and not drift: FSDP's upcast of trainable parameters to fp32 (accelerate does it,
    the fp32 copy is the master weight); weights stored in one dtype that FSDP mixed precision
    computes in the policy's dtype; DeepSpeed holding every weight in its config's dtype (its
    optimizer keeps fp32 master weights; ``master_fp32``, the half dtype of a ZeRO-3 run, says
    so per tensor: rule ``wrapper_master_fp32``). Anything else is a violation.
    """
    if plan is None:
        settle_shards(model)  # after an evaluation FSDP2's root unit holds unsharded bf16 views
        plan = plan_policy(ModelView.of(model, groups), policy, master_fp32=master_fp32)
    wrapper = wrapper or wrapper_of(model) or "the wrapper"
    return classify(plan, wrapper, deepspeed_dtype=deepspeed_dtype)


def explain_wrapped(
    model: nn.Module,
    policy: PrecisionPolicy,
    groups: ModuleGroups,
    audit: EnforceReport,
    *,
    args: Any = None,
    where: str,
    wrapper: str | None = None,
    check: WrapperCheck | None = None,
) -> EnforceReport:
    """Drop from an audit what FSDP/DeepSpeed do on purpose (see :func:`check_wrapped`); raise
    for the rest unless the policy only audits. What the wrapper cast against the policy (a
    keep-fp32 group held in bf16) is listed in ``wrapper_casts`` with a message (with the fix)
    in ``wrapper_note``, and raised in ``raise`` mode. Without a wrapper that owns the
    parameters (:data:`~hf_precision.base.wrapper_kinds.HOLDING_WRAPPERS`) ``audit`` is returned.
    ``wrapper`` and ``check`` skip the detection and the check when the caller has them."""
    wrapper = wrapper or detect_wrapper(model, args=args)
    if wrapper not in HOLDING_WRAPPERS:
        return audit
    if check is None:
        check = check_wrapped(
            model,
            policy,
            groups,
            wrapper=wrapper,
            deepspeed_dtype=check_training_args(args) if args is not None else None,
        )
    if check and policy.mode != "audit":
        raise check.error(where, policy)
    if check.casts and policy.mode == "raise":
        raise PrecisionError(check.cast_message(where))
    kept = copy.copy(audit)
    kept.wrapper_note = check.cast_message(where) if check.casts else None
    kept.changes = [c for c in audit.changes if clean_name(c.name) in check.names]
    kept.wrapper_casts = [
        Change(
            name,
            "param",
            group,
            dtype_name(held),
            dtype_name(want),
            f"cast by {wrapper}; the policy wants {dtype_name(want)} ({rule})",
        )
        for name, group, held, want, rule in check.casts
    ]
    return kept
