"""TRL's RL trainers (``GRPOTrainer``, ``RLOOTrainer``, the experimental ``OnlineDPOTrainer`` and
``AsyncGRPOTrainer``): the contract between the sampler and the trainer, the match on the
HF-generate path, and the gap over the first generations.

Read from TRL 1.16's source (docs/rl.md has the details): the trainer scores completions with
``_get_per_token_logps_and_entropies``, a fused LM head inside ``accelerator.autocast()`` (the
head fp32 with autocast off under ``cast_lm_head_to_fp32``). The sampler is HF ``generate`` on the
same model *outside* autocast (``use_vllm=False``: storage dtypes, fp32 LoRA adapters, no log-probs
kept, no importance-sampling correction), continuous batching (``unwrapped_model.to(bf16)`` on the
live model, never cast back), or vLLM (the checkpoint's dtype, a float32 one run bfloat16;
``processed_logprobs``; PEFT adapters merged in place and synced; ``sampling_per_token_logps``
carried and corrected with ``vllm_importance_sampling_*``).

:mod:`.trl_rl_contract` builds the table per group, the sync path, the engine and the
truncation, with a
finding per mismatch and its fix in TRL's own arguments. :class:`RLWatch` runs on the trainer:
on the HF-generate path it reads the sampler's log-probs from ``generate``'s logits and, with
``match``, runs ``generate`` under the trainer's autocast (the fp32 head outside it, as the
trainer's); where TRL carries the engine's log-probs it reads those. The gap of the first
``steps`` generations (:mod:`hf_precision.watch.rl_gap`) goes to the ``rl_gap`` section of the
event JSON, W&B and TensorBoard.

Never proposed (each widens the gap): an fp32 head on one side only; an fp32 VLM trainer against
a bf16 engine; upcasting adapters TRL keeps bf16 on purpose (ZeRO-3). Nothing here imports TRL or
vLLM: the configuration is read from the trainer's ``args``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from ..base.wrapper_kinds import unwrap_model
from ..watch.rl_gap import (
    WARN_MEAN_ABS,
    GapRecord,
    GapWatch,
    GenerateTap,
    gap_record,
    outside_autocast,
    wrap_method,
)
from .trl_rl_contract import (
    autocast_dtype,
    config_value,
    contract,
    correction_of,
    is_rl_trainer,
    sampler_kind,
)

logger = logging.getLogger("hf_precision")

__all__ = ["RLWatch", "attach"]


def say(guard: Any, source: str, message: str, step: int, **kw: Any) -> None:
    """One RL finding through the engine's findings channel (console, precision.log, the
    ``<step>-<source>.json`` event, W&B and TensorBoard)."""
    from ..watch.finding import Finding

    guard.emit(Finding(source, kw.pop("severity", "warning"), message, **kw), step=step)


#: the trainer's inputs a re-score passes on (TRL 1.16's ``_compute_loss``)
# fmt: off
_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                 "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
                 "mm_token_type_ids", "image_position_ids")
# fmt: on


class RLWatch:
    """On a TRL RL trainer: the sampler's log-probs of the first ``steps`` generations against
    the trainer's, and (``match``) ``generate`` under the trainer's autocast.

    It wraps, on the instances only, the trainer's ``_generate_and_score_completions`` (whose
    output carries the completions and, with vLLM, the engine's ``sampling_per_token_logps`` and
    the trainer's ``old_per_token_logps``) and, on the HF-generate path, the unwrapped model's
    ``generate`` (asked for its raw logits). After the watched generations both come off, the
    ``generate`` wrapper stays while ``match`` is on (it then only enters the autocast)."""

    def __init__(
        self,
        trainer: Any,
        *,
        match: bool = False,
        steps: int = 2,
        on_done: Callable[[GapRecord | None], None] | None = None,
    ) -> None:
        self.trainer, self.match, self.on_done = trainer, match, on_done
        self.kind = sampler_kind(trainer.args)
        self.watch = GapWatch(steps)
        self.correction = correction_of(trainer.args)
        self.temperature = float(config_value(trainer.args, "temperature", 1.0) or 1.0)
        accelerator = getattr(trainer, "accelerator", None)
        model = trainer.model
        self.model = accelerator.unwrap_model(model) if accelerator is not None else model
        self.tap = GenerateTap(
            self.model, numerics=self.sampler_numerics, measuring=lambda: not self.watch.done
        )
        self._undo: list[Callable[[], None]] = []

    # -- wrapping -------------------------------------------------------------------------
    def attach(self) -> RLWatch:
        trainer = self.trainer
        score = getattr(trainer, "_generate_and_score_completions", None)
        if score is not None:
            self._undo.append(wrap_method(trainer, "_generate_and_score_completions", self._scored))
        if self.kind == "generate" and hasattr(self.model, "generate"):
            self.tap.attach()
        return self

    def detach(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        self.tap.detach()

    @contextmanager
    def sampler_numerics(self) -> Iterator[None]:
        """The trainer's numerics around ``generate`` when matching: its autocast, and TRL's
        fp32 head (``cast_lm_head_to_fp32``) outside it, as the fused head runs it."""
        if not self.match or autocast_dtype(self.trainer.args) is None:
            yield
            return
        accelerator = getattr(self.trainer, "accelerator", None)
        ctx = accelerator.autocast() if accelerator is not None else nullcontext()
        undo = None
        if config_value(self.trainer.args, "cast_lm_head_to_fp32", False):
            root: Any = unwrap_model(self.model)[0]
            head = root.get_output_embeddings()
            undo = wrap_method(head, "forward", outside_autocast)
        try:
            with ctx:
                yield
        finally:
            if undo is not None:
                undo()

    def _scored(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        output = original(*a, **kw)
        if self.watch.done:
            return output
        try:
            record = self.record(output)
        except Exception as err:  # a layout this watch does not know: say it, never break the run
            logger.info("hf-precision: RL gap not measured (%s: %s)", type(err).__name__, err)
            record = None
        self.tap.pending = None
        if record is not None:
            self.watch.add(record)
        else:
            self.watch.steps -= 1  # a generation it could not read does not count
        if self.watch.done:
            self.finish()
        return output

    def finish(self) -> None:
        """Report the watched generations (once) and take the measuring wrappers off."""
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        if not self.match:
            self.tap.detach()
        if self.on_done is not None:
            done, self.on_done = self.on_done, None
            done(self.watch.result())

    def close(self) -> None:
        """At the end of training: report what was watched, take every wrapper off."""
        self.finish()
        self.detach()

    # -- measuring ------------------------------------------------------------------------
    def record(self, output: dict[str, Any]) -> GapRecord | None:
        """The gap of one generation batch from ``_generate_and_score_completions``'s output."""
        ids, mask = output["completion_ids"], output["completion_mask"]
        sampling = output.get("sampling_per_token_logps")
        if sampling is not None:
            source = "engine log-probs (sampling_per_token_logps)"
        else:
            sampling = self.tap.completion_logps(ids, mask, self.temperature)
            if sampling is None:
                return None
            source = "generate logits"
        trainer = output.get("old_per_token_logps")
        if trainer is None:
            trainer = self.rescore(output)
        return gap_record(trainer, sampling, mask, correction=self.correction, source=source)

    def rescore(self, output: dict[str, Any]) -> torch.Tensor:
        """The trainer's log-probs of the completions: TRL's own
        ``_get_per_token_logps_and_entropies`` on the trained model, without gradients."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        extra = {k: output[k] for k in _FORWARD_KEYS if output.get(k) is not None}
        with torch.no_grad():
            logps, _, _ = self.trainer._get_per_token_logps_and_entropies(
                self.trainer.model,
                input_ids,
                attention,
                output["completion_ids"].size(1),
                **extra,
            )
        return logps


def attach(trainer: Any, guard: Any, *, rl: str = "auto", steps: int = 2) -> RLWatch | None:
    """The RL contract of ``trainer`` (a TRL RL trainer) into ``guard``'s ``rl_contract``
    section, its findings said, and an :class:`RLWatch` whose gap goes to the ``rl_gap``
    section and event. ``rl``: ``"auto"`` (match in the guard's fix mode), ``"match"``,
    ``"measure"`` (no match) or ``"off"``."""
    if rl == "off" or not is_rl_trainer(trainer):
        return None
    policy = getattr(guard, "policy", None)
    match = rl == "match" or (rl == "auto" and getattr(policy, "mode", "fix") == "fix")
    match = match and sampler_kind(trainer.args) == "generate"
    c = contract(trainer, match=match)
    guard.sections["rl_contract"] = c.to_dict()
    logger.info("hf-precision: RL contract\n%s", c.table())
    differs = {r.group: float(not r.matches) for r in c.rows}
    say(
        guard,
        "rl_contract",
        " ".join(c.findings) or f"{c.trainer}: the sampler computes as the trainer does.",
        0,
        severity="warning" if c.findings else "info",
        numbers={"mismatched": len(c.to_dict()["mismatched"]), "match": float(match)},
        groups=differs,
        measure="sampler differs from trainer (1 = differs)",
    )

    def done(result: GapRecord | None) -> None:
        if result is None:
            return
        guard.sections["rl_gap"] = numbers = {**result.to_dict(), "match": match}
        wide = result.mean_abs > WARN_MEAN_ABS and not match
        fix = (
            " Fix: PrecisionGuardCallback(rl='match') (generate under the trainer's autocast)."
            if wide and c.sampler == "generate"
            else ""
        )
        say(
            guard,
            "rl_gap",
            f"{c.trainer}: sampler-trainer gap over the first generations"
            f"{' (matched)' if match else ''}: {result.line()}.{fix}",
            int(getattr(trainer.state, "global_step", 0) or 0),
            severity="warning" if wide else "info",
            numbers=numbers,
        )

    return RLWatch(trainer, match=match, steps=steps, on_done=done).attach()
