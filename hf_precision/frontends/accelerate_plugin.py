"""``PrecisionGuardPlugin``: the precision guard for a plain accelerate loop, in two lines.

Accelerate has no plugin registry (a custom ``KwargsHandler`` fails with ``KeyError``), so the
guard is a plain object that wraps :meth:`accelerate.Accelerator.prepare` and uses accelerate's
real extension points::

    guard = PrecisionGuardPlugin()                                          # line 1
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)  # line 2

``guard.prepare`` takes and returns exactly what ``accelerator.prepare`` does. Around it:

* before wrapping: infer the policy (``accelerator.mixed_precision`` and the model), check a
  DeepSpeed config against it, cast with :func:`~hf_precision.enforce_policy`, install the guards
  (:func:`~hf_precision.install_guards`), wrap each DataLoader's ``collate_fn`` in
  :class:`~hf_precision.PrecisionCollator`, check that all ranks agree;
* after wrapping: verify (FSDP/DeepSpeed-owned parameters are never cast: FSDP's fp32 upcast of
  trainable weights is expected, anything else is explained in a :class:`PrecisionError`), check
  the ranks again, register a cheap dtype check before every optimizer step
  (``register_step_pre_hook``), ``accelerator.register_for_checkpointing(guard)`` and a
  ``precision_policy.json`` written beside each ``save_state`` checkpoint;
* at each optimizer step, besides the dtype check (the full verify runs only on a change), the
  plugin's :class:`~hf_precision.frontends.steps.StepWatch`: the non-finite blame (armed by
  :meth:`PrecisionGuardPlugin.observe`, on request, or by a step the GradScaler skipped) and the
  lost-update check on the first steps (its result is the ``lost_updates`` section and event);
* ``save_state`` stores :meth:`PrecisionGuardPlugin.state_dict` (the policy and the step),
  ``load_state`` restores it and verifies the models against it; :func:`policy_from_checkpoint`
  reads the ``precision_policy.json`` back;
* ``with guard.evaluating(model): ...`` verifies before and after an evaluation;
* dtype maps go to ``<project_dir>/precision/`` (main process only) and to W&B through
  ``accelerator.get_tracker("wandb")`` when ``log_with="wandb"``.

>>> from accelerate import Accelerator
>>> from hf_precision import PrecisionGuardPlugin
>>> from hf_precision.tiny import tiny_llava
>>> accelerator = Accelerator(cpu=True)
>>> guard = PrecisionGuardPlugin("fp32", report=False)
>>> model = guard.prepare(accelerator, tiny_llava())
>>> guard.policy.name
'fp32'
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..base.wrapper_kinds import unwrap_model
from ..engine.batch import PrecisionCollator
from ..engine.fp8.converters import feed_converters
from ..engine.guard import PrecisionGuard
from ..engine.lines import policy_origin
from ..engine.records import EnforceReport
from ..engine.wrappers.ranks import rank
from ..errors import PrecisionError, PrecisionWarning
from ..report.reporter import PrecisionReporter
from ..rules import flags
from ..rules.deepspeed_config import check_deepspeed_config, deepspeed_config_of, zero_stage
from ..rules.dtypes import dtype_name
from ..rules.policy.fields import LeafGuards, Mode
from ..rules.policy.parse import parse_policy, refuse_fp16_trainables
from ..rules.policy.precision_policy import PrecisionPolicy
from ..watch.blame import BlameMode, NonFinite, NonFiniteBlame, check_mode
from ..watch.lost_updates import LostUpdates, check_option
from .frontend import GuardFrontEnd
from .steps import StepWatch

logger = logging.getLogger("hf_precision")

__all__ = ["POLICY_FILE", "STATE_VERSION", "PrecisionGuardPlugin", "policy_from_checkpoint"]

#: Written beside every ``accelerator.save_state`` checkpoint (``PrecisionPolicy.from_json``).
POLICY_FILE = "precision_policy.json"
STATE_VERSION = 1


def policy_from_checkpoint(path: str | os.PathLike[str]) -> PrecisionPolicy:
    """The policy saved beside a checkpoint (``<path>/precision_policy.json``)."""
    file = Path(path) / POLICY_FILE if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise PrecisionError(
            f"policy_from_checkpoint({os.fspath(path)!r}): no {POLICY_FILE} "
            "there. Fix: pass a folder written by accelerator.save_state with "
            "a PrecisionGuardPlugin registered."
        )
    return parse_policy(file)


class PrecisionGuardPlugin(GuardFrontEnd):
    """Enforce one precision policy in a plain accelerate loop (and verify it under DDP, FSDP
    and DeepSpeed).

    Args:
        policy: a :class:`PrecisionPolicy`, a preset name or ``None`` to infer it from
            ``accelerator.mixed_precision`` (``bf16`` -> frozen bf16 / trainable fp32) and the
            model as loaded.
        mode: override the policy's mode: ``"audit"``, ``"fix"``, ``"raise"``.
        check_every: compare parameter dtypes before every N-th optimizer step (0: never).
        check_ranks: gather the ranks' dtype-map digests at prepare and after evaluations.
        leaf_guards: override the policy's ``leaf_guards`` (``"auto"``, ``"on"``, ``"off"``).
        report: write dtype maps (files, and W&B when the accelerator logs with wandb).
        report_dir: where the files go (default ``<project_dir or .>/precision``).
        blame: who made the NaN (:mod:`hf_precision.watch.blame`): ``"auto"`` (default: no hook
            until :meth:`observe` sees a non-finite loss or gradient norm, or the GradScaler
            skipped a step; then the next step is inspected), ``"always"`` or ``"off"``;
            :meth:`blame_next_step` arms it on request.
        lost_updates: ``"auto"`` watches the first optimizer steps of half-precision trainable
            weights and warns when their updates round away (``hf_precision.watch.lost_updates``);
            ``"off"``.
        keep_fp32: extra ``keep_fp32`` patterns added to the policy, given or inferred (the
            launcher's ``--keep-fp32``).

    >>> guard = PrecisionGuardPlugin("bf16", mode="raise")
    """

    #: the fix the lost-update warning gives (the launcher says it in its own flags)
    lost_updates_fix = (
        "Accelerator(mixed_precision='bf16') with PrecisionGuardPlugin('bf16') in mode 'fix' (its "
        "bf16 policy holds trainable weights in float32 and computes in bf16)"
    )

    def __init__(
        self,
        policy: PrecisionPolicy | str | None = None,
        *,
        mode: Mode | None = None,
        check_every: int = 1,
        check_ranks: bool = True,
        leaf_guards: LeafGuards | None = None,
        report: bool = True,
        report_dir: str | os.PathLike[str] | None = None,
        blame: BlameMode = "auto",
        lost_updates: LostUpdates = "auto",
        keep_fp32: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.extra_keep_fp32 = tuple(keep_fp32)
        blame_mode = check_mode(blame, call="PrecisionGuardPlugin")
        if not isinstance(check_every, int) or check_every < 0:
            raise PrecisionError(
                f"PrecisionGuardPlugin(check_every={check_every!r}): expected "
                "an int >= 0 (0 turns the optimizer-step check off)."
            )
        self._init_policy("PrecisionGuardPlugin", policy, mode=mode, leaf_guards=leaf_guards)
        self.report, self.report_dir = report, report_dir
        self.check_every, self.check_ranks = check_every, check_ranks
        self.steps = 0  # optimizer steps seen
        self.events: list[tuple[str, int]] = []  # (event, number of violations found)
        self.last_report: EnforceReport | None = None
        self.deepspeed_dtype: torch.dtype | None = None
        self.deepspeed_stage: int | None = None
        self._guarded: list[PrecisionGuard] = []  # one engine per model
        self._optimizers: list[Any] = []
        self._handles: list[Any] = []
        self._accelerator: Any = None
        self._reporter: Any = None
        self._inferred = policy is None  # where the policy came from, for the console line
        self._said = ""  # the accelerator's mixed precision as the user set it
        #: the flags an inferred policy follows in the user's tool's words, and the tool that
        #: spells them (:mod:`hf_precision.rules.flags`): a launcher that knows the tool sets
        #: them (``train_network.py's --mixed_precision bf16``, ``"kohya"``)
        self.said_as = ""
        self.tool: Any = "accelerate"
        #: extra sections for the events of every model this plugin guards (``provenance``)
        self.sections: dict[str, Any] = {}
        #: the per-step work: the blame of each guarded model, the lost-update check
        self.step_watch = StepWatch(
            blame=blame_mode,
            lost_updates=check_option(lost_updates, call=self._call),
            speaker=lambda: self._guarded[0].speaker if self._guarded else None,
            reporter=lambda: self._reporter,
        )

    # what the step watch holds, under the names this plugin always had (and GuardFrontEnd's)
    @property
    def blames(self) -> list[NonFiniteBlame]:
        """One blame per guarded model (:mod:`hf_precision.watch.blame`)."""
        return self.step_watch.blames

    @property
    def reporter(self) -> Any:
        """The :class:`~hf_precision.report.reporter.PrecisionReporter` the events write to
        (``None`` before :meth:`prepare`, or with ``report=False``); a launcher may set its own."""
        return self._reporter

    @reporter.setter
    def reporter(self, value: Any) -> None:
        self._reporter = value

    @property
    def guards(self) -> list[PrecisionGuard]:
        """The engines, one per guarded model (``sections`` holds each one's ``lost_updates``)."""
        return list(self._guarded)

    def _with_overrides(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        policy = super()._with_overrides(policy)
        missing = tuple(p for p in self.extra_keep_fp32 if p not in policy.keep_fp32)
        return policy.replace(keep_fp32=(*policy.keep_fp32, *missing)) if missing else policy

    # ------------------------------------------------------------------ accelerate
    def prepare(self, accelerator: Any, *objects: Any, **kwargs: Any) -> Any:
        """Guard the models among ``objects``, call ``accelerator.prepare(*objects, **kwargs)``
        and return its result unchanged (one object, or a tuple in the same order)."""
        models = [o for o in objects if isinstance(o, nn.Module)]
        if not models and not self._guarded:
            raise PrecisionError(
                "PrecisionGuardPlugin.prepare(accelerator, ...): no nn.Module among the objects, "
                "so there is nothing to guard. Fix: pass the model, e.g. "
                "guard.prepare(accelerator, model, optimizer, dataloader)."
            )
        self._bind(accelerator, models[0] if models else None)
        for m in models:
            self.setup(m)
        if str(getattr(accelerator, "mixed_precision", "no")) == "fp8":
            feed_converters(accelerator, models, self.policy)
            for g in self._guarded:
                g.configure(fp8_requested="Accelerator(mixed_precision='fp8')")
        objects = tuple(self._wrap_loader(o) for o in objects)
        result = accelerator.prepare(*objects, **kwargs)
        out = result if len(objects) > 1 else (result,)
        for before, after in zip(objects, out):
            if isinstance(before, nn.Module):
                self._entry(before).mark_wrapped(after)
                self.verify(after, "after_prepare")
            elif isinstance(after, torch.optim.Optimizer):  # AcceleratedOptimizer and kin
                self._hook_optimizer(after)
        return result

    def _bind(self, accelerator: Any, model: nn.Module | None) -> None:
        # inferred once, at the first prepare: later prepares (kohya's text encoders, its
        # network) follow the same inferred policy, not one "as given"
        if self.policy is None:
            self._inferred = True
            root = unwrap_model(model)[0] if model is not None else None
            self.policy = self._with_overrides(PrecisionPolicy.from_accelerator(accelerator, root))
        mp = str(getattr(accelerator, "mixed_precision", "no") or "no")
        flag = {"bf16": "bf16", "fp8": "bf16", "fp16": "fp16"}.get(mp)

        def words(name: str, value: bool) -> str:
            return flags.flag(name, value, tool=self.tool)

        said = self.said_as or f"Accelerator(mixed_precision={mp!r})"
        self._said = said if flag else ""
        self._check_flag(flag, said=said, runner="accelerate", words=words, stacklevel=3)
        trainable = model is not None and any(p.requires_grad for p in model.parameters())
        refuse_fp16_trainables(
            self.policy,
            flag,
            trainable,
            call=self._call,
            said=said,
            scaler="accelerate's GradScaler",
            fix="PrecisionGuardPlugin('fp16') (trainable weights float32), or "
            "Accelerator(mixed_precision='bf16')",
        )
        ds = deepspeed_config_of(accelerator)
        if ds is not None:
            self.deepspeed_stage = zero_stage(accelerator)
            self.deepspeed_dtype = check_deepspeed_config(
                ds, bf16=mp in ("bf16", "fp8"), fp16=mp == "fp16"
            )
            if self.deepspeed_dtype != self.policy.compute_dtype:
                raise PrecisionError(
                    f"PrecisionGuardPlugin: DeepSpeed will hold the model in "
                    f"{dtype_name(self.deepspeed_dtype)} but the policy computes in "
                    f"{dtype_name(self.policy.compute_dtype)} ({self.policy.describe()}). Fix: "
                    "make the DeepSpeed bf16/fp16 sections and the policy agree."
                )
        if accelerator is self._accelerator:
            return
        self._accelerator = accelerator
        accelerator.register_for_checkpointing(self)
        self._handles.append(accelerator.register_save_state_pre_hook(self._save_state_hook))
        if self.report and self._reporter is None:
            self._reporter = PrecisionReporter.from_accelerator(
                accelerator, report_dir=self.report_dir
            )

    def _wrap_loader(self, obj: Any) -> Any:
        policy = self.policy
        assert policy is not None
        if (
            isinstance(obj, torch.utils.data.DataLoader)
            and policy.cast_batch
            and policy.mode != "audit"
            and not isinstance(obj.collate_fn, PrecisionCollator)
        ):
            # accelerate rebuilds the loader from its attributes, collate_fn included
            model = self._guarded[0].root if self._guarded else None
            obj.collate_fn = PrecisionCollator(obj.collate_fn, policy, model=model)
        return obj

    # ------------------------------------------------------------------ optimizer steps
    def _hook_optimizer(self, optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        if not hasattr(inner, "register_step_pre_hook"):  # DeepSpeed's own optimizers
            logger.info(
                "hf-precision: %s has no step pre-hook; dtypes are checked at evaluations only",
                type(inner).__name__,
            )
            return
        self._optimizers.append(inner)
        if self._guarded and self.step_watch.lost is None:  # the first optimizer's model
            self.step_watch.watch_updates(
                self._trained_by(inner), inner, tool="accelerate", fix=self.lost_updates_fix
            )
        if self.check_every or self.blame_mode != "off":
            self._handles.append(inner.register_step_pre_hook(self._step_pre_hook))

    def _trained_by(self, optimizer: Any) -> PrecisionGuard:
        """The guarded model whose weights ``optimizer`` updates (the first one otherwise)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for g in self._guarded:
            if any(id(p) in held for p in g.root.parameters()):
                return g
        return self._guarded[0]

    def _step_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        # events that waited for init_trackers' writer/run
        flush = getattr(self._reporter, "flush_trackers", None)
        if flush is not None:
            flush()
        self._blame_step()
        if not self.check_every or self.steps % self.check_every:
            return
        for g in self._guarded:
            # Cheap: one dtype read per parameter tensor; the full check runs only on a change.
            if g.drifted():
                self.verify(g.model, "before_optimizer_step", check_ranks=False)

    def observe(self, loss: Any = None, grad_norm: Any = None) -> bool:
        """What the loop logs: a non-finite ``loss`` or ``grad_norm`` arms the blame
        (``auto``); the next step is inspected. A tensor is read (a device sync: pass the value
        you log anyway). Returns whether it armed now."""
        logs = {k: v for k, v in (("loss", loss), ("grad_norm", grad_norm)) if v is not None}
        return self.step_watch.observe(logs, step=self.steps)

    def blame_next_step(self, *, backward: bool = True) -> None:
        """Arm the blame on request: the next step's forward (and backward) is inspected."""
        self.step_watch.arm(f"on request at step {self.steps}", backward=backward)

    def _blame_step(self) -> list[NonFinite]:
        """At the optimizer step: a step the GradScaler skipped (inf gradients) arms ``auto``;
        an armed blame reports what it saw in this step's forward and backward."""
        skipped = bool(getattr(self._accelerator, "optimizer_step_was_skipped", False))
        return self.step_watch.end_step(self.steps, skipped=skipped)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What ``accelerator.save_state`` stores for the guard: the policy and the step."""
        assert self.policy is not None
        return {"version": STATE_VERSION, "policy": self.policy.to_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the policy (``accelerator.load_state``) and verify the models against it."""
        if state.get("version") != STATE_VERSION or "policy" not in state:
            raise PrecisionError(
                f"PrecisionGuardPlugin.load_state_dict: unknown state "
                f"{sorted(state)} (version {state.get('version')!r}). Fix: "
                "load a checkpoint saved by this hf-precision version."
            )
        loaded = PrecisionPolicy.from_dict(state["policy"])
        if self.policy is not None and loaded != self.policy:
            warnings.warn(
                f"PrecisionGuardPlugin.load_state: the checkpoint's policy "
                f"{loaded.describe()} replaces {self.policy.describe()}.",
                PrecisionWarning,
                stacklevel=2,
            )
        self.policy = loaded
        self.steps = int(state.get("steps", 0))
        for g in self._guarded:
            self.verify(g.model, "load_state", check_ranks=False)

    def _save_state_hook(
        self, models: list[nn.Module], weights: list[Any], output_dir: str
    ) -> None:
        if self.policy is not None and getattr(self._accelerator, "is_main_process", True):
            Path(output_dir, POLICY_FILE).write_text(self.policy.to_json())

    # ------------------------------------------------------------------ any loop
    def setup(self, model: nn.Module) -> nn.Module:
        """Before wrapping: cast to the policy, install the guards, check the ranks agree.

        Usable without accelerate (e.g. before ``fully_shard``); follow with :meth:`verify`.
        """
        if self.policy is None:
            self._inferred = True
            self.policy = self._with_overrides(PrecisionPolicy.from_model(model))
        if self.report and self._reporter is None:  # a loop without accelerate: rank 0 writes
            self._reporter = PrecisionReporter(
                self.report_dir or "precision", is_main_process=rank() == 0
            )
        root, _ = unwrap_model(model)
        if not any(g.root is root for g in self._guarded):
            origin = policy_origin(self.policy, self._inferred, self._said, self._call)
            guard = self._new_guard(model, origin=origin)
            guard.sections.update(self.sections)
            self._guarded.append(guard)
            self.step_watch.add_model(model)
        self.verify(model, "setup")
        return model

    def verify(
        self, model: nn.Module | None = None, event: str = "verify", *, check_ranks: bool = True
    ) -> EnforceReport:
        """Verify ``model`` against the policy and repair drift where that is safe.

        Without a wrapper (or under DDP, back to the dtypes it was wrapped with) drift is cast
        back in ``fix`` mode. Parameters FSDP or DeepSpeed hold are never cast: expected
        differences are logged, others raise :class:`PrecisionError` (a warning in ``audit``).
        """
        policy = self.policy
        if policy is None or (
            model is not None and not any(g.root is unwrap_model(model)[0] for g in self._guarded)
        ):
            if model is None:
                raise PrecisionError(
                    "PrecisionGuardPlugin.verify(): no model yet. Fix: call "
                    "guard.prepare(accelerator, model, ...) first."
                )
            return self.verify(self.setup(model), event, check_ranks=check_ranks)
        g = self._entry(model)
        # a wrapper made outside prepare (FSDP1, DDP) around the same model: the engine holds it
        held = model if model is not None and model is not g.model and model is not g.root else None
        g.configure(
            policy=policy,
            reporter=self._reporter,
            deepspeed_dtype=self.deepspeed_dtype,
            deepspeed_stage=self.deepspeed_stage,
        )
        report = g.verify(
            event,
            model=held,
            wrapper="auto",
            optimizer=self._optimizers[0] if self._optimizers else None,
            step=self.steps,
            check_ranks=check_ranks and self.check_ranks,
            log_clean=event != "before_optimizer_step",  # the step check logs only drift
        )
        self.last_report = report
        self.events.append(g.events[-1])
        return report

    def _entry(self, model: nn.Module | None) -> PrecisionGuard:
        if not self._guarded:
            raise PrecisionError(
                "PrecisionGuardPlugin: no model is guarded yet. Fix: call "
                "guard.prepare(accelerator, model, ...) first."
            )
        if model is None:
            return self._guarded[0]
        root, _ = unwrap_model(model)
        for g in self._guarded:
            if g.root is root or g.model is model:
                return g
        raise PrecisionError(
            f"PrecisionGuardPlugin: {type(model).__name__} was not prepared by "
            "this guard. Fix: pass it to guard.prepare(accelerator, ...)."
        )

    @contextmanager
    def evaluating(self, model: nn.Module | None = None) -> Iterator[nn.Module]:
        """Verify (and repair) before the block and after it; ranks are compared after.

        >>> guard = PrecisionGuardPlugin("fp32", report=False)  # doctest: +SKIP
        >>> with guard.evaluating(model):  # doctest: +SKIP
        ...     model.generate(**inputs)
        """
        g = self._entry(model)
        self.verify(g.model, "before_evaluate", check_ranks=False)
        ok = False
        try:
            yield g.model
            ok = True
        finally:
            # after an error, repair locally but skip the collective: other ranks may not be here
            self.verify(g.model, "after_evaluate", check_ranks=ok)

    def remove(self) -> None:
        """Take the guards, the optimizer hooks, the save hook and the blames' hooks off."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for g in self._guarded:
            g.teardown()
        self.step_watch.stop(updates=True)  # the blames, the lost-update check's hooks

    def __repr__(self) -> str:
        policy = self.policy.describe() if self.policy is not None else "inferred at prepare"
        return f"PrecisionGuardPlugin({policy}, models={len(self._guarded)})"
