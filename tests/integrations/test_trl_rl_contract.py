"""The sampler-trainer contract of TRL's RL trainers (hf_precision.integrations.trl_rl_contract)
read from real ``GRPOConfig`` / ``RLOOConfig`` objects and real models, without vLLM installed (no
engine is built: the contract reads the configuration)."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_precision.integrations.trl_rl_contract import contract
from hf_precision.tiny import tiny_llava

trl = pytest.importorskip("trl", reason="TRL is in the 'integrations' test extra")
LM_ATTN = r".*language_model.*\.(q_proj|v_proj)"


def _config(tmp_path: Path, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)


def test_vllm_arguments_are_read_without_vllm(tmp_path: Path):
    """A one-sided fp32 head, truncation under importance sampling, the adapters merged in
    place: read from a real GRPOConfig and a PEFT model (no engine is built)."""
    model = get_peft_model(tiny_llava(torch.bfloat16), LoraConfig(r=2, target_modules=LM_ATTN))
    args = _config(tmp_path, use_vllm=True, bf16=True, cast_lm_head_to_fp32=True, top_p=0.9)
    c = contract(SimpleNamespace(args=args, model=model), name="GRPOTrainer")
    assert c.engine == {
        "kind": "vllm",
        "mode": "colocate",
        "dtype": "bfloat16",
        "checkpoint": "bfloat16",
        "logprobs": "processed_logprobs",
    }
    assert c.sync.startswith("merged in place")
    head = next(r for r in c.rows if r.group == "lm_head")
    assert (head.sampler, head.trainer, head.trainer_autocast) == ("bfloat16", "float32", False)
    text = "\n".join(c.findings)
    assert "Fix: cast_lm_head_to_fp32=False." in text  # never a one-sided fp32 head
    assert "Fix: top_p=1.0, top_k=0" in text
    assert c.correction == {"mode": "sequence_mask", "clip_min": None, "clip_max": 3.0}


def test_an_fp32_vlm_trainer_against_a_bf16_engine_is_never_the_fix(tmp_path: Path):
    model = tiny_llava(torch.float32)  # a float32 checkpoint: vLLM's "auto" runs it bfloat16
    c = contract(
        SimpleNamespace(args=_config(tmp_path, use_vllm=True, bf16=False), model=model),
        name="GRPOTrainer",
    )
    (finding,) = c.findings
    assert "computes float32 against a bfloat16 engine" in finding and "Fix: bf16=True" in finding
    cb = _config(tmp_path, use_transformers_continuous_batching=True, bf16=True)
    c = contract(SimpleNamespace(args=cb, model=tiny_llava(torch.float32)), name="RLOOTrainer")
    assert c.sampler == "continuous_batching" and "cast in place" in c.sync
    (finding,) = c.findings
    assert "Fix: use_transformers_continuous_batching=False." in finding
