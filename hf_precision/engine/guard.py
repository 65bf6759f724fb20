"""``PrecisionGuard``: the one pipeline every front end runs at its events.

At each event (``setup``, ``on_train_begin``, ``after_evaluate``, ...) :meth:`PrecisionGuard.verify`
walks the same steps, in one direction (docs/architecture.md):

1. **plan** — :func:`~hf_precision.engine.plan.plan_policy` on one
   :class:`~hf_precision.model.view.ModelView` (a frozen
   :class:`~hf_precision.engine.records.Plan`), read in ``audit`` mode: what differs from the
   policy, nothing cast;
2. **wrapper** — if FSDP/FSDP2/DeepSpeed holds the parameters, explain what it does on purpose
   and raise for the rest (never cast); under DDP only a return to the wrap-time dtypes is cast;
3. **apply** — :func:`~hf_precision.engine.enforce.apply_plan` of the same plan when it is not empty
   (the one place that casts);
4. **guards** — install or update the batch, boundary and leaf hooks;
5. **report** — the reporter's files / W&B, then, where the front end asks, the ranks compared.

The front ends are adapters that decide *when* (their events) and *who holds the model*
(the wrapper): :class:`~hf_precision.frontends.callback.PrecisionGuardCallback` (``Trainer`` and
its TRL subclasses), :class:`~hf_precision.frontends.accelerate_plugin.PrecisionGuardPlugin`
(accelerate loops) and :func:`~hf_precision.frontends.diffusion.guard_diffusion` (one guard per
pipeline component).

>>> from hf_precision import PrecisionPolicy
>>> from hf_precision.tiny import tiny_llava
>>> import torch
>>> model = tiny_llava()
>>> _ = model.model.vision_tower.to(torch.float16)
>>> guard = PrecisionGuard(model, PrecisionPolicy.from_preset("bf16-true"))
>>> setup = guard.verify("setup")  # the fp16 tower and the fp32 rest, all to bf16
>>> len(setup.changes) > 0, len(guard.verify("check").changes)
(True, 0)
>>> guard.events == [("setup", len(setup.changes)), ("check", 0)]
True
>>> guard.teardown()
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import torch
from torch import nn

from ..base.wrapper_kinds import (
    HOLDING_WRAPPERS,
    WrapperKind,
    detect_wrapper,
    settle_shards,
    unwrap_model,
    wrapper_kind,
)
from ..errors import PrecisionWarning
from ..model.view import ModelView
from ..rules.deepspeed_config import zero3_master_dtype
from ..rules.groups.module_groups import ModuleGroups, find_module_groups
from ..rules.policy.precision_policy import PrecisionPolicy
from ..watch.finding import Finding, emit
from ..watch.what_ran import WhatRan
from .cast_hooks import Notice
from .claims import claim_model, release_model
from .enforce import apply_plan, restore_values
from .fp8.converters import fp8_event
from .fp8.shapes import fp8_gates
from .hooks import GuardHandle, guards_on, remove_guards
from .lines import kept_as_is
from .memory_account import account_line, memory_account
from .outside_reads import find_outside_reads, install_fused_head_check
from .plan import plan_policy
from .range_check import read_deferred
from .records import EnforceReport
from .speaker import Speaker, report_dir_of
from .stash import stash_tensors
from .wrappers.ranks import (
    check_model_ranks,
    check_zero3_split,
)
from .wrappers.step import WrapperStep

logger = logging.getLogger("hf_precision")


class PrecisionGuard:
    """One model under one policy.

    Args:
        model: the model (a wrapper around it is fine: PEFT, DDP, ``torch.compile``).
        policy: the :class:`PrecisionPolicy` to enforce.
        name: the front end, for messages (``"PrecisionGuardCallback"``).
        call: the user's own call, repeated in errors (``"PrecisionGuardCallback('bf16')"``).
        owner: who claims the model (two front ends with different policies on one model
            raise); defaults to the guard.
        groups: the model's groups, when the front end found them already.
        reporter: a :class:`~hf_precision.report.reporter.PrecisionReporter`, or ``None``.
        deepspeed_dtype: the dtype a DeepSpeed config holds the model in, when one is used.
        deepspeed_stage: its ZeRO stage; under ZeRO-3 in a half dtype trainable weights in that
            dtype are left as they are (rule ``wrapper_master_fp32``).
        claim: mark the model as held by ``owner`` (a second live guard with another policy
            raises); off for one-shot front ends that run no later events.
        origin: where the policy came from, for the console line (``"from bf16: true"``).
    """

    def __init__(
        self,
        model: nn.Module,
        policy: PrecisionPolicy,
        *,
        name: str = "PrecisionGuard",
        call: str | None = None,
        owner: object = None,
        groups: ModuleGroups | None = None,
        reporter: Any = None,
        deepspeed_dtype: torch.dtype | None = None,
        deepspeed_stage: int | None = None,
        claim: bool = True,
        origin: str | None = None,
    ) -> None:
        self.model = model
        self.root, _ = unwrap_model(model)
        self.policy = policy
        self.name = name
        self.call = call or f"{name}({policy.name!r})"
        self.owner = self if owner is None else owner
        self.groups = groups if groups is not None else find_module_groups(self.root)
        self.reporter = reporter
        self.deepspeed_dtype = deepspeed_dtype
        self.deepspeed_stage = deepspeed_stage
        #: where the policy came from, in the user's words (``from TrainingArguments(bf16=True)``)
        self.origin = origin
        self.handle: GuardHandle | None = None
        self.last_report: EnforceReport | None = None
        self.events: list[tuple[str, int]] = []  # (event, violations found)
        #: parameters and their dtypes after the last verify (a cheap drift check compares them)
        self.params: tuple[torch.Tensor, ...] = ()
        self.dtypes: tuple[torch.dtype, ...] = ()
        #: what this engine said on the console (each warning once)
        self.speaker = Speaker()
        #: the wrapper around the model: DDP's wrap-time dtypes, FSDP2's output bridges
        self.wrapper_step = WrapperStep(name, self.speaker)
        #: hears of the first input each kind of guard casts at run time (said once per kind)
        self.notice = Notice(self._bridged)
        self._stash: dict[str, torch.Tensor] = {}
        self._unwrapped: tuple[nn.Module, nn.Module, str] | None = None
        #: who asked for fp8 (``"Accelerator(mixed_precision='fp8')"``), ``None`` when nobody did
        self.fp8_requested: str | None = None
        #: extra sections of every event's JSON: ``memory`` (the setup's account), ``provenance``
        #: (who chose the precision), ``lost_updates`` (the first optimizer steps), ``hooks``
        #: (the guards installed on the model at the event, by kind), ``fp8`` (the manifest),
        #: ``compute`` (what ran at the first forward after the last event)
        self.sections: dict[str, Any] = {}
        #: what each part computed in at the first forward after an event (``watch/what_ran``)
        self.ran = WhatRan(self)
        if claim:
            claim_model(self.root, self.owner, policy, self.call)

    # ------------------------------------------------------------------ the pipeline
    def verify(
        self,
        event: str,
        *,
        model: nn.Module | None = None,
        wrapper: str | None = None,
        args: Any = None,
        optimizer: Any = None,
        step: int = 0,
        check_ranks: bool = False,
        log_clean: bool = True,
    ) -> EnforceReport:
        """Plan, explain a wrapper, apply, guard, report (see the module docstring).

        ``model`` is the object the front end holds now (a wrapper made after setup);
        ``wrapper`` who holds its parameters (``None``, ``"DDP"``, ``"FSDP"``, ``"FSDP2"``,
        ``"DeepSpeed"``), or ``"auto"``: detected from the model (and the wrapper ``args``, a
        ``TrainingArguments``, says it will add). ``log_clean=False`` reports only events that
        found something.
        """
        first = not self.events
        try:
            return self._verify(
                event, model, wrapper, args, optimizer, step, check_ranks, log_clean
            )
        except BaseException:
            # a guard whose first event failed guards nothing: free the model for the next one.
            # Hooks are one set per module, whoever installed them: take them off only when this
            # event got as far as installing them, else they are a set-up guard's.
            if first:
                if self.handle is not None:
                    remove_guards(self.model)
                    self.handle = None
                release_model(self.root, self.owner)
            raise

    def _verify(
        self,
        event: str,
        model: nn.Module | None,
        wrapper: str | None,
        args: Any,
        optimizer: Any,
        step: int,
        check_ranks: bool,
        log_clean: bool,
    ) -> EnforceReport:
        if model is not None:
            self.model = model
        model, policy, where = self.model, self._renamed(self.policy), f"{self.name}.{event}"
        first = not self.events
        read_deferred()  # overflows the guards' casts clamped since the last event, said now
        view = self._view(model)  # the event's one check, unwrap and walk: every step reads it
        check_zero3_split(view, where, policy.mode)
        if wrapper == "auto":
            wrapper = detect_wrapper(model, args=args, modules=view.every_module())
        kind = wrapper_kind(wrapper) or WrapperKind("none")
        if kind.reshards:  # FSDP2 keeps the root unsharded after forward: read shards
            settle_shards(model, view.every_module())
        view = fp8_event(self, view, policy, where)
        fp8_gates(view, where, policy.mode, functools.partial(self.emit, step=step))
        plan = plan_policy(view, policy, master_fp32=self.master_fp32(view))
        audit = apply_plan(plan, "audit")
        # built under deepspeed.zero.Init, no engine yet: the plan left the partitions
        # (DeepSpeed's) alone; what is not partitioned yet is cast like any weight
        held = wrapper in HOLDING_WRAPPERS and not (
            kind.partitions_at_build and first and _zero_init_only(view, event, policy.mode)
        )
        run = self.wrapper_step.run  # explain what a holding wrapper did, else apply the plan
        report, found = run(plan, audit, wrapper, self, held, optimizer, where)
        self.speaker.event(self, where, audit, report, found, first=first, held=held)
        self._account(report, view, first=first)
        self.last_report = report
        self.handle = guards_on(view, policy, report, notice=self.notice)
        self.sections["hooks"] = self.handle.counts()
        self._outside_reads(report, where, view)
        self.ran.arm(view, policy, event, step)
        self.params = tuple(view.parameters())
        self.dtypes = tuple(p.dtype for p in self.params)
        self.events.append((event, found))
        dmap = None
        if log_clean or found:  # a wrapper's choice kept (wrapper_master_fp32) is noted too
            dmap = self._log(
                event, view, policy, report if _noted(report, found) else None, step=step
            )
        if check_ranks:  # a collective: every rank reaches the same events
            check_model_ranks(model, self.groups, policy=policy, where=where, view=view, dmap=dmap)
        return report

    def _view(self, model: nn.Module) -> ModelView:
        """The event's :class:`ModelView` of ``model``, with the unwrap :meth:`holds` made for
        it just before when a front end asked."""
        kept, self._unwrapped = self._unwrapped, None
        unwrapped = kept[1:] if kept is not None and kept[0] is model else None
        return ModelView.of(model, self.groups, call=self.call, unwrapped=unwrapped)

    def _log(
        self, event: str, view: ModelView, policy: PrecisionPolicy, report: Any, *, step: int
    ) -> Any:
        """The reporter's files / W&B for this event (``report``: the event's findings, when it
        found any); its dtype map, the event's one, shared with the rank check."""
        if self.reporter is None:
            return None
        return self.reporter.log_event(
            event,
            view.model,
            step=step,
            policy=policy,
            groups=self.groups,
            report=report,
            view=view,
            sections=self.sections,
        )

    def holds(self, model: nn.Module) -> bool:
        """Whether ``model`` is this guard's model or a wrapper around it. A front end asks
        before its event's :meth:`verify` of the same ``model``, which then reuses this
        unwrap: one per event."""
        root, prefix = unwrap_model(model)
        self._unwrapped = (model, root, prefix)
        return root is self.root

    def master_fp32(self, view: ModelView | None = None) -> torch.dtype | None:
        """The half dtype DeepSpeed ZeRO-3 holds this run's trainable weights in, whose fp32
        master copies live in its optimizer (rule ``wrapper_master_fp32``), or ``None``
        (:func:`~hf_precision.rules.deepspeed_config.zero3_master_dtype`)."""
        params = view.parameters() if view is not None else self.root.parameters()
        return zero3_master_dtype(self.deepspeed_dtype, self.deepspeed_stage, params)

    def _outside_reads(self, report: EnforceReport, where: str, view: ModelView) -> None:
        """Weights read outside their module: in the report; a fused LM head also on the
        console, once, and checked before each forward where its kernel does not cast."""
        walk = ((path, mod) for path, _, mod in view.modules)
        report.outside_reads = find_outside_reads(view.root, walk)
        if self.policy.mode != "audit":
            install_fused_head_check(view.root, report.outside_reads)
        self.speaker.fused_heads(report.outside_reads, where, report_dir_of(self.reporter))

    def _renamed(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        """``policy`` in the groups' names now (:func:`renamed_policy`), said once."""
        renamed, said = renamed_policy(policy, self.groups, self.call, type(self.root).__name__)
        if said is not None:
            self.speaker.once(said)
        return renamed

    def drifted(self) -> bool:
        """Whether any parameter changed dtype since the last verify (one read per tensor)."""
        return tuple(p.dtype for p in self.params) != self.dtypes

    def mark_wrapped(self, model: nn.Module) -> None:
        """Remember the dtypes a DDP wrapper built its gradient buckets for."""
        self.model = model
        self.wrapper_step.mark(model)

    # ------------------------------------------------------------------ steps
    def _account(self, report: EnforceReport, view: ModelView, *, first: bool) -> None:
        """The setup's memory account (every later event's JSON carries it); said on the
        console with the setup's cast line."""
        if not first:
            return
        self.sections["memory"] = memory_account(
            report, self.root, stash_bytes=self.stash_bytes, view=view
        )
        if report.applied and report.changes:
            logger.warning(account_line(self.sections["memory"]))

    @property
    def stash_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._stash.values())

    def emit(self, finding: Finding, *, step: int = 0) -> None:
        """A watcher's :class:`~hf_precision.watch.finding.Finding` through this engine's
        speaker and reporter (:func:`~hf_precision.watch.finding.emit`)."""
        emit(finding, speaker=self.speaker, reporter=self.reporter, step=step)

    def _bridged(self, kind: str, path: str, what: str, src: torch.dtype, dst: torch.dtype) -> None:
        """A guard cast an input at run time (called once per kind by the hooks)."""
        cast = bool(self.events) and self.events[0][1] > 0
        at = report_dir_of(self.reporter)
        self.speaker.bridged(kind, path, what, src, dst, cast=cast, report_dir=at)

    def stash(self, eval_dtype: torch.dtype | None, limit_bytes: int) -> None:
        """Keep CPU copies of what an in-place ``model.to(eval_dtype)`` (``*_full_eval``) would
        round, to give their exact values back after: every floating parameter and buffer not
        already in ``eval_dtype``, most precious first (trainable weights, then what the policy
        keeps in float32, then the other frozen tensors), as many as ``limit_bytes`` holds. What
        does not fit is said in one warning: those tensors come back in their dtype with
        rounded values."""
        if eval_dtype is None:
            return
        # what the last plan kept in fp32 (rotary tables by module, deliberate fp32 norms)
        kept = {k[0] for k in self.last_report.kept} if self.last_report is not None else set()
        self._stash, said = stash_tensors(self.root, self.policy, kept, eval_dtype, limit_bytes)
        if "memory" in self.sections:
            self.sections["memory"]["stash_host_bytes"] = self.stash_bytes
        if said is not None:
            warnings.warn(said, PrecisionWarning, stacklevel=3)

    def restore(self) -> int:
        """Give stashed tensors their exact values (and dtypes) back where their dtype changed:
        after a ``*_full_eval`` evaluation, what :meth:`stash` kept is bit for bit as before."""
        return restore_values(self.root, self._stash) if self._stash else 0

    def teardown(self) -> None:
        """Take the guards off and release the model."""
        remove_guards(self.model)  # the fp8 shape gate's hooks too
        self.wrapper_step.teardown()
        self.ran.remove()
        release_model(self.root, self.owner)

    def __repr__(self) -> str:
        return f"PrecisionGuard({self.policy.describe()}, rule={self.groups.rule!r})"

    def configure(self, **fields: Any) -> None:
        """What a front end learns after it built the engine, said before an event: ``policy``
        (a :class:`PrecisionPolicy`; a restored checkpoint's), ``reporter``, ``deepspeed_dtype``,
        ``deepspeed_stage``, ``origin`` (the constructor's meanings) and ``fp8_requested``
        (who asked for fp8: ``"ACCELERATE_MIXED_PRECISION=fp8"``). Another name, or a
        value of the wrong kind, raises :class:`TypeError` naming it."""
        kinds = _CONFIGURABLE
        for name, value in fields.items():
            if name not in kinds:
                raise TypeError(
                    f"{self.name}.configure({name}=...): no such field; one of {', '.join(kinds)}"
                )
            if not isinstance(value, kinds[name]):
                want = " or ".join(k.__name__ for k in kinds[name])
                raise TypeError(f"{self.name}.configure({name}={value!r}): expected {want}")
        for name, value in fields.items():
            setattr(self, name, value)


#: what :meth:`PrecisionGuard.configure` sets, and the kinds of value each takes
_CONFIGURABLE: dict[str, tuple[type, ...]] = {
    "policy": (PrecisionPolicy,),
    "reporter": (object,),
    "deepspeed_dtype": (torch.dtype, type(None)),
    "deepspeed_stage": (int, type(None)),
    "origin": (str, type(None)),
    "fp8_requested": (str, type(None)),
}


__all__ = ["PrecisionGuard"]


def _zero_init_only(view: ModelView, event: str, mode: str) -> bool:
    """A model partitioned in place by ``deepspeed.zero.Init`` (``ds_id``) at the guard's setup,
    before any engine wraps it (``on_init_end``, the plugin's ``setup``), in a mode that casts."""
    return (
        mode != "audit"
        and event in ("setup", "on_init_end")
        and type(view.model).__name__ != "DeepSpeedEngine"
        and any(hasattr(p, "ds_id") for p in view.parameters())
    )


def _noted(report: EnforceReport, found: int) -> bool:
    """Whether the event's JSON carries its report: tensors off the policy, or a wrapper's
    choice kept (``wrapper_master_fp32``), an output bridged, a weight read outside its module,
    a keep rule's tensors left as they are."""
    return bool(
        found
        or report.wrapper_casts
        or report.wrapper_findings
        or report.outside_reads
        or kept_as_is(report)
    )


def renamed_policy(
    policy: PrecisionPolicy, groups: ModuleGroups, call: str, model_type: str
) -> tuple[PrecisionPolicy, str | None]:
    """``policy`` with the former group names the model's rule renamed
    (:attr:`ModuleGroups.renamed`) said under their names now, and
    the warning that says so (``None`` when nothing was renamed)."""
    renamed = {
        old: new
        for old, new in groups.renamed.items()
        if old in policy.group_dtypes or old in policy.batch_key_groups.values()
    }
    if not renamed:
        return policy, None
    group_dtypes = dict(policy.group_dtypes)
    for old, new in renamed.items():
        if old in group_dtypes:
            group_dtypes.setdefault(new, group_dtypes[old])
            del group_dtypes[old]
    keys = {k: renamed.get(g, g) for k, g in policy.batch_key_groups.items()}
    said = ", ".join(f"{old!r} is {new!r}" for old, new in renamed.items())
    message = (
        f"{call}: under rule {groups.rule!r} ({model_type}) {said} "
        "now (the merger maps image features into the language model: the projector, as "
        "LLaMA-Factory, ms-swift and transformers call it); the policy's setting for the "
        "old name applies to it. Fix: name "
        + " and ".join(repr(n) for n in renamed.values())
        + " in group_dtypes."
    )
    return policy.replace(group_dtypes=group_dtypes, batch_key_groups=keys), message
