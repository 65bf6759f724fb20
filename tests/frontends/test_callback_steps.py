"""The step events of PrecisionGuardCallback (:mod:`hf_precision.frontends.callback_steps`), on a
real Trainer: the first step's dtype trace, the lost-update check on the Trainer's own
optimizer, and the verify before an in-training evaluation."""

from __future__ import annotations

import json
from pathlib import Path

from hf_precision import PrecisionGuardCallback
from hf_precision.frontends.callback_steps import CallbackSteps
from hf_precision.tiny import tiny_batch, tiny_llava


def test_trace_lost_updates_and_the_evaluation_verify_on_a_real_trainer(make_trainer):
    model = tiny_llava(seed=0)
    callback = PrecisionGuardCallback("fp32", trace=True)
    assert isinstance(callback, CallbackSteps)
    trainer = make_trainer(
        model,
        tiny_batch(model, 2),
        callbacks=[callback],
        max_steps=3,
        eval_strategy="steps",
        eval_steps=2,
    )
    trainer.train()
    assert callback.trace_result is not None and callback._tracer is None  # first step only
    assert callback._lost is not None and not callback._lost.active  # three steps watched
    assert callback._lost.root is model
    events = [event for event, _ in callback.events]
    # each in-training evaluation (step 2, and transformers' last step) verified before it
    assert events.count("before_evaluate") == events.count("on_evaluate") >= 1
    assert events.index("before_evaluate") == events.index("on_evaluate") - 1
    folder = Path(trainer.args.output_dir) / "precision"
    [lost] = folder.glob("*-lost_updates.json")
    section = json.loads(lost.read_text())["lost_updates"]
    assert section["steps"] == 3 and section["half_share"] == 0.0  # fp32: nothing to lose
    assert callback.guard is not None and callback.guard.sections["lost_updates"] == section


def test_off_watches_no_optimizer(make_trainer):
    model = tiny_llava(seed=0)
    callback = PrecisionGuardCallback("fp32", lost_updates="off")
    make_trainer(model, tiny_batch(model, 2), callbacks=[callback], max_steps=1).train()
    assert callback._lost is None
