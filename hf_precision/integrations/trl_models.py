"""TRL: the other models a TRL trainer runs beside the one it trains.

``PrecisionGuardCallback`` guards ``Trainer.model``. TRL's trainers run more models: a reference
model (``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``, ``RLOOTrainer``, the experimental
``OnlineDPOTrainer``), reward models (``reward_funcs`` entries that are models: GRPO, RLOO,
Online DPO), a teacher (``DistillationTrainer``, GKD) and, where a trainer has one, a value
model. The callback calls :func:`trainer_models` at each of its events (its table
``TRAINER_ADAPTERS`` maps ``trl``, the trainer's package, to this module; it is not named ``trl``: a
module of this folder never shadows a package ms-swift imports when its plugin loader puts this
folder on ``sys.path``) and guards every model found with the same policy, hooks and report
(files named ``<step>-<event>.<name>.json``).

When they exist, in TRL 1.16 (read from its source):

* ``reward_funcs`` (and Online DPO's ``ref_model``) are set on the trainer before
  ``Trainer.__init__``: ``on_init_end`` sees them;
* ``DPOTrainer`` / ``KTOTrainer`` set ``self.ref_model`` (and the distillation trainers
  ``self.teacher_model``) only after ``Trainer.__init__`` returned, i.e. after ``on_init_end``,
  then pass it through ``accelerator.prepare_model(..., evaluation_mode=True)`` (DeepSpeed:
  ``prepare_deepspeed``, an inference engine). A model the user passed is still the
  ``ref_model`` argument of the trainer's ``__init__`` at ``on_init_end``: it is found there
  (``init_args``), before ``precompute_ref_log_probs=True`` runs it inside ``__init__``;
* a reference model TRL loads itself (no ``ref_model`` given, no PEFT: built from the policy's
  name in the policy's ``dtype``) appears after ``on_init_end`` and is guarded from
  ``on_train_begin``; with ``precompute_ref_log_probs=True`` its precompute pass runs inside
  ``__init__``, before any callback event, unguarded.
* With PEFT and no ``ref_model``, the reference is the policy with its adapters disabled: the
  same model, nothing more to guard.

Nothing here imports TRL: the module imports (and :func:`trainer_models` runs) without it.

>>> from types import SimpleNamespace
>>> from torch import nn
>>> ref, reward = nn.Linear(2, 2), nn.Linear(2, 1)
>>> trainer = SimpleNamespace(ref_model=None, reward_funcs=[len, reward])
>>> sorted(trainer_models(trainer, {"ref_model": ref}))
['ref_model', 'reward_funcs.1']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

#: Trainer attributes (and ``__init__`` arguments) that hold a model the trainer runs, in the
#: order they are reported. A list or tuple (``reward_funcs``) holds models among callables.
MODEL_ATTRS = ("ref_model", "reward_model", "value_model", "teacher_model", "reward_funcs")


def trainer_models(
    trainer: Any, init_args: Mapping[str, Any] | None = None
) -> dict[str, nn.Module]:
    """The models ``trainer`` runs besides ``trainer.model``, by name (``ref_model``,
    ``reward_funcs.0``, ``teacher_model``, ...).

    ``init_args`` are the arguments of the trainer's ``__init__`` while it runs (at
    ``on_init_end``): a model the trainer stores only after ``Trainer.__init__`` is found there.
    The trainer's attribute wins once it is set (it may be the prepared model, or a model TRL
    loaded itself). Entries that are not ``nn.Module`` (a function, a model name) are skipped.
    """
    init_args = init_args or {}
    found: dict[str, nn.Module] = {}
    for attr in MODEL_ATTRS:
        value = getattr(trainer, attr, None)
        if value is None:
            value = init_args.get(attr)
        if isinstance(value, nn.Module):
            found[attr] = value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, nn.Module):
                    found[f"{attr}.{i}"] = item
    return found


__all__ = ["MODEL_ATTRS", "trainer_models", "watch_trainer"]


def watch_trainer(trainer: Any, guard: Any) -> Any:
    """The RL watchers on one of TRL's RL trainers (:mod:`.trl_rl_watch`), else ``None``."""
    from .trl_rl_watch import watch_rl

    return watch_rl(trainer, guard)
