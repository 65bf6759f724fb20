"""TRL's RL trainers (``GRPOTrainer``, ``RLOOTrainer``): the sync integrity and gap attribution
watchers, hooked on the trainer instance.

Read from TRL 1.16's ``grpo_trainer.py`` and ``generation/vllm_generation.py``:

* every generation goes through ``trainer._generate_single_turn`` (vLLM, continuous batching or
  HF ``generate``); the continuous-batching branch runs ``unwrapped_model.to(torch.bfloat16)``
  (``bf16=True``) on the live model and never casts back;
* a vLLM weight sync is ``trainer.vllm_generation.sync_weights()``; with PEFT it calls
  ``model.merge_adapter()`` on the trainer's ``PeftModel``, reads the merged weights, then
  ``model.unmerge_adapter()`` (the experimental online DPO and async GRPO trainers do the same);
* ``trainer._generate_and_score_completions(inputs)`` returns the batch the trainer then
  scores: ``prompt_ids``/``prompt_mask``, ``completion_ids``/``completion_mask`` and the
  multimodal fields; the trainer scores under ``accelerator.autocast()``.

:func:`watch_rl` wraps those bound methods on the trainer (and the PEFT model) instance, never on
the class: :meth:`RLWatch.remove` takes them off. Findings go out through :func:`emit`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..engine.sync_integrity import SyncFinding, SyncIntegrity
from ..watch.rl_attribution import GapAttribution, attribute_gap, token_log_probs

logger = logging.getLogger("hf_precision")

#: batch fields of ``_generate_and_score_completions`` the model's forward takes as they are
_MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def emit(
    guard: Any,
    source: str,
    numbers: Any,
    line: str,
    *,
    step: int,
    groups: dict[str, float] | None = None,
    measure: str = "",
) -> None:
    """One finding out through the findings channel (:mod:`hf_precision.watch.finding`: the
    console, ``precision.log``, ``<step>-<source>.json``, the picture and the trackers); the
    numbers also stay in the guard's event sections."""
    from ..watch.finding import Finding
    from ..watch.finding import emit as say

    found = Finding(
        source, "warning", line, numbers=numbers or {}, groups=groups or {}, measure=measure
    )
    if guard is None:
        say(found, step=step)
        return
    guard.sections[source] = numbers
    guard.emit(found, step=step)


def completion_batch(out: dict[str, Any]) -> tuple[dict[str, Any], int, torch.Tensor]:
    """The scored batch of ``_generate_and_score_completions``'s output: the model inputs, the
    number of completion tokens and their mask."""
    completion = out["completion_ids"]
    batch = {
        "input_ids": torch.cat([out["prompt_ids"], completion], dim=1),
        "attention_mask": torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1),
    }
    batch.update({k: out[k] for k in _MULTIMODAL if out.get(k) is not None})
    return batch, completion.size(1), out["completion_mask"]


class RLWatch:
    """The watchers on one TRL RL trainer (see the module docstring)."""

    def __init__(
        self,
        trainer: Any,
        guard: Any = None,
        *,
        steps: int = 3,
        threshold: float | None = None,
        restore: bool = True,
        say: Callable[..., None] = emit,
    ) -> None:
        self.trainer, self.guard, self.say = trainer, guard, say
        from ..watch import rl_attribution

        # the gap measurement's threshold, read when the watch starts
        self.steps = steps
        self.threshold = rl_attribution.GAP_THRESHOLD if threshold is None else threshold
        self.model = trainer.model
        self.dtype = _AUTOCAST.get(str(getattr(trainer.accelerator, "mixed_precision", "no")))
        self.sync = SyncIntegrity(self.model, on_finding=self._sync_found)
        self.attribution: GapAttribution | None = None
        self.sampler_autocast: bool | None = None  # seen at the first generation
        self.scored = 0
        self._said: set[str] = set()
        self.kept: list[dict[str, Any]] = []  # the last ten sync findings
        self._own: list[tuple[str, Any, bool]] = []
        self.sync.around(trainer, "_generate_single_turn", event="generation", restore=restore)
        if callable(getattr(self.model, "merge_adapter", None)):
            self.sync.round_trip(
                self.model, "merge_adapter", "unmerge_adapter", event="merge/unmerge sync"
            )
        engine = getattr(trainer, "vllm_generation", None)
        if engine is not None and callable(getattr(engine, "sync_weights", None)):
            self.sync.around(engine, "sync_weights", event="weight sync")
        if self.dtype is not None and steps > 0:
            self._wrap("_generate_single_turn", self._seeing_autocast)
            self._wrap("_generate_and_score_completions", self._attributing)

    def _step(self) -> int:
        return int(getattr(getattr(self.trainer, "state", None), "global_step", 0) or 0)

    # ------------------------------------------------------------------ sync
    def _sync_found(self, found: SyncFinding) -> None:
        self.kept = [*self.kept[-9:], found.to_dict()]
        if self.guard is not None:
            self.guard.sections["sync_integrity"] = {"findings": self.kept}
        if found.event in self._said:  # said once per event kind; the section keeps the rest
            return
        self._said.add(found.event)
        self.say(
            self.guard, "sync_integrity", {"findings": self.kept}, found.line(), step=self._step()
        )

    # ------------------------------------------------------------------ attribution
    def _wrap(self, method: str, around: Callable[..., Any]) -> None:
        inner = getattr(self.trainer, method)
        had = method in vars(self.trainer)
        self._own.append((method, vars(self.trainer).get(method) if had else None, had))
        object.__setattr__(self.trainer, method, functools.wraps(inner)(around(inner)))

    def _seeing_autocast(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.sampler_autocast is not None:
                return inner(*args, **kwargs)
            emb = self.model.get_input_embeddings()
            device = emb.weight.device.type

            def seen(mod: Any, a: Any) -> None:
                if self.sampler_autocast is None:
                    self.sampler_autocast = torch.is_autocast_enabled(device)

            handle = emb.register_forward_pre_hook(seen)
            try:
                return inner(*args, **kwargs)
            finally:
                handle.remove()

        return run

    def _attributing(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if self.attribution is None and self.scored < self.steps and not self.sampler_autocast:
                self.scored += 1
                try:
                    self._attribute(out)
                except Exception as err:  # an observer never stops training
                    logger.warning(
                        "hf-precision: gap attribution failed (%s: %s)", type(err).__name__, err
                    )
                    self.scored = self.steps
            return out

        return run

    def _attribute(self, out: dict[str, Any]) -> None:
        assert self.dtype is not None
        batch, keep, mask = completion_batch(out)
        found = attribute_gap(
            self.model,
            batch,
            keep=keep,
            score=token_log_probs,
            dtype=self.dtype,
            mask=mask,
            threshold=self.threshold,
        )
        if found.gap <= self.threshold:
            return
        self.attribution = found
        self.say(
            self.guard,
            "rl_attribution",
            found.to_dict(),
            found.line(),
            step=self._step(),
            groups={g: max(v, 0.0) for g, v in found.shares.items()},
            measure="share of the sampler/trainer gap",
        )

    def remove(self) -> None:
        """Every wrapper off: the trainer's and the model's methods are their own again."""
        for method, old, had in reversed(self._own):
            if had:
                object.__setattr__(self.trainer, method, old)
            else:
                object.__delattr__(self.trainer, method)
        self._own = []
        self.sync.remove()


def watch_rl(trainer: Any, guard: Any = None, **kw: Any) -> RLWatch | None:
    """Watch ``trainer`` when it is one of TRL's RL trainers (it generates through
    ``_generate_single_turn``); ``None`` otherwise."""
    if not callable(getattr(trainer, "_generate_single_turn", None)):
        return None
    return RLWatch(trainer, guard, **kw)
