"""Fixtures of the scenario tests: a real ``Trainer`` on CPU, a callback that generates samples
after each evaluation (the path autocast does not cover), and an input-dtype recorder."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator


def as_rows(batch: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A collated batch back to dataset rows (a list is a valid map-style dataset)."""
    n = next(iter(batch.values())).shape[0]
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


@pytest.fixture
def trainer_for(tiny_args: Callable[..., TrainingArguments]) -> Callable[..., Trainer]:
    """``trainer_for(model, batch_or_rows, callbacks=[...], **training_args) -> Trainer``.

    A real ``transformers.Trainer`` on CPU (``tiny_args``: two steps of batch 2, no
    checkpoints, no trackers, no logging). ``collator`` and ``compute_loss_func`` go to the
    Trainer, everything else to ``TrainingArguments``. The train rows double as the eval rows.
    """

    def factory(
        model: nn.Module,
        data: Mapping[str, torch.Tensor] | Iterable[Any],
        *,
        callbacks: Iterable[TrainerCallback] = (),
        collator: Any = None,
        compute_loss_func: Any = None,
        **kw: Any,
    ) -> Trainer:
        rows = as_rows(data) if isinstance(data, Mapping) else list(data)
        return Trainer(
            model=model,
            args=tiny_args(**{"logging_strategy": "no", **kw}),
            train_dataset=rows,
            eval_dataset=rows,
            data_collator=collator or default_data_collator,
            callbacks=list(callbacks),
            compute_loss_func=compute_loss_func,
        )

    return factory


class GenerateOnEvaluate(TrainerCallback):
    """Generate samples from a fixed fp32 batch after each evaluation, as XTuner's and LLaVA's
    sample hooks do: ``model.generate`` (a ``PeftModel`` here when the model is one) runs
    outside the autocast-patched ``forward``."""

    def __init__(self, batch: Mapping[str, torch.Tensor], max_new_tokens: int = 2) -> None:
        self.batch = {k: v for k, v in batch.items() if k != "labels"}
        self.max_new_tokens = max_new_tokens
        self.samples: list[torch.Tensor] = []

    def on_evaluate(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        device = next(model.parameters()).device
        inputs = {k: v.to(device) for k, v in self.batch.items()}
        with torch.no_grad():
            self.samples.append(model.generate(**inputs, max_new_tokens=self.max_new_tokens))


@pytest.fixture
def generate_on_evaluate() -> type[GenerateOnEvaluate]:
    """The :class:`GenerateOnEvaluate` callback class."""
    return GenerateOnEvaluate


@pytest.fixture
def record_inputs() -> Callable[[nn.Module], list[torch.dtype]]:
    """``record_inputs(module)`` -> a list that fills with the dtype of every floating tensor
    argument the module receives. The hook is added last, so it sees what the guard passed on."""

    def attach(module: nn.Module) -> list[torch.dtype]:
        seen: list[torch.dtype] = []

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    seen.append(value.dtype)

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return seen

    return attach
