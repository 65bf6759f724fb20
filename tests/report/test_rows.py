"""The rows of an event: drift against the policy and since the last event, the mismatch
counts, the sections' numbers (the module table: tests/report/test_reporter.py)."""

from __future__ import annotations

import torch

from hf_precision import PrecisionPolicy, dtype_map, enforce_policy
from hf_precision.report.rows import drift_rows, mismatch_counts, section_scalars
from hf_precision.tiny import tiny_llava


def test_drift_rows_say_what_the_guard_cast_and_what_moved_since_the_last_event() -> None:
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16).requires_grad_(False)
    before = dtype_map(model)
    report = enforce_policy(model, PrecisionPolicy.from_preset("fp32"))
    diff = before.diff(dtype_map(model))
    rows = drift_rows("setup", 4, report, diff, "on_init_end")
    cast = [r for r in rows if r["mismatch"]]
    moved = [r for r in rows if not r["mismatch"]]
    assert len(cast) == len(report.changes) == len(list(model.model.vision_tower.parameters()))
    assert {(r["before"], r["after"], r["repaired"]) for r in cast} == {
        ("float16", "float32", True)
    }
    assert moved and {r["reason"] for r in moved} == {"map changed since on_init_end"}
    assert all(r["kind"] == "module" and r["step"] == 4 for r in moved)
    assert mismatch_counts(report) == {"found": len(cast), "repaired": len(cast), "open": 0}


def test_section_scalars_flatten_numbers_and_leave_lists_and_bools() -> None:
    sections = {"lost updates": {"share": 0.5, "names": ["a"], "ok": True}, "memory": {"b": 3}}
    assert section_scalars(sections) == {
        "precision/lost_updates/share": 0.5,
        "precision/memory/b": 3,
    }
