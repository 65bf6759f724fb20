"""``hf_precision.integrations.ms_swift``: here without ms-swift (imports, builds like swift builds
callbacks, guards a real Trainer), and ``swift sft`` 4.6 in its own venv (``make
test-frameworks``) on a tiny LLaVA LoRA job (an fp32 checkpoint, no precision flag, 3 steps)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision import PrecisionGuardCallback
from hf_precision.integrations import ms_swift
from hf_precision.tiny import tiny_text_llama

NOTE = "fp16=True was set by ms-swift (from torch_dtype float32), not on your command line"
needs_launcher = pytest.mark.skipif(
    importlib.util.find_spec("hf_precision.integrations.launcher") is None,
    reason="hf_precision.integrations.launcher (the `hf-precision run` launcher) is not here yet",
)


# ------------------------------------------------------------------ without ms-swift


def test_imports_and_does_nothing_without_swift() -> None:
    if importlib.util.find_spec("swift") is not None:
        pytest.skip("ms-swift is installed here")
    assert ms_swift.install() is False
    assert ms_swift.flags_set_by_swift() == {}
    assert ms_swift.swift_flag_note() is None


def test_module_run_prints_its_own_path() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hf_precision.integrations.ms_swift"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == ms_swift.__file__ and Path(out).is_file()


def test_built_as_swift_builds_callbacks_it_guards_a_trainer(tiny_args: Any) -> None:
    from transformers import Trainer

    args = tiny_args()
    cb = ms_swift.SwiftPrecisionGuardCallback(args, None)  # swift: cls(args, trainer)
    assert isinstance(cb, PrecisionGuardCallback) and cb.policy is None  # inferred
    model = tiny_text_llama(torch.float32)
    model.requires_grad_(False)  # frozen: trainable half weights would keep their dtype
    model.model.layers[0].mlp.to(torch.bfloat16)  # a split the guard puts back together
    Trainer(model=model, args=args, callbacks=[cb])
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert cb.set_by_swift == {}  # swift never parsed arguments in this process


@pytest.mark.parametrize(
    ("value", "preset"),
    [("", None), ("auto", None), ("off", None), ("bf16", "bf16"), ("fp16-true", "fp16-true")],
)
def test_policy_from_the_environment(monkeypatch: Any, value: str, preset: str | None) -> None:
    monkeypatch.setenv("HF_PRECISION_GUARD", value)
    monkeypatch.setenv("HF_PRECISION_MODE", "audit")
    cb = ms_swift.SwiftPrecisionGuardCallback(None, None)
    if preset is None:
        assert cb.policy is None  # inferred from the Trainer
    else:
        assert cb.policy is not None and cb.policy.name == preset and cb.policy.mode == "audit"


def test_bad_policy_in_the_environment_names_the_variable(monkeypatch: Any) -> None:
    from hf_precision.errors import PrecisionError

    monkeypatch.setenv("HF_PRECISION_GUARD", "bf61")
    with pytest.raises(PrecisionError, match="HF_PRECISION_GUARD='bf61'"):
        ms_swift.SwiftPrecisionGuardCallback(None, None)


def test_flags_recorded_from_the_wrapped_method_only_when_left_unset() -> None:
    """``_recording`` wraps swift's ``_init_mixed_precision``: a flag that was None before and
    set after is swift's; a flag the user gave is not. (Run for real in the swift venv below.)"""

    class Args:
        torch_dtype = torch.float32

        def __init__(self, fp16: bool | None) -> None:
            self.fp16, self.bf16 = fp16, None

        def settle(self) -> None:  # swift's rule for torch_dtype float32/float16
            self.fp16 = True if self.fp16 is None else self.fp16
            self.bf16 = False if self.bf16 is None else self.bf16

    settle = ms_swift._recording(Args.settle)
    try:
        settle(Args(fp16=None))
        assert ms_swift.flags_set_by_swift() == {"fp16": True}
        assert ms_swift.flags_set_by_swift(Args(fp16=False)) == {}  # no longer on the args
        assert ms_swift.swift_flag_note().startswith(NOTE)  # type: ignore[union-attr]
        settle(Args(fp16=True))  # the user's --fp16 true
        assert ms_swift.flags_set_by_swift() == {}
        assert ms_swift.swift_flag_note() is None
    finally:
        ms_swift._SET_BY_SWIFT.clear()


# ------------------------------------------------------------------ swift sft, real


@pytest.fixture
def job(swift_venv: Any, tmp_path: Path) -> list[str]:
    """``swift sft`` arguments for the tiny LLaVA LoRA job (fp32 checkpoint, no --fp16/--bf16)."""
    argv = json.loads(swift_venv.fixtures("swift", tmp_path).read_text())
    return ["swift", "sft", *argv]


def _plugin(swift_venv: Any, tmp_path: Path) -> list[str]:
    path = swift_venv.run(
        [swift_venv.python, "-m", "hf_precision.integrations.ms_swift"], cwd=tmp_path
    ).stdout.strip()
    return ["--external_plugins", path, "--callbacks", "precision_guard"]


def _trained(proc: Any, tmp_path: Path, reports: Any) -> dict[str, Any]:
    assert proc.returncode == 0, reports.tail(proc)
    losses = [
        float(line.split("'loss': '")[1].split("'")[0])
        for line in proc.stdout.replace("\r", "\n").splitlines()
        if "'loss': '" in line
    ]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    report = reports.last(tmp_path / "out" / "precision")
    assert report["event"] == "on_train_end" and report["step"] == 3
    return report


@pytest.mark.frameworks
@pytest.mark.slow
def test_sft_with_the_plugin_names_the_flag_swift_set(
    swift_venv: Any, job: list[str], tmp_path: Path, reports: Any
) -> None:
    proc = swift_venv.run([*job, *_plugin(swift_venv, tmp_path)], cwd=tmp_path)
    report = _trained(proc, tmp_path, reports)
    assert NOTE in proc.stdout
    # swift's fp16=True reached the policy: frozen weights fp16, LoRA adapters fp32
    assert report["policy"]["frozen_dtype"] == "float16"
    assert report["policy"]["trainable_dtype"] == "float32"
    groups = report["dtype_map"]["groups"]
    assert groups["projector"]["numel"].keys() == groups["lm_head"]["numel"].keys() == {"float16"}


@pytest.mark.frameworks
@pytest.mark.slow
def test_sft_with_the_users_own_flag_is_not_attributed_to_swift(
    swift_venv: Any, job: list[str], tmp_path: Path, reports: Any
) -> None:
    proc = swift_venv.run([*job, "--fp16", "true", *_plugin(swift_venv, tmp_path)], cwd=tmp_path)
    report = _trained(proc, tmp_path, reports)
    assert "set by ms-swift" not in proc.stdout
    assert report["policy"]["frozen_dtype"] == "float16"


@pytest.mark.frameworks
@pytest.mark.slow
@needs_launcher
def test_sft_under_hf_precision_run(
    swift_venv: Any, job: list[str], tmp_path: Path, reports: Any
) -> None:
    proc = swift_venv.run(["hf-precision", "run", "--", *job], cwd=tmp_path)
    assert _trained(proc, tmp_path, reports)["policy"]["frozen_dtype"] == "float16"


@pytest.mark.frameworks
@pytest.mark.slow
@needs_launcher
def test_sft_under_the_environment_variable(
    swift_venv: Any, job: list[str], tmp_path: Path, reports: Any
) -> None:
    proc = swift_venv.run(job, cwd=tmp_path, HF_PRECISION_GUARD="auto")
    assert _trained(proc, tmp_path, reports)["policy"]["frozen_dtype"] == "float16"
