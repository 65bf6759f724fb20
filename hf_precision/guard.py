"""``PrecisionGuard``: the one pipeline every front end runs at its events.

At each event (``setup``, ``on_train_begin``, ``after_evaluate``, ...) :meth:`PrecisionGuard.verify`
walks the same steps, in one direction (docs/architecture.md):

1. **plan** — :func:`~hf_precision.plan.plan_policy` on one :class:`~hf_precision.view.ModelView`
   (what ``enforce_policy(mode="audit")`` returns): what differs from the policy, nothing cast;
2. **wrapper** — if FSDP/FSDP2/DeepSpeed holds the parameters, explain what it does on purpose
   and raise for the rest (never cast); under DDP only a return to the wrap-time dtypes is cast;
3. **apply** — :func:`~hf_precision.enforce.apply_plan` when the plan is not empty (the one
   place that casts);
4. **guards** — install or update the batch, boundary and leaf hooks;
5. **report** — the reporter's files / W&B, then, where the front end asks, the ranks compared.

The front ends are adapters that decide *when* (their events) and *who holds the model*
(the wrapper): :class:`~hf_precision.callback.PrecisionGuardCallback` (``Trainer`` and its TRL
subclasses), :class:`~hf_precision.accelerate_plugin.PrecisionGuardPlugin` (accelerate loops)
and :func:`~hf_precision.diffusion.guard_diffusion` (one guard per pipeline component).

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

import copy
import logging
import os
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .distributed import check_model_ranks, check_wrapped, explain_wrapped
from .dtypes import dtype_name
from .enforce import EnforceReport, apply_plan, enforce_policy, restore_values
from .errors import PrecisionError, PrecisionWarning
from .fsdp2 import bridge_outputs, fsdp2_outputs
from .groups import ModuleGroups, find_module_groups
from .hooks import (
    GuardHandle,
    Notice,
    claim_model,
    install_guards,
    release_model,
    remove_guards,
)
from .keep_rules import model_keep_lists
from .memory_account import account_line, memory_account
from .outside_reads import find_outside_reads, install_fused_head_check
from .policy import (
    KEEP_RULES,
    LeafGuards,
    Mode,
    PrecisionPolicy,
    policy_call,
)
from .policy_spec import parse_policy
from .view import ModelView
from .wrappers import detect_wrapper, settle_shards, unwrap_model

logger = logging.getLogger("hf_precision")

#: Wrappers that own the parameters: the guard verifies and explains, never casts.
HOLDING_WRAPPERS = ("FSDP", "FSDP2", "DeepSpeed")
_MAX_LISTED = 8


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
        reporter: a :class:`~hf_precision.reporting.PrecisionReporter`, or ``None``.
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
        #: parameter dtypes when DDP wrapped the model (drift may only go back to them)
        self.wrap_dtypes: dict[int, torch.dtype] = {}
        self._said: set[str] = set()
        #: hears of the first input each kind of guard casts at run time (said once per kind)
        self.notice = Notice(self._bridged)
        self._wrapper_casts: set[str] = set()
        #: FSDP2 unit path -> the hooks that cast its outputs to its parent's compute dtype
        self._bridges: dict[str, list[RemovableHandle]] = {}
        self._stash: dict[str, torch.Tensor] = {}
        #: extra sections of every event's JSON: ``memory`` (the setup's account), ``provenance``
        #: (who chose the precision), ``lost_updates`` (the first optimizer steps)
        self.sections: dict[str, Any] = {}
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
        view = ModelView.of(model, self.groups)  # the one walk of the model for this event
        if wrapper == "auto":
            inner = [m for _, _, m in view.modules] if model is view.root else None
            wrapper = detect_wrapper(model, args=args, modules=inner)
        if wrapper == "FSDP2":
            settle_shards(model)  # FSDP2 keeps the root unsharded after forward: read shards
        audit = enforce_policy(
            model,
            policy,
            groups=self.groups,
            mode="audit",
            view=view,
            master_fp32=self.master_fp32(view),
        )
        report, found = audit, len(audit.changes)
        if wrapper in HOLDING_WRAPPERS:
            report, found = self._explain(model, wrapper, audit, where)
        elif audit.changes and policy.mode != "audit":
            if wrapper == "DDP":
                self._check_ddp_restore(audit, where)
            report = apply_plan(  # the audit's plan, not a second one
                model,
                audit,
                mode=policy.mode,
                optimizer=optimizer,
                allow_wrapped=wrapper is not None,
            )
        if wrapper == "FSDP2":
            report = self._fsdp2_outputs(model, report, where)
        self._say(where, audit, report, found, first=first, held=wrapper in HOLDING_WRAPPERS)
        self._account(report, first=first)
        self.last_report = report
        self.handle = install_guards(
            model, policy, report, groups=self.groups, view=view, notice=self.notice
        )
        self._outside_reads(report, where, view)
        self.params = tuple(view.parameters())
        self.dtypes = tuple(p.dtype for p in self.params)
        self.events.append((event, found))
        if self.reporter is not None and (log_clean or found):
            # a wrapper's choice kept (wrapper_master_fp32) is in the event's JSON too
            noted = (
                found
                or report.wrapper_casts
                or report.wrapper_findings
                or report.outside_reads
                or _kept_as_is(report)
            )
            self.reporter.log_event(
                event,
                model,
                step=step,
                policy=policy,
                groups=self.groups,
                report=report if noted else None,
                view=view,
                sections=self.sections,
            )
        if check_ranks:  # a collective: every rank reaches the same events
            check_model_ranks(model, self.groups, policy=policy, where=where)
        return report

    def master_fp32(self, view: ModelView | None = None) -> torch.dtype | None:
        """The half dtype DeepSpeed ZeRO-3 holds this run in, whose fp32 master copies live in
        its optimizer: trainable weights in it stay as they are (``wrapper_master_fp32``). The
        stage comes from the front end's config, or from the model (ZeRO-3 partitions in
        place: ``ds_id``)."""
        half = self.deepspeed_dtype
        if half not in (torch.bfloat16, torch.float16):
            return None
        if self.deepspeed_stage == 3:
            return half
        params = view.parameters() if view is not None else self.root.parameters()
        return half if any(hasattr(p, "ds_id") for p in params) else None

    def _outside_reads(self, report: EnforceReport, where: str, view: ModelView) -> None:
        """Weights read outside their module: in the report; a fused LM head also on the
        console, once, and checked before each forward where its kernel does not cast."""
        walk = ((path, mod) for path, _, mod in view.modules)
        report.outside_reads = find_outside_reads(view.root, walk)
        if self.policy.mode != "audit":
            install_fused_head_check(view.root, report.outside_reads)
        for read in report.outside_reads:
            if read.kind == "fused_head" and read.tensor not in self._said:
                self._said.add(read.tensor)
                logger.warning(f"{where}: {read.describe()}; report: {self._report_dir() or 'off'}")

    def _renamed(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        """``policy`` with the former group names the model's rule renamed
        (:attr:`~hf_precision.groups.ModuleGroups.renamed`) said under their names now, and a
        warning (once) that says so."""
        renamed = {
            old: new
            for old, new in self.groups.renamed.items()
            if old in policy.group_dtypes or old in policy.batch_key_groups.values()
        }
        if not renamed:
            return policy
        group_dtypes = dict(policy.group_dtypes)
        for old, new in renamed.items():
            if old in group_dtypes:
                group_dtypes.setdefault(new, group_dtypes[old])
                del group_dtypes[old]
        keys = {k: renamed.get(g, g) for k, g in policy.batch_key_groups.items()}
        said = ", ".join(f"{old!r} is {new!r}" for old, new in renamed.items())
        self._warn_once(
            f"{self.call}: under rule {self.groups.rule!r} ({type(self.root).__name__}) {said} "
            "now (the merger maps image features into the language model: the projector, as "
            "LLaMA-Factory, ms-swift and transformers call it); the policy's setting for the "
            "old name applies to it. Fix: name "
            + " and ".join(repr(n) for n in renamed.values())
            + " in group_dtypes."
        )
        return policy.replace(group_dtypes=group_dtypes, batch_key_groups=keys)

    def drifted(self) -> bool:
        """Whether any parameter changed dtype since the last verify (one read per tensor)."""
        return tuple(p.dtype for p in self.params) != self.dtypes

    def mark_wrapped(self, model: nn.Module) -> None:
        """Remember the dtypes a DDP wrapper built its gradient buckets for."""
        self.model = model
        self.wrap_dtypes = {id(p): p.dtype for p in model.parameters()}

    # ------------------------------------------------------------------ steps
    def _explain(
        self, model: nn.Module, wrapper: str, audit: EnforceReport, where: str
    ) -> tuple[EnforceReport, int]:
        policy = self.policy
        check = check_wrapped(
            model,
            policy,
            self.groups,
            wrapper=wrapper,
            deepspeed_dtype=self.deepspeed_dtype,
            master_fp32=self.master_fp32(),
        )
        for why, n in check.expected.items():
            logger.info("hf-precision %s: %d parameter(s) %s (expected)", where, n, why)
        for note in check.notes[:_MAX_LISTED]:
            self._warn_once(f"{where}: {note}")
        if check and policy.mode == "audit":
            warnings.warn(str(check.error(where, policy)), PrecisionWarning, stacklevel=3)
        kept = explain_wrapped(
            model, policy, self.groups, audit, where=where, wrapper=wrapper, check=check
        )
        casts = {c.name for c in kept.wrapper_casts}
        if casts and casts != self._wrapper_casts:  # once, not at every evaluation
            warnings.warn(kept.wrapper_note or "", PrecisionWarning, stacklevel=3)
        self._wrapper_casts = casts
        return kept, len(check.violations)

    def _fsdp2_outputs(self, model: nn.Module, report: EnforceReport, where: str) -> EnforceReport:
        """FSDP2's ``output_dtype`` (:mod:`hf_precision.fsdp2`): a half root output (the loss
        rounded) is said with the fix; a nested unit returning another dtype than its parent
        computes in is bridged by a forward hook on its outputs (once per unit) and said."""
        outputs = fsdp2_outputs(model)
        messages = outputs.messages(self.name)
        if not messages:
            return report
        for b in outputs.bridges:
            if b.unit not in self._bridges:
                self._bridges[b.unit] = bridge_outputs(model, [b])
        for message in messages:
            self._warn_once(message)
        report = copy.copy(report)
        report.wrapper_findings = [*report.wrapper_findings, *messages]
        return report

    def _check_ddp_restore(self, audit: EnforceReport, where: str) -> None:
        """DDP built its gradient buckets for the dtypes at wrapping time (or, when the guard
        did not see the wrapping, at its last verify): only going back to those is safe."""
        ref = self.wrap_dtypes or {id(p): d for p, d in zip(self.params, self.dtypes)}
        named = dict(self.root.named_parameters())
        bad = [
            c
            for c in audit.changes
            if c.kind == "param"
            and c.name in named
            and dtype_name(ref.get(id(named[c.name]), named[c.name].dtype)) != c.after
        ]
        if bad:
            raise PrecisionError(
                f"{where}: {len(bad)} parameter(s) would change dtype under DDP, whose gradient "
                "buckets were built for the dtypes at wrapping time:\n  "
                + "\n  ".join(c.describe() for c in bad[:_MAX_LISTED])
                + f"\nFix: let {self.name} cast before the model is wrapped (keep it in the "
                "callbacks / call guard.prepare before accelerator.prepare), or load the model "
                "in the policy's dtypes."
            )

    def _say(
        self,
        where: str,
        audit: EnforceReport,
        report: EnforceReport,
        found: int,
        *,
        first: bool,
        held: bool,
    ) -> None:
        policy = self.policy
        if first and report.applied and report.changes:
            logger.warning(cast_line(report, origin=self.origin, report_dir=self._report_dir()))
            grown = memory_line(report)
            if grown:
                logger.warning(grown)
        elif first and policy.mode == "audit" and audit.changes and not held:
            # audit mode: the same line, said as findings (nothing was cast), on the console
            line = cast_line(audit, origin=self.origin, report_dir=self._report_dir())
            logger.warning(
                f"hf-precision: audit found {len(audit.changes)} tensor(s) off the policy, "
                f"nothing cast (mode 'audit'); the policy would cast "
                + line.removeprefix("hf-precision: ")
            )
        elif first and not found and _kept_as_is(report):
            # nothing to cast, but a wrapper's choice was kept: said once, at setup
            logger.warning(
                f"hf-precision: nothing cast; {kept_words(report)}; policy {policy.describe()}; "
                f"report: {self._report_dir() or 'off (report=False)'}"
            )
        elif found:  # later events: the model drifted from the policy
            verb = "repaired" if policy.mode == "fix" and not held else "found"
            example = f", e.g. {audit.changes[0].describe()}" if audit.changes else ""
            warnings.warn(
                f"{where}: dtype drift {verb}: {found} tensor(s) did not match "
                f"{policy.describe()}{example}; report: {self._report_dir() or 'off'}",
                PrecisionWarning,
                stacklevel=4,
            )
        if not report.applied:  # enforce_policy said the warnings of what it applied
            for w in report.warnings:
                self._warn_once(w)

    def _account(self, report: EnforceReport, *, first: bool) -> None:
        """The setup's memory account (every later event's JSON carries it); said on the
        console with the setup's cast line."""
        if not first:
            return
        self.sections["memory"] = memory_account(report, self.root, stash_bytes=self.stash_bytes)
        if report.applied and report.changes:
            logger.warning(account_line(self.sections["memory"]))

    @property
    def stash_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._stash.values())

    def log_sections(self, event: str, *, step: int) -> None:
        """Write an event that carries :attr:`sections` without planning or casting anything
        (the lost-update check's result, mid-training)."""
        if self.reporter is not None:
            policy = self._renamed(self.policy)
            self.reporter.log_event(
                event,
                self.model,
                step=step,
                policy=policy,
                groups=self.groups,
                sections=self.sections,
            )

    def _report_dir(self) -> str | None:
        path = getattr(self.reporter, "report_dir", None)
        return f"{os.fspath(path).rstrip(os.sep)}{os.sep}" if path is not None else None

    def _bridged(self, kind: str, path: str, what: str, src: torch.dtype, dst: torch.dtype) -> None:
        """A guard cast an input at run time (called once per kind by the hooks)."""
        cast = bool(self.events) and self.events[0][1] > 0
        how = (
            "the guard cast weights at setup and its hooks bridge the rest"
            if cast
            else "nothing in the model was cast: its hooks alone keep this run going"
        )
        where = f" at {path}" if path else ""
        logger.warning(
            "hf-precision: the %s guard%s casts %s %s → %s (said once per guard kind); %s; "
            "report: %s",
            kind,
            where,
            what,
            dtype_name(src),
            dtype_name(dst),
            how,
            self._report_dir() or "off",
        )

    def _warn_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            warnings.warn(message, PrecisionWarning, stacklevel=4)

    # ------------------------------------------------------------------ full-precision eval
    def stash(self, eval_dtype: torch.dtype | None, limit_bytes: int) -> None:
        """Keep CPU copies of what an in-place ``model.to(eval_dtype)`` (``*_full_eval``) would
        round, to give their exact values back after: every floating parameter and buffer not
        already in ``eval_dtype``, most precious first (trainable weights, then what the policy
        keeps in float32, then the other frozen tensors), as many as ``limit_bytes`` holds. What
        does not fit is said in one warning: those tensors come back in their dtype with
        rounded values."""
        if eval_dtype is None:
            return
        model_keep, strict = model_keep_lists(self.root)
        # what the last plan kept in fp32 (rotary tables by module, deliberate fp32 norms)
        kept = {k[0] for k in self.last_report.kept} if self.last_report is not None else set()
        tiers: tuple[list[tuple[str, torch.Tensor]], ...] = ([], [], [])
        for kind, named in (
            ("param", self.root.named_parameters()),
            ("buffer", self.root.named_buffers()),
        ):
            for name, t in named:
                if not t.is_floating_point() or t.dtype == eval_dtype or t.device.type == "meta":
                    continue
                if kind == "param" and t.requires_grad:
                    tiers[0].append((name, t))
                elif name in kept or self.policy.keep_fp32_reason(
                    name,
                    is_buffer=kind == "buffer",
                    model_patterns=model_keep,
                    strict_patterns=strict,
                ):
                    tiers[1].append((name, t))
                else:
                    tiers[2].append((name, t))
        keep: dict[str, torch.Tensor] = {}
        left: list[tuple[str, int]] = [("", 0)] * 3  # per tier: (first name, bytes) left out
        counts = [0, 0, 0]
        total = 0
        for k, tier in enumerate(tiers):
            for name, t in tier:
                size = t.numel() * t.element_size()
                if total + size > limit_bytes:
                    counts[k] += 1
                    left[k] = (left[k][0] or name, left[k][1] + size)
                    continue
                keep[name] = t
                total += size
        self._stash = {k: v.detach().to("cpu", copy=True) for k, v in keep.items()}
        if "memory" in self.sections:
            self.sections["memory"]["stash_host_bytes"] = self.stash_bytes
        if any(counts):
            what = (
                "trainable weight(s)",
                "tensor(s) the policy keeps in float32",
                "frozen tensor(s)",
            )
            lost = "; ".join(
                f"{n} {what[k]} ({left[k][1] / 2**20:.0f} MiB, e.g. {left[k][0]})"
                for k, n in enumerate(counts)
                if n
            )
            ev = dtype_name(eval_dtype)
            warnings.warn(
                f"{ev}_full_eval casts the model to {ev} in place. The guard keeps exact copies "
                f"of {len(self._stash)} tensor(s) ({total / 2**20:.0f} MiB) to give their values "
                f"back after the evaluation, up to its {limit_bytes / 2**30:.1f} GiB limit; "
                f"these do not fit and come back in their dtype with {ev}-rounded values: "
                f"{lost}. Fix: drop {ev}_full_eval (evaluation then runs under autocast), "
                f"load the frozen weights in {ev}, or train LoRA.",
                PrecisionWarning,
                stacklevel=3,
            )

    def restore(self) -> int:
        """Give stashed tensors their exact values (and dtypes) back where their dtype changed:
        after a ``*_full_eval`` evaluation, what :meth:`stash` kept is bit for bit as before."""
        return restore_values(self.root, self._stash) if self._stash else 0

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        """Take the guards off and release the model."""
        remove_guards(self.model)
        for handles in self._bridges.values():
            for h in handles:
                h.remove()
        self._bridges = {}
        release_model(self.root, self.owner)

    def __repr__(self) -> str:
        return f"PrecisionGuard({self.policy.describe()}, rule={self.groups.rule!r})"


_HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}
#: how many tensor names the console line lists
_NAMED = 3
_RULE_WORDS = {
    "frozen": "frozen",
    "trainable": "trainable",
    "keep_trainable_fp32": "trainable kept fp32",
    "device": "moved",
}


def _why(reason: str) -> str:
    """A plan record's reason (the :class:`~hf_precision.policy.Decision`'s) in words."""
    return _RULE_WORDS.get(reason, reason)


def cast_line(report: EnforceReport, *, origin: str | None, report_dir: str | None) -> str:
    """The one console line for what a guard cast at setup: target dtypes with counts and the
    rule that decided each, the first names, where the policy came from, the report's path.

    ``hf-precision: 46 tensors → bfloat16 (frozen), 18 → float32 (trainable) in projector,
    language_model (e.g. ...); policy bf16 (...), inferred from TrainingArguments(bf16=True);
    report: out/precision/``
    """
    by_dtype: dict[str, dict[str, int]] = {}
    moved: dict[str, int] = {}
    for c in report.changes:
        if c.before == c.after:
            moved[c.device_after] = moved.get(c.device_after, 0) + 1
            continue
        rules = by_dtype.setdefault(c.after, {})
        rules[_why(c.reason)] = rules.get(_why(c.reason), 0) + 1
    parts = []
    for i, (dtype, rules) in enumerate(
        sorted(by_dtype.items(), key=lambda kv: -sum(kv[1].values()))
    ):
        n = sum(rules.values())
        ranked = sorted(rules.items(), key=lambda kv: -kv[1])
        why = ranked[0][0] if len(ranked) == 1 else ", ".join(f"{k} {v}" for k, v in ranked)
        parts.append(f"{n}{' tensors' if i == 0 else ''} → {dtype} ({why})")
    parts += [f"{n} moved to {dev}" for dev, n in moved.items()]
    held = kept_words(report)
    touched = {c.group for c in report.changes}
    order = [g for g in report.groups.names if g in touched]  # forward order, then the rest
    groups = ", ".join(order + sorted(touched - set(order)))
    named = [f"{c.name} {c.before} → {c.after}" for c in report.changes[:_NAMED]]
    more = len(report.changes) - len(named)
    names = "; ".join(named) + (f"; and {more} more" if more > 0 else "")
    source = f", {origin}" if origin else ""
    return (
        f"hf-precision: {', '.join(parts)} in {groups} (e.g. {names}); "
        + (f"{held}; " if held else "")
        + "policy "
        f"{report.policy.describe()}{source}; report: {report_dir or 'off (report=False)'}"
    )


def _kept_as_is(report: EnforceReport) -> bool:
    """A rule kept a tensor in its own (half) dtype on purpose (``wrapper_master_fp32``)."""
    return any(k[2] not in KEEP_RULES for k in report.kept)


def kept_words(report: EnforceReport) -> str:
    """What keep rules held on purpose, for the console: ``kept in float32 on purpose: 4
    (deliberate_fp32); kept in their dtype on purpose: 8 (wrapper_master_fp32)``; ``""`` for
    none. Rotary tables (every model has them) are in the report, not on the console."""
    by_rule: dict[str, int] = {}
    for _, _, rule, _ in report.kept:
        if rule != "rotary":
            by_rule[rule] = by_rule.get(rule, 0) + 1
    parts = []
    for words, rules in (
        ("kept in float32 on purpose", {r: n for r, n in by_rule.items() if r in KEEP_RULES}),
        (
            "kept in their dtype on purpose",
            {r: n for r, n in by_rule.items() if r not in KEEP_RULES},
        ),
    ):
        if rules:
            ranked = sorted(rules.items(), key=lambda kv: -kv[1])
            parts.append(f"{words}: " + ", ".join(f"{n} ({rule})" for rule, n in ranked))
    return "; ".join(parts)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def memory_line(report: EnforceReport) -> str | None:
    """Bytes before → after per group where the setup upcast weights (the memory a user of
    PEFT's ``print_trainable_parameters()`` watches), with the rules that decided; ``None``
    when no weight grew."""
    before: dict[str, int] = {}
    after: dict[str, int] = {}
    rules: dict[str, int] = {}
    for item in report.planned:
        t, change = item.tensor, item.change
        was = getattr(torch, change.before, None)  # the tensor may hold its new data already
        if not isinstance(was, torch.dtype):
            continue
        size, new = _itemsize(was), _itemsize(item.dtype)
        if change.kind != "param" or new <= size:
            continue
        before[change.group] = before.get(change.group, 0) + t.numel() * size
        after[change.group] = after.get(change.group, 0) + t.numel() * new
        rules[_why(change.reason)] = rules.get(_why(change.reason), 0) + 1
    if not before:
        return None
    from .tables import fmt_bytes

    listed = ", ".join(
        f"{g} {fmt_bytes(before[g])} → {fmt_bytes(after[g])}" for g in sorted(before)
    )
    why = ", ".join(f"{k} {v}" for k, v in sorted(rules.items(), key=lambda kv: -kv[1]))
    return (
        f"hf-precision: upcast weights take more memory: {listed} "
        f"({sum(rules.values())} weights; rule: {why})"
    )


def flag_conflict(
    policy: PrecisionPolicy,
    flag: str | None,
    *,
    call: str,
    said: str,
    runner: str,
    owner: str,
    words: Any,
) -> PrecisionError | str | None:
    """What a mixed-precision flag (``"bf16"``/``"fp16"``, ``None``: no flag) and an explicit
    policy make together, checked before anything is cast: a :class:`PrecisionError` when they
    cannot run together (a half dtype of the policy is not the one autocast computes in: the
    two meet in every op autocast promotes), a warning text when it runs but is not what either
    says (fp32 weights under autocast), else ``None``.

    ``call`` is the user's call, ``said`` how the user set the flag (``bf16: true``), ``runner``
    who autocasts (``the Trainer``), ``owner`` the front end's name and ``words(flag, value)``
    the flag in the user's tool (:func:`hf_precision.flags.flag`).
    """
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(flag or "")
    if autocast is None:
        return None
    held = (policy.compute_dtype, policy.frozen_dtype, policy.trainable_dtype)
    halves = {d for d in (*held, *policy.group_dtypes.values()) if d in _HALF}
    other = sorted(halves - {autocast}, key=str)
    follow = f"{owner}() (it follows {said}), or {owner}({flag!r})"
    if other:
        theirs = other[0]
        return PrecisionError(
            f"{call} with {said}: {runner} autocasts to {dtype_name(autocast)}, but the policy "
            f"holds weights in {dtype_name(theirs)} ({policy.describe()}). {dtype_name(theirs)} "
            f"weights under {dtype_name(autocast)} autocast fail in the first op that mixes "
            "them ('RuntimeError: Unexpected floating ScalarType in "
            "at::autocast::prioritize', 'expected scalar type'). Nothing was cast.\n"
            f"Fix: {follow}, or train in {dtype_name(theirs)}: "
            f"{words(_HALF[theirs], True)} instead of {said}."
        )
    if policy.compute_dtype != autocast:
        return (
            f"{call} with {said}: {runner} autocasts to {dtype_name(autocast)}, but the policy "
            f"keeps weights in {dtype_name(policy.compute_dtype)} ({policy.describe()}): it "
            f"runs, with {dtype_name(policy.compute_dtype)} memory for weights that compute in "
            f"{dtype_name(autocast)}. Fix: {follow}, or {words(flag, False)} to train in "
            f"{dtype_name(policy.compute_dtype)}."
        )
    return None


def policy_origin(policy: PrecisionPolicy, inferred: bool, said: str, call: str) -> str:
    """Where a front end's policy came from, in the user's words: the flag it follows
    (``said``), the no-flag rule, or the user's own ``call``."""
    if not inferred:
        return f"as given: {call}"
    if said:
        return f"inferred from {said}"
    return (
        f"no precision flag: frozen weights follow the language model's "
        f"{dtype_name(policy.group_dtype('language_model'))}, trainable weights keep the "
        "dtype they were "
        "loaded in"
    )


class GuardFrontEnd:
    """What the front ends share: the user's policy argument, checked when they are built (a
    bad preset fails at the call, not at train time), with its ``mode``/``leaf_guards``
    overrides, and the user's own call for messages. Subclasses run :class:`PrecisionGuard`."""

    policy: PrecisionPolicy | None
    _reporter: Any  # the front end's PrecisionReporter (or None), made when it knows where

    def _init_policy(
        self,
        name: str,
        policy: PrecisionPolicy | str | None,
        *,
        mode: Mode | None,
        leaf_guards: LeafGuards | None,
    ) -> None:
        self._name, self._policy_arg = name, policy
        self._mode, self._leaf_guards = mode, leaf_guards
        self._call = policy_call(name, policy, mode=mode, leaf_guards=leaf_guards)
        # nothing the caller passed in changes (a policy is a value)
        given = self._with_overrides(parse_policy(policy, call=self._call))
        self.policy = None if policy is None else given

    def _check_flag(
        self, flag: str | None, *, said: str, runner: str, words: Any, stacklevel: int
    ) -> None:
        """The user's explicit policy against the run's mixed-precision flag, before anything
        is cast (:func:`flag_conflict`): refused with a :class:`PrecisionError`, or a warning
        when it runs but not as asked."""
        if self._policy_arg is None or self.policy is None:
            return  # an inferred policy follows the flags
        conflict = flag_conflict(
            self.policy,
            flag,
            call=self._call,
            said=said,
            runner=runner,
            owner=self._name,
            words=words,
        )
        if isinstance(conflict, PrecisionError):
            raise conflict
        if conflict:
            warnings.warn(conflict, PrecisionWarning, stacklevel=stacklevel + 1)

    def _new_guard(self, model: nn.Module, **kwargs: Any) -> PrecisionGuard:
        """The engine for ``model``, owned by this front end, speaking in its user's call and
        reporting through its reporter."""
        assert self.policy is not None
        return PrecisionGuard(
            model,
            self.policy,
            name=self._name,
            call=self._call,
            owner=self,
            reporter=self._reporter,
            **kwargs,
        )

    def _with_overrides(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        return parse_policy(policy, call=self._call, mode=self._mode, leaf_guards=self._leaf_guards)


__all__ = [
    "HOLDING_WRAPPERS",
    "GuardFrontEnd",
    "PrecisionGuard",
    "cast_line",
    "flag_conflict",
    "kept_words",
    "memory_line",
    "policy_origin",
]
