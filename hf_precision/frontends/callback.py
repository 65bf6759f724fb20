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

During the steps it holds a :class:`~hf_precision.frontends.steps.StepWatch` (the first step's
dtype trace, the non-finite blame, the lost-update check on the Trainer's optimizer). The other
models a Trainer runs (TRL's ``ref_model``, reward, value and teacher models) are found through
the adapter of the library the Trainer's class comes from (:data:`TRAINER_ADAPTERS`), each
guarded by its own engine with the callback's policy and reported as
``<step>-<event>.<name>.json``; TRL's RL trainers get their sampler-trainer check through
:data:`RL_ADAPTERS`.

>>> from hf_precision import PrecisionGuardCallback
>>> cb = PrecisionGuardCallback()            # policy inferred from TrainingArguments
>>> cb = PrecisionGuardCallback("bf16", mode="raise")
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings
import weakref
from types import FrameType
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..base.wrapper_kinds import unwrap_model
from ..engine.guard import PrecisionGuard
from ..engine.hooks import GuardHandle
from ..engine.lines import policy_origin
from ..engine.range_check import read_deferred
from ..engine.records import EnforceReport
from ..errors import PrecisionError, PrecisionWarning
from ..rules import flags
from ..rules.deepspeed_config import check_training_args, zero_stage
from ..rules.groups.module_groups import ModuleGroups
from ..rules.policy.fields import LeafGuards, Mode
from ..rules.policy.parse import refuse_fp16_trainables
from ..rules.policy.precision_policy import PrecisionPolicy
from ..watch.blame import BlameMode, NonFiniteBlame, check_mode
from ..watch.lost_updates import LostUpdates, check_option
from .frontend import GuardFrontEnd
from .steps import StepWatch

logger = logging.getLogger("hf_precision")

__all__ = [
    "RL_ADAPTERS",
    "RL_MODES",
    "STASH_LIMIT_BYTES",
    "TRAINER_ADAPTERS",
    "PrecisionGuardCallback",
    "check_rl",
    "find_trainer",
    "trainer_models",
    "trainer_watchers",
]

#: The most the CPU copies kept across a ``*_full_eval`` evaluation may hold (trainable weights
#: first, then what the policy keeps in float32, then other frozen tensors the in-place cast
#: rounds); what does not fit comes back rounded, said in one warning when the copies are made.
STASH_LIMIT_BYTES = 2 * 1024**3

#: Trainer adapters (as transformers' ``INTEGRATION_TO_CALLBACK``): the top-level package a
#: Trainer class comes from -> the module whose ``trainer_models(trainer, init_args)`` names the
#: other models that Trainer runs. Loaded only when a Trainer of that package is seen;
#: tests/frontends/test_callback.py checks every module here exists in
#: ``hf_precision/integrations/``.
TRAINER_ADAPTERS: dict[str, str] = {
    "trl": "hf_precision.integrations.trl_models",
}
#: RL adapters: the top-level package a Trainer class comes from -> the module whose
#: ``attach(trainer, guard, rl=...)`` checks its sampler against its trainer (the contract, the
#: match and the gap of the first generations); loaded only when a Trainer of that package is seen.
RL_ADAPTERS: dict[str, str] = {
    "trl": "hf_precision.integrations.trl_rl",
}
#: the callback's ``rl=`` values
RL_MODES = ("auto", "match", "measure", "off")


class PrecisionGuardCallback(GuardFrontEnd, TrainerCallback):
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
        blame_mode = check_mode(blame, call="PrecisionGuardCallback")
        if trace not in (True, False, "setup"):
            raise PrecisionError(
                f"PrecisionGuardCallback(trace={trace!r}): expected True, False or 'setup' "
                "(one forward recorded at the first training step)."
            )
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
        #: the per-step work: first-step trace, blame, lost-update check
        self.step_watch = StepWatch(
            blame=blame_mode,
            trace=bool(trace),
            lost_updates=check_option(lost_updates, call=self._call),
            speaker=lambda: self.guard.speaker if self.guard is not None else None,
            reporter=lambda: self.reporter,
        )
        self.rl = check_rl(rl, call=self._call)
        self.rl_watch: Any = None  # the RL trainer's watch (RL_ADAPTERS' attach)
        self.rl_watchers: Any = None  # sync integrity + attribution (integrations.trl_rl_watch)

    # what the step watch holds, under the names this callback always had (and GuardFrontEnd's)
    @property
    def trace(self) -> bool:
        return self.step_watch.trace

    @property
    def blame(self) -> NonFiniteBlame | None:
        """The blame of the current model (None before the first event)."""
        return self.step_watch.blames[0] if self.step_watch.blames else None

    @property
    def trace_result(self) -> Any:
        """The first training step's dtype trace (``trace=True``; None before it ends)."""
        return self.step_watch.trace_result

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
        self.step_watch.forget_models()
        self.step_watch.add_model(model, args=args)
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
        # the lost-update check on the Trainer's optimizer, once per model
        self.step_watch.watch_updates(self.guard, kwargs.get("optimizer"), args=args)
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
        self.step_watch.stop()
        if self.rl_watchers is not None:
            self.rl_watchers.remove()
            self.rl_watchers = None
        self._verify("on_train_end", args, state, kwargs)
        self._stash()

    # ------------------------------------------------------------------ steps
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step_watch.begin_step(kwargs.get("model"))  # the first step's trace

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step_watch.end_step(int(getattr(state, "global_step", 0) or 0))
        if getattr(control, "should_evaluate", False):
            self._verify("before_evaluate", args, state, kwargs)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        # auto: a non-finite loss/grad_norm arms the next step
        self.step_watch.observe(logs, step=int(getattr(state, "global_step", 0) or 0))
        read_deferred()  # the guards' clamped overflows, read where the Trainer reads the loss
        # events that waited for a tracker's writer (TensorBoard)
        flush = getattr(self.reporter, "flush_trackers", None)
        if flush is not None:
            flush()

    # ------------------------------------------------------------------ the Trainer
    def bind_trainer(self, trainer: Any) -> None:
        """The Trainer this callback serves, given directly (the launcher does, before
        ``Trainer.__init__`` runs); a callback added by hand finds it in the calling frames."""
        self._trainer = weakref.ref(trainer)  # no cycle keeps a finished Trainer alive

    def _served(self) -> Any:
        """The Trainer this callback serves (bound, else found in the calling frames): its
        trackers' callbacks are where the report's tracker events go."""
        return find_trainer(self, self._trainer() if self._trainer is not None else None)[0]

    def _watch_trainer(self, watching: Any, guard: PrecisionGuard | None) -> Any:
        """Put the library's watchers on the served Trainer once (``watching``: the ones put
        before, taken off when the Trainer or its model changed)."""
        trainer = self._served()
        if trainer is None or guard is None:
            return watching
        if watching is not None:
            if watching.trainer is trainer and watching.model is trainer.model:
                return watching
            watching.remove()
        return trainer_watchers(trainer, guard)

    def _verify_trainer_models(
        self, event: str, args: Any, guard: PrecisionGuard, *, step: int
    ) -> None:
        """The other models the Trainer runs (TRL's ``ref_model``, reward, value and teacher
        models) get this callback's policy, guards and report (``<step>-<event>.<name>.json``),
        each its own engine. They are found by the adapter of the library the Trainer's class
        comes from (:data:`TRAINER_ADAPTERS`, the module's ``trainer_models``)."""
        trainer, init_args = find_trainer(
            self, self._trainer() if self._trainer is not None else None
        )
        if trainer is None:
            return
        if event == "on_train_begin":
            self._attach_rl(trainer, guard)
        elif event == "on_train_end" and self.rl_watch is not None:
            self.rl_watch.close()  # fewer generations than watched: report those
            self.rl_watch = None
        for name, model in trainer_models(trainer, init_args).items():
            root, _ = unwrap_model(model)
            if root is guard.root:
                continue
            other = self.trainer_guards.get(name)
            if other is None or other.root is not root:
                other = self._new_guard(
                    model,
                    deepspeed_dtype=self._deepspeed_dtype,
                    deepspeed_stage=self._deepspeed_stage,
                )
                if self.write_reports:
                    from ..report.reporter import PrecisionReporter

                    other.configure(
                        reporter=PrecisionReporter.from_training_args(
                            args,
                            report_dir=self.report_dir,
                            report_to=self.report_to,
                            trainer=trainer,
                        )
                    )
                self.trainer_guards[name] = other
            other.verify(  # not the Trainer's wrapper: TRL prepares these in evaluation mode
                f"{event}.{name}",
                model=model,
                wrapper=None if event == "on_init_end" else "auto",
                step=step,
            )

    def _attach_rl(self, trainer: Any, guard: PrecisionGuard) -> None:
        """The RL adapter of the Trainer's library (:data:`RL_ADAPTERS`): the contract and the
        gap watch, once per Trainer (``rl="off"``: nothing)."""
        if self.rl == "off":
            return
        if self.rl_watch is not None:
            if self.rl_watch.trainer is trainer:
                return
            self.rl_watch.detach()
            self.rl_watch = None
        for name in _adapters(RL_ADAPTERS, trainer):
            self.rl_watch = importlib.import_module(name).attach(trainer, guard, rl=self.rl)
            return


def check_rl(value: str, *, call: str) -> str:
    if value not in RL_MODES:
        raise PrecisionError(
            f"{call}: rl={value!r} is not one of {', '.join(map(repr, RL_MODES))}. Fix: "
            "rl='auto' (contract, gap, and match in fix mode), 'match', 'measure' or 'off'."
        )
    return value


def _adapters(table: dict[str, str], trainer: Any) -> list[str]:
    """The modules ``table`` names for the libraries in the Trainer's class hierarchy, the
    Trainer's own class first (a LLaMA-Factory DPO trainer is a TRL DPOTrainer)."""
    libraries = dict.fromkeys(c.__module__.split(".")[0] for c in type(trainer).__mro__)
    return [table[library] for library in libraries if library in table]


def trainer_watchers(trainer: Any, guard: PrecisionGuard) -> Any:
    """The watchers the adapter of the Trainer's library puts on it (its ``watch_trainer``:
    TRL's RL trainers get the sync integrity and gap attribution watchers), or ``None``."""
    for name in _adapters(TRAINER_ADAPTERS, trainer):
        watch = getattr(importlib.import_module(name), "watch_trainer", None)
        if watch is not None:
            return watch(trainer, guard)
    return None


def find_trainer(callback: object, bound: Any = None) -> tuple[Any, dict[str, Any]]:
    """The Trainer whose event is running with ``callback`` among its callbacks (``bound``
    when the launcher bound it, else read from the calling frames: a callback is given the
    model, not the Trainer), and the arguments of its ``__init__`` while that runs (at
    ``on_init_end``: models a subclass stores only after ``Trainer.__init__`` returns)."""
    frame: FrameType | None = sys._getframe(1)
    trainer: Any = bound
    init_args: dict[str, Any] = {}
    for _ in range(64):
        if frame is None:
            break
        this = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if trainer is None:
            handler = getattr(this, "callback_handler", None)
            if callback in getattr(handler, "callbacks", ()):
                trainer = this
        if trainer is not None and this is trainer and frame.f_code.co_name == "__init__":
            # the outermost __init__ (the subclass's) is read last and wins
            init_args.update({k: v for k, v in frame.f_locals.items() if k != "self"})
        frame = frame.f_back
    return trainer, init_args


def trainer_models(trainer: Any, init_args: dict[str, Any]) -> dict[str, nn.Module]:
    """Ask the adapter of each library in the Trainer's class hierarchy (a LLaMA-Factory DPO
    trainer is a TRL DPOTrainer) for the other models it runs."""
    found: dict[str, nn.Module] = {}
    for name in _adapters(TRAINER_ADAPTERS, trainer):
        models = getattr(importlib.import_module(name), "trainer_models", None)
        if models is not None:
            found.update({k: v for k, v in models(trainer, init_args).items() if k not in found})
    return found
