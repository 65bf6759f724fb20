"""``PrecisionGuardCallback``: one line in ``Trainer(callbacks=[...])``.

Lifecycle (docs/architecture.md):

* ``on_init_end`` — before the optimizer and ``accelerator.prepare`` exist: enforce the policy
  (the safest moment to cast) and install the guards;
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
import warnings
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from .distributed import check_model_ranks, check_training_args, explain_wrapped
from .dtypes import dtype_name
from .enforce import EnforceReport, enforce_policy
from .errors import PrecisionError, PrecisionWarning
from .groups import ModuleGroups, find_module_groups, unwrap_model
from .hooks import GuardHandle, claim_model, install_guards
from .policy import PrecisionPolicy, policy_call, resolve_policy, with_overrides

logger = logging.getLogger("hf_precision")

#: Above this size the fp32 copy of trainable weights kept across a full-precision eval is
#: skipped with a warning (a full fine-tune of a large model would double its memory).
STASH_LIMIT_BYTES = 2 * 1024**3


def owned_by_wrapper(model: nn.Module, args: Any = None) -> str | None:
    """Name of the distributed wrapper holding the parameters (``"FSDP"``, ``"DeepSpeed"``,
    ``"DDP"``), or ``None`` when it is safe to cast in place."""
    if args is not None:
        if getattr(args, "deepspeed", None) or getattr(args, "hf_deepspeed_config", None):
            return "DeepSpeed"
        if getattr(args, "fsdp", None):
            return "FSDP"
    if type(model).__name__ in (
        "FullyShardedDataParallel",
        "DeepSpeedEngine",
        "DistributedDataParallel",
    ):
        return {"FullyShardedDataParallel": "FSDP", "DeepSpeedEngine": "DeepSpeed"}.get(
            type(model).__name__, "DDP"
        )
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "FSDP"
    if args is not None and int(getattr(args, "world_size", 1) or 1) > 1:
        return "DDP"
    return None


class PrecisionGuardCallback(TrainerCallback):
    """Enforce one precision policy across training, evaluation, prediction and generation.

    Args:
        policy: a :class:`PrecisionPolicy`, a preset name (``"bf16"``, ``"fp16"``, …) or ``None``
            to infer it from ``TrainingArguments`` and the model as loaded.
        mode: override the policy's mode: ``"audit"`` (report only), ``"fix"``, ``"raise"``.
        report: write dtype maps (files always, W&B when ``"wandb"`` is in ``report_to``);
            ``False`` turns reporting off.
        report_dir: where the files go (default ``<output_dir>/precision``).

    >>> from transformers import Trainer  # doctest: +SKIP
    >>> Trainer(model=model, args=args, callbacks=[PrecisionGuardCallback()])  # doctest: +SKIP
    """

    def __init__(
        self,
        policy: PrecisionPolicy | str | None = None,
        *,
        mode: str | None = None,
        leaf_guards: str | None = None,
        report: bool = True,
        report_dir: str | None = None,
        report_to: list[str] | str | None = None,
    ) -> None:
        self._policy_arg = policy
        self._mode = mode
        self._leaf_guards = leaf_guards
        self._call = policy_call(
            "PrecisionGuardCallback", policy, mode=mode, leaf_guards=leaf_guards
        )
        # bad values fail now, not at train time, naming the user's call; nothing the caller
        # passed in changes (a policy is a value)
        given = self._with_overrides(resolve_policy(policy, call=self._call))
        self.policy: PrecisionPolicy | None = None if policy is None else given
        self.report = report
        self.report_dir = report_dir
        self.report_to = report_to
        self.groups: ModuleGroups | None = None
        self.handle: GuardHandle | None = None
        self.last_report: EnforceReport | None = None
        self.events: list[tuple[str, int]] = []  # (event, number of changes) for inspection
        self._stash: dict[str, torch.Tensor] = {}
        self.restored = 0  # tensors given back their exact values after a *_full_eval cast
        self._reporter: Any = None
        self._root: nn.Module | None = None
        self._wrapper_casts: set[str] = set()  # what a wrapper cast against the policy (warned)
        self._said: set[str] = set()  # warnings already given

    # ------------------------------------------------------------------ setup
    def _with_overrides(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        return with_overrides(
            policy, call=self._call, mode=self._mode, leaf_guards=self._leaf_guards
        )

    def _setup(self, args: Any, model: nn.Module | None) -> bool:
        if model is None:
            return False
        root, _ = unwrap_model(model)
        if self._root is root and self.policy is not None and self.groups is not None:
            return True
        first = self._root is None
        self._root = root
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
                self._reporter = None  # this Trainer's output_dir and report_to
        elif self.policy is not None and self.policy.full_eval_dtype is None:
            flags = PrecisionPolicy.from_training_args(args)
            self.policy = self.policy.replace(full_eval_dtype=flags.full_eval_dtype)
        assert self.policy is not None
        claim_model(root, self, self.policy, self._call)
        self._check_args(args, root)
        self.groups = find_module_groups(root)
        if self.report and self._reporter is None:
            from .reporting import PrecisionReporter

            self._reporter = PrecisionReporter.from_training_args(
                args, report_dir=self.report_dir, report_to=self.report_to
            )
        logger.info(
            "hf-precision: policy %s; groups by rule %r", self.policy.describe(), self.groups.rule
        )
        return True

    def _check_args(self, args: Any, root: nn.Module) -> None:
        policy = self.policy
        assert policy is not None
        check_training_args(args)  # the DeepSpeed JSON's bf16/fp16 sections vs --bf16/--fp16
        flag = (
            "bf16"
            if getattr(args, "bf16", False)
            else "fp16"
            if getattr(args, "fp16", False)
            else None
        )
        autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(flag or "")
        if (
            self._policy_arg is not None
            and autocast is not None
            and autocast != policy.compute_dtype
        ):
            warnings.warn(
                f"{self._call} with TrainingArguments({flag}=True): the Trainer autocasts to "
                f"{dtype_name(autocast)} but the policy computes in "
                f"{dtype_name(policy.compute_dtype)} ({policy.describe()}). Fix: "
                f"PrecisionGuardCallback() follows the flags ({flag!r}), or pass "
                f"PrecisionGuardCallback({flag!r}), or change the flag.",
                PrecisionWarning,
                stacklevel=4,
            )
        if (
            getattr(args, "fp16", False)
            and policy.trainable_dtype == torch.float16
            and any(p.requires_grad for p in root.parameters())
        ):
            raise PrecisionError(
                f"PrecisionGuardCallback({self._policy_arg!r}): fp16=True with trainable "
                "weights in float16: the GradScaler raises 'Attempting to unscale FP16 "
                "gradients'.\nFix: use the 'fp16' preset (trainable weights fp32) or bf16."
            )
        if getattr(args, "fp16", False) and not torch.cuda.is_available():
            warnings.warn(
                "fp16=True without a GPU: transformers runs no autocast and no GradScaler here; "
                "the guard keeps frozen weights fp16 and trainable weights fp32 and bridges "
                "the dtypes with its hooks.",
                PrecisionWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ core
    def _enforce(
        self,
        model: nn.Module,
        event: str,
        *,
        optimizer: Any = None,
        args: Any = None,
        state: Any = None,
        allow_cast: bool = True,
    ) -> EnforceReport:
        policy = self.policy
        assert policy is not None and self.groups is not None
        mode = policy.mode
        audit = enforce_policy(model, policy, groups=self.groups, mode="audit")
        if not allow_cast:  # FSDP upcasts / DeepSpeed's dtype are no drift; its casts are warned
            audit = explain_wrapped(
                model,
                policy,
                self.groups,
                audit,
                args=args,
                where=f"PrecisionGuardCallback.{event}",
            )
            casts = {c.name for c in audit.wrapper_casts}
            if casts and casts != self._wrapper_casts:  # once, not at every evaluation
                warnings.warn(audit.wrapper_note or "", PrecisionWarning, stacklevel=3)
            self._wrapper_casts = casts
        if audit.changes and mode == "fix" and not allow_cast:
            wrapper = owned_by_wrapper(model, args)
            raise PrecisionError(
                f"PrecisionGuardCallback.{event}: {len(audit.changes)} tensor(s) violate "
                f"{policy.describe()} but {wrapper} already holds the parameters, so they "
                f"cannot be cast in place:\n  "
                + "\n  ".join(c.describe() for c in audit.changes[:8])
                + "\nFix: keep the callback in Trainer(callbacks=[...]) so it casts at "
                "on_init_end, before the wrapper exists, or load the model in the policy's "
                "dtypes."
            )
        if audit.changes and mode in ("fix", "raise"):
            report = enforce_policy(
                model, policy, groups=self.groups, mode=mode, optimizer=optimizer
            )
        else:
            report = audit
        if audit.changes and event not in ("on_init_end",):
            verb = "repaired" if mode == "fix" else "found"
            warnings.warn(
                f"PrecisionGuardCallback.{event}: dtype drift {verb}: {len(audit.changes)} "
                f"tensor(s) did not match {policy.describe()}, e.g. "
                f"{audit.changes[0].describe()}",
                PrecisionWarning,
                stacklevel=3,
            )
        for w in report.warnings:  # said once; enforce_policy already said those it applied
            if w not in self._said:
                self._said.add(w)
                if not report.applied:
                    warnings.warn(w, PrecisionWarning, stacklevel=3)
        if event == "on_init_end" and report.applied and report.changes:
            groups = sorted({c.group for c in report.changes})
            logger.warning(
                "hf-precision: cast %d tensor(s) in %s to %s (details in the precision report)",
                len(report.changes),
                ", ".join(groups),
                policy.describe(),
            )
        self.last_report = report
        self.handle = install_guards(model, policy, report, groups=self.groups)
        self.events.append((event, len(audit.changes)))
        self._log(event, model, state, report if audit.changes or audit.wrapper_casts else None)
        if event in ("on_train_begin", "on_evaluate", "on_predict"):  # collective, every rank
            check_model_ranks(
                model, self.groups, policy=policy, where=f"PrecisionGuardCallback.{event}"
            )
        return report

    def _log(self, event: str, model: nn.Module, state: Any, report: EnforceReport | None) -> None:
        if self._reporter is None:
            return
        step = int(getattr(state, "global_step", 0) or 0)
        self._reporter.log_event(
            event, model, step=step, policy=self.policy, groups=self.groups, report=report
        )

    # ------------------------------------------------------------------ full-eval stash
    def _refresh_stash(self, model: nn.Module) -> None:
        policy = self.policy
        if policy is None or policy.full_eval_dtype is None:
            return
        root, _ = unwrap_model(model)
        stash: dict[str, torch.Tensor] = {}
        total = 0
        for name, p in root.named_parameters():
            if p.requires_grad and p.dtype != policy.full_eval_dtype and p.is_floating_point():
                stash[name] = p
                total += p.numel() * p.element_size()
        for name, b in root.named_buffers():
            if (
                b.is_floating_point()
                and b.dtype == torch.float32
                and policy.keep_fp32_reason(name, is_buffer=True) is not None
            ):
                stash[name] = b
        if total > STASH_LIMIT_BYTES:
            warnings.warn(
                f"{dtype_name(policy.full_eval_dtype)}_full_eval will round {total / 2**30:.1f} "
                "GiB of trainable weights in place and the guard keeps no copy above "
                f"{STASH_LIMIT_BYTES / 2**30:.0f} GiB. Fix: drop *_full_eval, or train LoRA.",
                PrecisionWarning,
                stacklevel=3,
            )
            return
        # A CPU copy taken before Trainer's in-place cast gives the exact values back after it.
        self._stash = {k: v.detach().to("cpu", copy=True) for k, v in stash.items()}

    def _restore_stash(self, model: nn.Module) -> int:
        if not self._stash:
            return 0
        root, _ = unwrap_model(model)
        tensors: dict[str, torch.Tensor] = dict(root.named_parameters())
        tensors.update(dict(root.named_buffers()))
        n = 0
        with torch.no_grad():
            for name, saved in self._stash.items():
                t = tensors.get(name)
                if t is not None and t.dtype != saved.dtype:
                    t.data = saved.to(t.device)
                    n += 1
        return n

    # ------------------------------------------------------------------ events
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if not self._setup(args, model):
            return
        assert model is not None
        self._enforce(model, "on_init_end", args=args, state=state)
        self._refresh_stash(model)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if not self._setup(args, model):
            return
        assert model is not None
        self._restore_stash(model)  # a standalone evaluate() with *_full_eval ran before train()
        safe = owned_by_wrapper(model, args) is None
        self._enforce(
            model,
            "on_train_begin",
            optimizer=kwargs.get("optimizer"),
            args=args,
            state=state,
            allow_cast=safe,
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(control, "should_evaluate", False) and kwargs.get("model") is not None:
            self._verify(kwargs["model"], "before_evaluate", args, state, kwargs)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if kwargs.get("model") is not None:
            self._after_eval(kwargs["model"], "on_evaluate", args, state, kwargs)

    def on_predict(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
    ) -> None:
        if kwargs.get("model") is not None:
            self._after_eval(kwargs["model"], "on_predict", args, state, kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if kwargs.get("model") is not None:
            # load_best_model_at_end (or any end-of-train reload) brings weights back in the
            # dtype they were saved/loaded in: repair and report it like an evaluation
            self._verify(kwargs["model"], "on_train_end", args, state, kwargs)
            self._refresh_stash(kwargs["model"])

    def _after_eval(
        self, model: nn.Module, event: str, args: Any, state: Any, kwargs: dict[str, Any]
    ) -> None:
        if not self._setup(args, model):
            return
        restored = self._restore_stash(model)
        self.restored += restored
        if restored:
            logger.info("hf-precision: restored %d tensor(s) rounded by *_full_eval", restored)
        self._verify(model, event, args, state, kwargs)

    def _verify(
        self, model: nn.Module, event: str, args: Any, state: Any, kwargs: dict[str, Any]
    ) -> None:
        if not self._setup(args, model):
            return
        safe = owned_by_wrapper(model, args) is None
        self._enforce(
            model, event, optimizer=kwargs.get("optimizer"), args=args, state=state, allow_cast=safe
        )
