"""The Trainer adapters table and the Trainer's other models
(:mod:`hf_precision.frontends.trainer_adapters`; TRL's models on a real DPO/GRPO Trainer are in
tests/integrations/test_trl_models.py and tests/test_trl.py)."""

from __future__ import annotations

import importlib

from hf_precision import PrecisionGuardCallback
from hf_precision.frontends import callback as callback_module
from hf_precision.frontends.trainer_adapters import (
    TRAINER_ADAPTERS,
    TrainerModels,
    find_trainer,
    trainer_models,
)
from hf_precision.tiny import tiny_batch, tiny_llava


def test_every_adapter_names_a_module_with_trainer_models():
    for library, name in TRAINER_ADAPTERS.items():
        assert name.startswith("hf_precision.integrations."), (library, name)
        assert callable(importlib.import_module(name).trainer_models)


def test_the_old_names_on_the_callback_module_are_the_same_objects():
    assert callback_module.TRAINER_ADAPTERS is TRAINER_ADAPTERS
    assert callback_module._find_trainer is find_trainer
    assert callback_module._trainer_models is trainer_models
    assert issubclass(PrecisionGuardCallback, TrainerModels)


def test_a_transformers_trainer_has_no_other_models_and_is_found_bound_or_in_frames(
    make_trainer,
):
    model = tiny_llava()
    callback = PrecisionGuardCallback("fp32", report=False)
    trainer = make_trainer(model, tiny_batch(model), callbacks=[callback])
    assert trainer_models(trainer, {}) == {}  # no adapter for transformers' own Trainer
    assert find_trainer(callback, trainer)[0] is trainer  # bound (the launcher binds it)
    assert find_trainer(callback, None)[0] is None  # no Trainer event running: no frame has it
    callback.bind_trainer(trainer)
    assert callback._trainer() is trainer  # a weak reference: no cycle keeps it alive
    assert callback.trainer_guards == {}
