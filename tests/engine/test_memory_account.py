"""The memory account: exact bytes per precision decision on a real tiny LLaVA, in the setup's
console line and in every event's JSON."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from hf_precision import PrecisionGuardCallback, enforce_policy
from hf_precision.engine.memory_account import account_line, memory_account
from hf_precision.tiny import tiny_llava


def _split_bf16():
    """A bf16 checkpoint, vision tower frozen, the rest trained."""
    model = tiny_llava(seed=0).to(torch.bfloat16)
    model.model.vision_tower.requires_grad_(False)
    return model


def test_bytes_of_each_decision_are_exact():
    model = _split_bf16()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report = enforce_policy(model, "bf16")  # trainables bf16 -> fp32, frozen stay bf16
    account = memory_account(report, model)
    up = [c for c in report.changes if c.kind == "param"]
    assert account["decisions"]["trainable upcast"] == {"count": len(up), "bytes": 2 * trainable}
    # the rotary tables: recomputed in float32 (4 - 2 bytes each element) and kept there
    rotary = {n: b for n, b in model.named_buffers() if "inv_freq" in n}
    assert account["decisions"]["buffers upcast"] == {
        "count": len(rotary),
        "bytes": sum(b.numel() * 2 for b in rotary.values()),
    }
    assert account["kept_fp32"]["rotary"] == {
        "count": len(rotary),
        "bytes": sum(b.numel() * 2 for b in rotary.values()),
    }
    assert account["kept_fp32_versus"] == "bfloat16"
    assert account["guards_bytes"] == 0 and account["stash_host_bytes"] == 0
    # the alternative: keeping them bf16 saves the upcast, four times over with AdamW's state
    assert account["alternative"]["bytes"] == -2 * trainable
    assert account["alternative"]["with_grads_and_adamw_bytes"] == -8 * trainable
    line = account_line(account)
    assert f"trainable upcast {len(up)} tensor(s) +" in line and "guards 0 B" in line


def test_half_trainables_are_weighed_against_fp32():
    model = tiny_llava(seed=0).to(torch.bfloat16)
    report = enforce_policy(model, "bf16-true", mode="audit")
    account = memory_account(report, model)
    half = sum(p.numel() for p in model.parameters())
    assert account["alternative"]["bytes"] == 2 * half
    assert account["alternative"]["with_grads_and_adamw_bytes"] == 8 * half
    assert "fp32 trainable weights instead of the" in account_line(account)


def test_the_setup_line_and_every_event_json_carry_it(make_trainer, caplog):
    model = _split_bf16()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cb = PrecisionGuardCallback()
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    with caplog.at_level(logging.WARNING, logger="hf_precision"):
        trainer = make_trainer(model, batch, callbacks=[cb], bf16=True, bf16_full_eval=True)
    [line] = [r.getMessage() for r in caplog.records if "hf-precision: memory:" in r.getMessage()]
    assert f"+{2 * trainable / 1024:.1f} KiB" in line
    # the stash: CPU copies of every tensor bf16_full_eval would round (not bf16 now)
    stash = sum(
        t.numel() * t.element_size()
        for t in [*model.parameters(), *model.buffers()]
        if t.is_floating_point() and t.dtype != torch.bfloat16
    )
    assert cb.guard is not None and cb.guard.stash_bytes == stash > 0
    cb.on_train_end(trainer.args, trainer.state, trainer.control, model=model)
    folder = Path(trainer.args.output_dir) / "precision"
    first = json.loads((folder / "000000-on_init_end.json").read_text())["memory"]
    last = json.loads(next(folder.glob("*on_train_end.json")).read_text())["memory"]
    assert first["decisions"]["trainable upcast"]["bytes"] == 2 * trainable
    assert first["stash_host_bytes"] == 0  # written before the stash was made
    assert last["decisions"] == first["decisions"] and last["stash_host_bytes"] == stash
