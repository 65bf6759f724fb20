"""``PrecisionGuardCallback``: one line in ``Trainer(callbacks=[...])``.

Lifecycle (docs/architecture.md):

* ``on_init_end`` — before the optimizer and ``accelerator.prepare`` exist: check the flags
  against the policy (one they cannot run raises :class:`PrecisionError` with nothing cast),
  enforce the policy (the safest moment to cast) and install the guards;
* ``on_train_begin`` — verify; repair only when no DDP/FSDP/DeepSpeed wrapper holds the
  parameters, otherwise raise a :class:`PrecisionError` that says what to do (this is also where
  a callback added with ``trainer.add_callback`` does its first enforcement);
* before every in-training evaluation (``on_step_end`` with ``control.should_evaluate``) and after
  every evaluation/prediction (``on_evaluate``, ``on_predict``) — verify and repair drift, e.g. the
  in-place ``model.to(bf16)`` of ``bf16_full_eval``, which never casts back.

>>> from hf_precision import PrecisionGuardCallback
>>> cb = PrecisionGuardCallback()            # policy inferred from TrainingArguments
>>> cb = PrecisionGuardCallback("bf16", mode="raise")
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..base.wrapper_kinds import unwrap_model
from ..engine.guard import PrecisionGuard
from ..engine.hooks import GuardHandle
from ..engine.lines import policy_origin
from ..engine.records import EnforceReport
from ..errors import PrecisionError, PrecisionWarning
from ..rules import flags
from ..rules.deepspeed_config import check_training_args, zero_stage
from ..rules.groups.module_groups import ModuleGroups
from ..rules.policy.fields import LeafGuards, Mode
from ..rules.policy.parse import refuse_fp16_trainables
from ..rules.policy.precision_policy import PrecisionPolicy
from ..watch.blame import BlameMode, NonFiniteBlame, check_mode
from ..watch.lost_updates import LostUpdateCheck, LostUpdates, check_option
from .callback_steps import CallbackSteps
from .trainer_adapters import TrainerModels, check_rl, find_trainer, trainer_models

logger = logging.getLogger("hf_precision")

#: the old private names of :mod:`.trainer_adapters`'s functions
_find_trainer, _trainer_models = find_trainer, trainer_models

#: The most the CPU copies kept across a ``*_full_eval`` evaluation may hold (trainable weights
#: first, then what the policy keeps in float32, then other frozen tensors the in-place cast
#: rounds); what does not fit comes back rounded, said in one warning when the copies are made.
STASH_LIMIT_BYTES = 2 * 1024**3


class PrecisionGuardCallback(CallbackSteps, TrainerModels, TrainerCallback):
    """Enforce one precision policy across training, evaluation, prediction and generation.

    Args:
        policy: a :class:`PrecisionPolicy`, a preset name (``"bf16"``, ``"fp16"``, …) or ``None``
            to infer it from ``TrainingArguments`` and the model as loaded.
        mode: override the policy's mode: ``"audit"`` (report only), ``"fix"``, ``"raise"``.
        leaf_guards: override the policy's ``leaf_guards`` (``"auto"``, ``"on"``, ``"off"``).
        report: write dtype maps (files always, W&B when ``"wandb"`` is in ``report_to``);
            ``False`` turns reporting off.
        report_dir: where the files go (default ``<output_dir>/precision``).
        report_to: the trackers to log to (default: ``TrainingArguments.report_to``).
        blame: who made the NaN (:mod:`hf_precision.watch.blame`): ``"auto"`` (default: no hook
            until a logged ``loss``/``grad_norm`` is non-finite, then the next step is
            inspected), ``"always"`` or ``"off"``.
        trace: record the first training step's forward, module by module, and report where
            the activation dtype changed (:mod:`hf_precision.watch.trace`; ``True`` or
            ``"setup"``).
        lost_updates: ``"auto"`` watches the first optimizer steps of half-precision trainable
            weights and warns when their updates round away (``hf_precision.watch.lost_updates``);
            ``"off"``.
        rl: on TRL's RL trainers (GRPO, RLOO, online DPO), the sampler-trainer contract and the
            gap of the first generations (:mod:`hf_precision.integrations.trl_rl`): ``"auto"``
            (default: in fix mode ``generate`` samples under the trainer's autocast, "match"),
            ``"match"``, ``"measure"`` (contract and gap, no match) or ``"off"``. Unless
            ``"off"``, the frozen weights are also checked around each weight sync and
            generation (a merge/unmerge round trip that drifts them; an in-place cast, whose
            dtypes are restored) and a gap past the threshold is attributed to a group
            (:mod:`hf_precision.integrations.trl_rl_watch`).

    >>> from transformers import Trainer  # doctest: +SKIP
    >>> Trainer(model=model, args=args, callbacks=[PrecisionGuardCallback()])  # doctest: +SKIP
    """

    def __init__(
        self,
        policy: PrecisionPolicy | str | None = None,
        *,
        mode: Mode | None = None,
        leaf_guards: LeafGuards | None = None,
        report: bool = True,
        report_dir: str | os.PathLike[str] | None = None,
        report_to: list[str] | str | None = None,
        blame: BlameMode = "auto",
        trace: bool | str = False,
        lost_updates: LostUpdates = "auto",
        keep_fp32: tuple[str, ...] | list[str] = (),
        rl: str = "auto",
    ) -> None:
        #: extra ``keep_fp32`` patterns added to the policy (given or inferred), as the
        #: launcher's ``--keep-fp32``
        self.extra_keep_fp32 = tuple(keep_fp32)
        self._init_policy("PrecisionGuardCallback", policy, mode=mode, leaf_guards=leaf_guards)
        self.blame_mode = check_mode(blame, call="PrecisionGuardCallback")
        if trace not in (True, False, "setup"):
            raise PrecisionError(
                f"PrecisionGuardCallback(trace={trace!r}): expected True, False or 'setup' "
                "(one forward recorded at the first training step)."
            )
        self.trace = bool(trace)
        #: the blame of the current model (None before the first event)
        self.blame: NonFiniteBlame | None = None
        self.trace_result: Any = None
        self._tracer: Any = None
        #: whether dtype maps are written (the ``report=`` argument)
        self.write_reports = report
        self.report_dir = report_dir
        self.report_to = report_to
        #: the engine for the model of the current Trainer (None before the first event)
        self.guard: PrecisionGuard | None = None
        self.restored = 0  # tensors given back their exact values after a *_full_eval cast
        #: the :class:`~hf_precision.report.reporter.PrecisionReporter` (None before the first
        # event)
        self.reporter: Any = None
        self._trainer: Any = None  # bound by bind_trainer (the launcher), else found in frames
        self._deepspeed_dtype: torch.dtype | None = None
        self._deepspeed_stage: int | None = None
        #: one engine per other model the Trainer runs (TRL's ref_model, reward models...)
        self.trainer_guards: dict[str, PrecisionGuard] = {}
        self.lost_updates = check_option(lost_updates, call=self._call)
        self._lost: LostUpdateCheck | None = None
        self.rl = check_rl(rl, call=self._call)
        self.rl_watch: Any = None  # the RL trainer's watch (trainer_adapters.TrainerModels)
        self.rl_watchers: Any = None  # sync integrity + attribution (integrations.trl_rl_watch)

    # what the engine knows, under the names this callback always had
    @property
    def groups(self) -> ModuleGroups | None:
        return self.guard.groups if self.guard is not None else None

    @property
    def handle(self) -> GuardHandle | None:
        return self.guard.handle if self.guard is not None else None

    @property
    def last_enforce_report(self) -> EnforceReport | None:
        """The plan of the last event (what was cast or found)."""
        return self.guard.last_report if self.guard is not None else None

    # the old names, kept as aliases
    @property
    def last_report(self) -> EnforceReport | None:
        return self.last_enforce_report

    @property
    def report(self) -> bool:
        return self.write_reports

    @property  # type: ignore[override]
    def _reporter(self) -> Any:
        return self.reporter

    @_reporter.setter
    def _reporter(self, value: Any) -> None:
        self.reporter = value

    def _with_overrides(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        policy = super()._with_overrides(policy)
        missing = tuple(p for p in self.extra_keep_fp32 if p not in policy.keep_fp32)
        return policy.replace(keep_fp32=(*policy.keep_fp32, *missing)) if missing else policy

    @property
    def events(self) -> list[tuple[str, int]]:
        """(event, number of violations found), for inspection."""
        return self.guard.events if self.guard is not None else []

    # ------------------------------------------------------------------ setup
    def _setup(self, args: Any, model: nn.Module | None) -> PrecisionGuard | None:
        if model is None:
            return None
        if self.guard is not None and self.guard.holds(model):  # its unwrap is the event's
            return self.guard
        root, _ = unwrap_model(model)
        first = self.guard is None
        if self._policy_arg is None:  # inferred: from this Trainer's arguments and model
            before = self.policy
            self.policy = self._with_overrides(PrecisionPolicy.from_training_args(args, root))
            if not first and before is not None and before != self.policy:
                warnings.warn(
                    f"{self._call} was used with another Trainer before: the policy is "
                    f"inferred again from this Trainer's arguments and model, "
                    f"{self.policy.describe()} (was {before.describe()}). Fix: give each "
                    "Trainer its own PrecisionGuardCallback() to silence this.",
                    PrecisionWarning,
                    stacklevel=3,
                )
            if not first:
                self.reporter = None  # this Trainer's output_dir and report_to
        elif self.policy is not None and self.policy.full_eval_dtype is None:
            from_flags = PrecisionPolicy.from_training_args(args)
            self.policy = self.policy.replace(full_eval_dtype=from_flags.full_eval_dtype)
        assert self.policy is not None
        if getattr(args, "cast_lm_head_to_fp32", False) and not self.policy.keep_fp32_head:
            self.policy = self.policy.replace(keep_fp32_head=True)  # TRL's fp32 lm_head, kept
        said = self._check_args(args, root)
        origin = policy_origin(self.policy, self._policy_arg is None, said, self._call)
        if self.write_reports and self.reporter is None:
            from ..report.reporter import PrecisionReporter

            self.reporter = PrecisionReporter.from_training_args(
                args, report_dir=self.report_dir, report_to=self.report_to, trainer=self._served()
            )
        self.guard = self._new_guard(
            model,
            deepspeed_dtype=self._deepspeed_dtype,
            deepspeed_stage=self._deepspeed_stage,
            origin=origin,
        )
        self.trainer_guards = {}
        if self.blame is not None:
            self.blame.disarm()
        self.blame = NonFiniteBlame(model, self.blame_mode, args=args)
        self._provenance(args, model)
        logger.info(
            "hf-precision: policy %s; groups by rule %r",
            self.policy.describe(),
            self.guard.groups.rule,
        )
        return self.guard

    def _check_args(self, args: Any, root: nn.Module) -> str:
        """The flags against the policy, before anything is cast: what cannot run together
        raises :class:`PrecisionError` here, with the fix in the user's tool's words. Returns
        the flag as the user set it (``bf16: true``), or ``""`` with no flag."""
        policy = self.policy
        assert policy is not None
        # the DeepSpeed JSON's bf16/fp16 sections vs --bf16/--fp16
        self._deepspeed_dtype = check_training_args(args)
        self._deepspeed_stage = zero_stage(args=args)
        flag = (
            "bf16"
            if getattr(args, "bf16", False)
            else "fp16"
            if getattr(args, "fp16", False)
            else None
        )

        def words(name: str, value: bool) -> str:
            return flags.flag(name, value, args=args)

        # what the user set, in their words: `--bf16` typed, or `bf16=True` in Python
        said = flags.set_flag(flag, True, args=args) if flag else ""
        self._check_flag(flag, said=said, runner="the Trainer", words=words, stacklevel=4)
        trainable = flag == "fp16" and any(p.requires_grad for p in root.parameters())
        fix = (
            "PrecisionGuardCallback('fp16') (trainable weights float32), or train in bfloat16 "
            f"with {words('bf16', True)}"
        )
        refuse_fp16_trainables(policy, flag, trainable, call=self._call, said=said, fix=fix)
        if flag == "fp16" and not torch.cuda.is_available():
            warnings.warn(
                f"{said} without a GPU: transformers runs no autocast and no GradScaler here; "
                "the guard keeps frozen weights fp16 and trainable weights fp32 and bridges "
                "the dtypes with its hooks.",
                PrecisionWarning,
                stacklevel=3,
            )
        return said

    # ------------------------------------------------------------------ events
    def _verify(
        self,
        event: str,
        args: Any,
        state: Any,
        kwargs: dict[str, Any],
        *,
        check_ranks: bool = False,
        restore: bool = False,
    ) -> None:
        model = kwargs.get("model")
        guard = self._setup(args, model)
        if guard is None:
            return
        if restore:  # a *_full_eval evaluation cast the model in place
            restored = guard.restore()
            self.restored += restored
            if restored:
                logger.info("hf-precision: restored %d tensor(s) rounded by *_full_eval", restored)
        guard.verify(
            event,
            model=model,
            wrapper=None if event == "on_init_end" else "auto",
            args=args,
            optimizer=kwargs.get("optimizer"),
            step=int(getattr(state, "global_step", 0) or 0),
            check_ranks=check_ranks,  # collective: every rank reaches these events
        )
        self._verify_trainer_models(
            event, args, guard, step=int(getattr(state, "global_step", 0) or 0)
        )

    def _provenance(self, args: Any, model: nn.Module) -> None:
        from ..watch.provenance import precision_provenance, provenance_finding, requested_fp8

        assert self.guard is not None
        found = self.guard.sections["provenance"] = precision_provenance(args, model)
        if found["notable"]:
            self.guard.emit(provenance_finding(found))
        fp8 = requested_fp8(found)  # asked for: the fp8 check says if nothing runs it, and who
        if fp8 is not None:
            self.guard.configure(fp8_requested=fp8)

    def _stash(self) -> None:
        if self.guard is not None and self.policy is not None:
            self.guard.stash(self.policy.full_eval_dtype, STASH_LIMIT_BYTES)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._verify("on_init_end", args, state, kwargs)
        self._stash()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # restore: a standalone evaluate() with *_full_eval ran before train()
        self._verify("on_train_begin", args, state, kwargs, check_ranks=True, restore=True)
        self._watch_updates(args, kwargs)
        if self.rl != "off":
            self.rl_watchers = self._watch_trainer(self.rl_watchers, self.guard)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._verify("on_evaluate", args, state, kwargs, check_ranks=True, restore=True)

    def on_predict(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
    ) -> None:
        self._verify("on_predict", args, state, kwargs, check_ranks=True, restore=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # load_best_model_at_end (or any end-of-train reload) brings weights back in the dtype
        # they were saved/loaded in: repair and report it like an evaluation
        if self.blame is not None:
            self.blame.disarm()
        if self._tracer is not None:
            self._tracer.remove()
            self._tracer = None
        if self.rl_watchers is not None:
            self.rl_watchers.remove()
            self.rl_watchers = None
        self._verify("on_train_end", args, state, kwargs)
        self._stash()
