"""The benchmark harness runs (``--quick`` smoke) and measures what it says; ratios themselves
are not asserted on CPU (the figures live in ``benchmarks/RESULTS.md``), except on a GPU."""

from __future__ import annotations

import doctest
import importlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed
from benchmarks import (
    audit,
    batch_cost,
    enforce_cost,
    gpu,
    rl_watch_cost,
    step_overhead,
    updates_cost,
)
from benchmarks.__main__ import main, table
from benchmarks.common import Figure, interleave
from benchmarks.models import build_meta, llava15_7b_config, qwen2_vl_72b_config


def _by_id(figures: list[Figure]) -> dict[str, Figure]:
    return {f.id: f for f in figures}


def test_interleave_rotates_arms_and_takes_median_ratios() -> None:
    order: list[str] = []
    runs = interleave(
        {
            "a": lambda: order.append("a"),
            "b": lambda: order.append("b"),
            "c": lambda: order.append("c"),
        },
        reps=3,
        warmup=0,
    )
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert len(runs.cpu["a"]) == 3 and len(runs.wall["c"]) == 3
    slow = interleave({"slow": lambda: sum(range(200000)), "fast": lambda: None}, reps=2)
    assert slow.ratio("slow", "fast") > 1


def test_full_size_configs_have_published_sizes() -> None:
    llava = build_meta(llava15_7b_config())
    assert round(sum(p.numel() for p in llava.parameters()) / 1e9, 2) == 7.06
    qwen = build_meta(qwen2_vl_72b_config())
    assert round(sum(p.numel() for p in qwen.parameters()) / 1e9, 1) == 73.4


def test_scan_records_rules_groups_and_errors() -> None:
    rows, largest, largest_type = audit.scan(["llava", "git", "no_such_model_type"])
    by_type = {r["model_type"]: r for r in rows}
    assert by_type["llava"]["rule"] == "llava" and by_type["llava"]["params_B"] > 7
    assert "language_model" in by_type["git"]["groups"] and by_type["git"]["audit_s"] > 0
    assert "error" in by_type["no_such_model_type"]
    assert largest_type == "llava" and largest is not None


def test_step_overhead_quick_installs_and_counts_guards() -> None:
    figs = _by_id(step_overhead.run(quick=True))
    boundary, leaf = figs["step_boundary"].detail, figs["step_leaf"].detail
    assert boundary["hooks"] >= 5 and leaf["hooks"] > boundary["hooks"]
    assert 0 < boundary["hooked_calls_per_step"] < leaf["hooked_calls_per_step"]
    assert boundary["hook_cost_us"] >= 0
    assert all(
        f.value is not None and math.isfinite(f.value) and f.value > 0 for f in figs.values()
    )


def test_updates_cost_quick_times_the_lost_update_sample() -> None:
    figs = _by_id(updates_cost.run(quick=True, reps=1))
    assert set(figs) == {"updates_watching", "updates_off", "updates_event_cost"}
    assert figs["updates_off"].detail["trainable_tensors"] > 5
    assert all(f.value is not None and f.value >= 0 for f in figs.values())


def test_fp8_gate_quick_times_the_token_check() -> None:
    pytest.importorskip("torchao")
    from benchmarks import fp8_gate

    figs = _by_id(fp8_gate.run(quick=True, reps=1))
    assert set(figs) == {"fp8_gate_step", "fp8_gate_hook", "fp8_gate_event"}
    assert figs["fp8_gate_step"].detail["fp8_linears"] == 14  # 2 layers x 7, the head kept out
    assert all(f.value is not None and f.value >= 0 for f in figs.values())


def test_fp8_step_quick_runs_on_the_cpu_and_its_manifest_matches() -> None:
    """The CPU path runs a step (its batch holds a multiple of 16 tokens, or the shape gate
    refuses it) and reports the ratio over the two instances' own floor."""
    pytest.importorskip("torchao")
    from benchmarks import fp8_step

    out = fp8_step.run(quick=True, reps=1)
    assert out["device"] == "cpu" and out["manifest_matches"] and out["adapters_in_fp8"] == []
    assert out["manifest"] == [
        "weights fp32, matmuls fp8 e4m3 tensorwise (torchao), 14 of 29 Linears"
    ]
    assert out["guard_over_floor"] == pytest.approx(out["ratio"] / out["instance_floor"], rel=1e-3)


def test_launcher_step_goes_through_the_plugin(monkeypatch: Any, tmp_path: Any) -> None:
    pytest.importorskip("diffusers")
    monkeypatch.chdir(tmp_path)  # the plugin reports into ./precision
    from accelerate.state import AcceleratorState, GradientState

    from benchmarks import launcher_step

    monkeypatch.delenv("HF_PRECISION_GUARD", raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    [fig] = launcher_step.run(quick=True, reps=1)
    AcceleratorState._reset_state(True)
    assert fig.id == "launcher_step_unet" and fig.value is not None and fig.value > 0
    assert fig.detail["optimizer_checks"] == 3  # warm-up 2 + 1 repetition: the plugin's hook
    assert "HF_PRECISION_GUARD" not in os.environ


def test_enforce_memory_is_measured_and_everything_cast() -> None:
    out = enforce_cost.measure_memory("bf16-true", quick=True)
    assert out["not_cast"] == 0
    assert out["largest_bytes"] == 4000 * 128 * 4  # the quick model's embedding, fp32
    assert out["method"] in ("VmHWM", "sampling") and out["extra_bytes"] >= 0


def test_batch_quick_casts_pixel_values() -> None:
    figs = _by_id(batch_cost.run(quick=True, reps=1))
    assert figs["batch_processor"].detail["pixel_values"][0] == 2
    assert figs["batch_stack"].value is not None


def test_gpu_benchmark_code_path_on_cpu() -> None:
    figs = _by_id(gpu.run(quick=True, reps=1, device="cpu"))
    detail = figs["gpu_lora_guard"].detail
    assert detail["mixed_groups"] == []  # LoRA adapters alone do not make a group mixed
    assert detail["hooks"] > 5 and detail["trainable_M"] > 0
    assert figs["gpu_lora_leaf"].detail["hooks"] > detail["hooks"]
    # Under autocast the only cast is the batch's: none on the LoRA linears, whose op autocast
    # runs in bf16 anyway (an fp32 upcast of every lora_B input would be undone at once).
    assert detail["guard_casts"] == {
        "batch -> LlavaForConditionalGeneration: float32 -> bfloat16": 1
    }


def test_cli_writes_json_and_prints_table(tmp_path: Any, capsys: Any) -> None:
    out = tmp_path / "results.json"
    assert main(["--quick", "--only", "batch", "--reps", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["machine"]["torch"] == torch.__version__
    assert {f["id"] for f in data["figures"]} == {"batch_processor", "batch_stack"}
    assert "batch_processor" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--only", "nonsense"])


@pytest.mark.parametrize("name", ["common", "models", "audit", "cli_startup"])
def test_module_examples_run(name: str) -> None:
    result = doctest.testmod(importlib.import_module(f"benchmarks.{name}"))
    assert result.attempted > 0 and result.failed == 0


def test_table_marks_missed_targets() -> None:
    text = table([Figure("x", "t", 1.2, 1.1), Figure("y", "u", 0.9, 1.0)])
    assert "MISSED" in text.splitlines()[2] and " ok " in text.splitlines()[3]


@pytest.mark.gpu
def test_gpu_lora_step_overhead() -> None:
    figs = _by_id(gpu.run(reps=15))
    guard = figs["gpu_lora_guard"]
    assert guard.value is not None and guard.value < 1.05, guard.detail
    assert guard.detail["hooks"] > 5


def test_silent_cost_quick_idle_blame_installs_nothing() -> None:
    from benchmarks import silent_cost

    figs = _by_id(silent_cost.run(quick=True))
    off, auto = figs["silent_blame_off"].detail, figs["silent_blame_auto"].detail
    armed, trace = figs["silent_blame_armed"].detail, figs["silent_trace"].detail
    # off and idle auto: the hooks the model has anyway (none of the blame's)
    assert off["hooks"] == auto["hooks"] < trace["hooks"] < armed["hooks"]
    assert trace["hooks"] - auto["hooks"] == trace["modules"]
    assert all(f.value is not None and f.value > 0 for f in figs.values())


def test_fp16_range_quick_times_the_guarded_fp16_step_and_the_probe() -> None:
    from benchmarks import fp16_range

    figs = _by_id(fp16_range.run(quick=True, reps=1))
    assert figs["fp16_step_guard"].value is not None
    assert figs["headroom_probe"].detail["modules"] > 20


def test_rl_watch_cost_quick_times_one_attribution_and_one_sync_check() -> None:
    figs = _by_id(rl_watch_cost.run(quick=True, reps=1))
    assert set(figs) == {"rl_attribution", "rl_sync_check"}
    assert figs["rl_attribution"].value > 0 and figs["rl_sync_check"].detail["frozen_tensors"] > 5
    assert set(figs["rl_attribution"].detail["groups_switched"]) >= {"lm_head", "norms"}
