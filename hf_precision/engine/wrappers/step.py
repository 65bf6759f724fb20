"""The pipeline's wrapper and apply steps (docs/architecture.md) for one engine
(:class:`~hf_precision.engine.guard.PrecisionGuard`): when FSDP, FSDP2 or DeepSpeed holds the
parameters, what the wrapper does on purpose is explained and the rest raised, nothing cast
(:func:`~hf_precision.engine.wrappers.check.classify`); otherwise the event's own plan is
applied, under DDP only as a return to the dtypes DDP built its buckets for; FSDP2's
``output_dtype`` is said and bridged.
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...base.wrapper_kinds import WrapperKind, wrapper_kind
from ...errors import PrecisionWarning
from ...rules.policy.precision_policy import PrecisionPolicy
from ..enforce import apply_plan
from ..records import EnforceReport, Plan
from ..speaker import Speaker
from .check import classify, explain_wrapped
from .fsdp2 import settle_outputs
from .ranks import ddp_restore_error

logger = logging.getLogger("hf_precision")

__all__ = ["Engine", "WrapperStep"]

_MAX_LISTED = 8


class Engine(Protocol):
    """What :meth:`WrapperStep.run` reads of its engine at each event (the front ends may
    change these fields between events)."""

    policy: PrecisionPolicy
    deepspeed_dtype: torch.dtype | None
    #: the parameters and their dtypes at the engine's last event
    params: tuple[torch.Tensor, ...]
    dtypes: tuple[torch.dtype, ...]


@dataclass
class WrapperStep:
    """What one engine keeps between events about the wrapper around its model."""

    #: the front end, for messages (``"PrecisionGuardCallback"``)
    name: str
    speaker: Speaker
    #: parameter dtypes when DDP wrapped the model (drift may only go back to them)
    wrap_dtypes: dict[int, torch.dtype] = field(default_factory=dict)
    #: FSDP2 unit path -> the hooks that cast its outputs to its parent's compute dtype
    bridges: dict[str, list[RemovableHandle]] = field(default_factory=dict)
    _casts: set[str] = field(default_factory=set)  # the wrapper casts said last

    def run(
        self,
        plan: Plan,
        audit: EnforceReport,
        wrapper: str | None,
        engine: Engine,
        held: bool,
        optimizer: object,
        where: str,
    ) -> tuple[EnforceReport, int]:
        """The event's report and how many tensors were off the policy: a wrapper that holds
        the parameters (``held``) explains them, nothing cast; else the audit's own plan is
        applied."""
        policy, deepspeed_dtype = engine.policy, engine.deepspeed_dtype
        last = (engine.params, engine.dtypes)
        report, found = audit, len(audit.changes)
        model = plan.view.model
        if held and wrapper is not None:
            report, found = self._explain(plan, policy, wrapper, audit, where, deepspeed_dtype)
        elif audit.changes and policy.mode != "audit":
            if _kind(wrapper).buckets_by_dtype:
                self._check_ddp_restore(plan, audit, where, last)
            # the same plan, not a second one
            mode = plan.policy.mode
            report = apply_plan(plan, mode, optimizer, allow_wrapped=wrapper is not None)
        if _kind(wrapper).reshards:
            report = self._fsdp2_outputs(model, report)
        return report, found

    def _explain(
        self,
        plan: Plan,
        policy: PrecisionPolicy,
        wrapper: str,
        audit: EnforceReport,
        where: str,
        deepspeed_dtype: torch.dtype | None,
    ) -> tuple[EnforceReport, int]:
        model, groups = plan.view.model, plan.view.groups
        # the plan's own records, sorted by the wrapper's record (nothing decided again)
        check = classify(plan, wrapper, deepspeed_dtype=deepspeed_dtype)
        for why, n in check.expected.items():
            logger.info("hf-precision %s: %d parameter(s) %s (expected)", where, n, why)
        for note in check.notes[:_MAX_LISTED]:
            self.speaker.once(f"{where}: {note}", stacklevel=5)
        if check and policy.mode == "audit":
            warnings.warn(str(check.error(where, policy)), PrecisionWarning, stacklevel=4)
        kept = explain_wrapped(
            model, policy, groups, audit, where=where, wrapper=wrapper, check=check
        )
        casts = {c.name for c in kept.wrapper_casts}
        if casts and casts != self._casts:  # once, not at every evaluation
            warnings.warn(kept.wrapper_note or "", PrecisionWarning, stacklevel=4)
        self._casts = casts
        return kept, len(check.violations)

    def _fsdp2_outputs(self, model: nn.Module, report: EnforceReport) -> EnforceReport:
        """FSDP2's ``output_dtype``, said and bridged (:func:`.fsdp2.settle_outputs`)."""
        messages = settle_outputs(model, self.name, self.bridges)
        for message in messages:
            self.speaker.once(message, stacklevel=5)
        if not messages:
            return report
        report = copy.copy(report)
        report.wrapper_findings = [*report.wrapper_findings, *messages]
        return report

    def _check_ddp_restore(
        self,
        plan: Plan,
        audit: EnforceReport,
        where: str,
        last: tuple[tuple[torch.Tensor, ...], tuple[torch.dtype, ...]],
    ) -> None:
        """DDP built its gradient buckets for the dtypes at wrapping time (or, when the guard
        did not see the wrapping, at its last verify): only going back to those is safe."""
        ref = self.wrap_dtypes or {id(p): d for p, d in zip(*last, strict=True)}
        root = plan.view.root
        error = ddp_restore_error(audit.changes, ref, root, where=where, name=self.name)
        if error is not None:
            raise error

    def mark(self, model: nn.Module) -> None:
        """Remember the dtypes a DDP wrapper built its gradient buckets for."""
        self.wrap_dtypes = {id(p): p.dtype for p in model.parameters()}

    def teardown(self) -> None:
        """Take FSDP2's output bridges off."""
        for handles in self.bridges.values():
            for h in handles:
                h.remove()
        self.bridges = {}


def _kind(wrapper: str | None) -> WrapperKind:
    """The wrapper's record (a record of no behaviour for no wrapper or an unknown name)."""
    return wrapper_kind(wrapper) or WrapperKind(wrapper or "none")
