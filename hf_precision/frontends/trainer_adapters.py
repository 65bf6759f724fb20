"""The other models a ``Trainer`` runs (TRL's ``ref_model``, reward, value and teacher models):
found through the adapter of the library the Trainer's class comes from
(:data:`TRAINER_ADAPTERS`), each guarded by its own engine with the callback's policy and
reported as ``<step>-<event>.<name>.json`` (:class:`TrainerModels`, a part of
:class:`~hf_precision.PrecisionGuardCallback`)."""

from __future__ import annotations

import importlib
import os
import sys
import weakref
from types import FrameType
from typing import Any

import torch
from torch import nn

from ..base.wrapper_kinds import unwrap_model
from ..engine.guard import PrecisionGuard
from .frontend import GuardFrontEnd

__all__ = [
    "RL_ADAPTERS",
    "TRAINER_ADAPTERS",
    "TrainerModels",
    "check_rl",
    "find_trainer",
    "trainer_models",
    "trainer_watchers",
]

#: Trainer adapters (as transformers' ``INTEGRATION_TO_CALLBACK``): the top-level package a
#: Trainer class comes from -> the module whose ``trainer_models(trainer, init_args)`` names the
#: other models that Trainer runs. Loaded only when a Trainer of that package is seen;
#: tests/test_layering.py checks every module here exists in ``hf_precision/integrations/``.
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


class TrainerModels(GuardFrontEnd):
    """The callback's Trainer, bound or found, and the engines of its other models (a part of
    :class:`~hf_precision.PrecisionGuardCallback`, which holds the fields below)."""

    _trainer: Any
    trainer_guards: dict[str, PrecisionGuard]
    write_reports: bool
    report_dir: str | os.PathLike[str] | None
    report_to: list[str] | str | None
    _deepspeed_dtype: torch.dtype | None
    _deepspeed_stage: int | None
    rl: str
    rl_watch: Any

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
        elif event == "on_train_end" and getattr(self, "rl_watch", None) is not None:
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
        rl = getattr(self, "rl", "off")
        if rl == "off":
            return
        watch = getattr(self, "rl_watch", None)
        if watch is not None:
            if watch.trainer is trainer:
                return
            watch.detach()
            self.rl_watch = None
        for library in dict.fromkeys(c.__module__.split(".")[0] for c in type(trainer).__mro__):
            name = RL_ADAPTERS.get(library)
            if name is not None:
                self.rl_watch = importlib.import_module(name).attach(trainer, guard, rl=rl)
                return


def check_rl(value: str, *, call: str) -> str:
    if value not in RL_MODES:
        from ..errors import PrecisionError

        raise PrecisionError(
            f"{call}: rl={value!r} is not one of {', '.join(map(repr, RL_MODES))}. Fix: "
            "rl='auto' (contract, gap, and match in fix mode), 'match', 'measure' or 'off'."
        )
    return value


def trainer_watchers(trainer: Any, guard: PrecisionGuard) -> Any:
    """The watchers the adapter of the Trainer's library puts on it (its ``watch_trainer``:
    TRL's RL trainers get the sync integrity and gap attribution watchers), or ``None``."""
    for library in dict.fromkeys(c.__module__.split(".")[0] for c in type(trainer).__mro__):
        name = TRAINER_ADAPTERS.get(library)
        watch = getattr(importlib.import_module(name), "watch_trainer", None) if name else None
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
    for library in dict.fromkeys(c.__module__.split(".")[0] for c in type(trainer).__mro__):
        name = TRAINER_ADAPTERS.get(library)
        if name is None:
            continue
        adapter = importlib.import_module(name)
        models = getattr(adapter, "trainer_models", None)
        if models is not None:
            found.update({k: v for k, v in models(trainer, init_args).items() if k not in found})
    return found
