"""Who chose the precision: a real launcher run with ACCELERATE_MIXED_PRECISION set, real
TrainingArguments (transformers' own resolution of the variable against the script's flags),
real PEFT adapters, a DeepSpeed JSON and what a framework adapter records."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_precision import PrecisionGuardCallback
from hf_precision.integrations import launch_config
from hf_precision.tiny import tiny_llava
from hf_precision.watch import provenance
from hf_precision.watch.provenance import precision_provenance

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integrations" / "launched_trainer.py"


@pytest.mark.slow
def test_a_launcher_run_names_the_variable_that_chose(tmp_path):
    """The script passes neither bf16 nor fp16; ACCELERATE_MIXED_PRECISION=bf16 makes
    TrainingArguments.mixed_precision 'bf16' and the Trainer's Accelerator autocast in it."""
    import os

    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in launch_config.ENV_VARS}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        ACCELERATE_MIXED_PRECISION="bf16",
    )
    cmd = [sys.executable, "-m", "hf_precision.tools.cli", "run", "--", sys.executable, str(SCRIPT)]
    proc = subprocess.run([*cmd, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = "precision: bf16 autocast — ACCELERATE_MIXED_PRECISION=bf16 chose it"
    lines = [x for x in proc.stderr.splitlines() if said in x]
    assert lines and "the script set neither bf16 nor fp16" in lines[0], proc.stderr[-3000:]
    # the launcher's own line repeats it
    assert any(x.startswith("hf-precision: precision guard on for") for x in lines)
    found = json.loads((out / "precision" / "000000-on_init_end.json").read_text())["provenance"]
    assert found["chosen_by"] == "ACCELERATE_MIXED_PRECISION"
    assert found["asked"] == {"bf16": False, "fp16": False}
    assert found["resolved"] == "bf16"  # transformers' own args.mixed_precision
    components = {c["component"]: c["set"] for c in found["components"]}
    assert components["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert components["HF_PRECISION_GUARD"] == "auto"  # hf-precision run's own variable


def test_the_scripts_flag_beats_the_variable(tiny_args, monkeypatch, make_trainer, caplog):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    args = tiny_args(bf16=True)
    assert args.mixed_precision == "bf16"  # transformers: the flag wins over the variable
    found = precision_provenance(args)
    assert found["chosen_by"] == "script" and found["notable"]
    assert found["line"].startswith(
        "precision: bf16 — the script's bf16=True overrode ACCELERATE_MIXED_PRECISION=fp16"
    )
    model = tiny_llava(seed=0)
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    cb = PrecisionGuardCallback()
    with caplog.at_level(logging.WARNING, logger="hf_precision"):
        make_trainer(model, batch, callbacks=[cb], bf16=True)
    assert "overrode ACCELERATE_MIXED_PRECISION=fp16" in caplog.records[0].getMessage()
    assert cb.guard is not None and cb.guard.sections["provenance"]["chosen_by"] == "script"


def test_nothing_notable_without_other_components(tiny_args):
    found = precision_provenance(tiny_args(bf16=True), environ={})
    assert found == {
        "asked": {"bf16": True, "fp16": False},
        "resolved": "bf16",
        "components": [],
        "chosen_by": "script",
        "line": "precision: bf16 — the script's bf16=True",
        "notable": False,
    }


def test_a_deepspeed_json_and_unsloth_are_named():
    args = SimpleNamespace(
        bf16=False, fp16=False, mixed_precision="no", deepspeed={"fp16": {"enabled": True}}
    )
    found = precision_provenance(args, environ={"UNSLOTH_FORCE_FLOAT32": "1"})
    assert found["chosen_by"] == "DeepSpeed JSON"
    assert found["line"].startswith("precision: fp16 — the DeepSpeed JSON's fp16 section")
    assert {c["component"] for c in found["components"]} == {
        "DeepSpeed JSON",
        "UNSLOTH_FORCE_FLOAT32",
    }


def test_a_framework_that_set_a_flag_by_itself_wins(tiny_args):
    args = tiny_args(fp16=False)
    args.fp16 = True  # as axolotl's `bf16: auto` leaves the arguments on a GPU without bf16
    provenance.record("axolotl", {"fp16": True}, "`bf16: auto` found no bf16 GPU")
    try:
        found = precision_provenance(args, environ={})
    finally:
        provenance.record("axolotl", {})
    assert found["chosen_by"] == "axolotl"
    assert "axolotl set fp16=True by itself (`bf16: auto` found no bf16 GPU)" in found["line"]
    assert precision_provenance(args, environ={})["chosen_by"] == "script"  # forgotten


def test_peft_adapter_dtypes_against_the_base(tiny_args):
    from peft import LoraConfig, get_peft_model

    base = tiny_llava(seed=0).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    found = precision_provenance(tiny_args(), model, environ={})
    [peft] = [c for c in found["components"] if c["component"].startswith("PEFT")]
    assert set(peft["set"]["adapter_dtypes"]) == {"float32"}  # autocast_adapter_dtype=True
    assert set(peft["set"]["base_dtypes"]) == {"bfloat16"}
    assert found["notable"]


def test_what_ms_swift_set_by_itself_is_named(tiny_args):
    """ms-swift's adapter wraps swift's ``_init_mixed_precision`` (``_recording``): a flag it
    filled in is recorded as swift's (run for real under swift in tests/integrations)."""
    from hf_precision.integrations import ms_swift

    class Args:
        torch_dtype = torch.float32

        def __init__(self, fp16: bool | None) -> None:
            self.fp16, self.bf16 = fp16, None

        def settle(self) -> None:  # swift's rule for torch_dtype float32
            self.fp16 = True if self.fp16 is None else self.fp16
            self.bf16 = False if self.bf16 is None else self.bf16

    settle = ms_swift._recording(Args.settle)
    args = tiny_args()
    args.fp16 = True  # what swift hands the Trainer
    try:
        settle(Args(fp16=None))
        found = precision_provenance(args, environ={})
        assert found["chosen_by"] == "ms-swift"
        assert found["line"] == (
            "precision: fp16 — ms-swift set fp16=True by itself (from torch_dtype float32; "
            "--fp16/--bf16 were left unset), not the user"
        )
        settle(Args(fp16=True))  # the user's --fp16 true
        assert precision_provenance(args, environ={})["chosen_by"] == "script"
    finally:
        ms_swift._SET_BY_SWIFT.clear()
        provenance.record("ms-swift", {})
