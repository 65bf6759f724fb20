"""TRL's RL trainers (hf_precision.integrations.trl_rl): a real ``trl.GRPOTrainer``
(``use_vllm=False``) with a real reward function on the tiny LLaVA, through the callback: the
contract per group, the gap of the first generation read from ``generate``'s logits, and the match
that closes it; the vLLM / continuous-batching contract read from real ``GRPOConfig``s without
vLLM installed (tests/integrations/test_trl_rl_contract.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig

from hf_precision import PrecisionGuardCallback
from hf_precision.errors import PrecisionError
from hf_precision.tiny import tiny_llava, tiny_llava_processor
from hf_precision.tiny.rl import image_prompts, tiny_grpo

trl = pytest.importorskip("trl", reason="TRL is in the 'integrations' test extra")
LM_ATTN = r".*language_model.*\.(q_proj|v_proj)"


def _grpo(tmp_path: Path, setup: str, rl: str, **kw: Any) -> tuple[Any, Any]:
    """One GRPO step (one generation of 2 x 2 completions, 8 tokens) on the tiny LLaVA: ``lora``
    (a bf16 base, adapters as after some training: ``init_lora_weights=False``) or ``full``
    (an fp32 model, bf16 autocast); returns the trainer and the callback."""
    model = tiny_llava(torch.bfloat16 if setup == "lora" else torch.float32)
    peft = LoraConfig(r=4, target_modules=LM_ATTN, init_lora_weights=False)
    cb = PrecisionGuardCallback(rl=rl)
    trainer = tiny_grpo(
        tmp_path, model, callbacks=[cb], peft_config=peft if setup == "lora" else None, **kw
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the findings channel is logging: still said
        trainer.train()
    return trainer, cb


def _event(tmp_path: Path, name: str) -> dict[str, Any]:
    (path,) = (tmp_path / "precision").glob(f"*-{name}.json")
    return json.loads(path.read_text())


def test_lora_on_a_bf16_base_the_adapters_make_the_gap_and_match_closes_it(
    tmp_path: Path, said: Any
):
    trainer, cb = _grpo(tmp_path / "measure", "lora", "measure", report_to=["tensorboard"])
    rows = {r["group"]: r for r in cb.guard.sections["rl_contract"]["rows"]}
    assert rows["adapters"] == {
        "group": "adapters",
        "storage": "float32",
        "sampler": "float32",
        "trainer": "bfloat16",
        "trainer_autocast": True,
        "matmul": "-",
        "note": "",
    }
    assert cb.guard.sections["rl_contract"]["mismatched"] == ["adapters"]
    (finding,) = said.about("generate() samples outside autocast")
    assert "adapters float32 vs bfloat16" in finding and "rl='match'" in finding
    contract_event = _event(tmp_path / "measure", "rl_contract")
    assert contract_event["finding"]["groups"] == {
        "vision_encoder": 0.0,
        "projector": 0.0,
        "language_model": 0.0,
        "adapters": 1.0,
        "lm_head": 0.0,
    }
    before = _event(tmp_path / "measure", "rl_gap")["rl_gap"]
    assert before["source"] == "generate logits" and before["tokens"] == 16
    assert before["mean_abs"] > 1e-4 and before["max_abs"] >= before["mean_abs"]
    assert before["correction"]["mode"] == "sequence_mask" and before["corrected_share"] == 0.0
    # TRL's adapters stay as TRL keeps them (fp32), and no wrapper is left on the model
    lora = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    assert "generate" not in vars(trainer.model)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (tmp_path / "measure").rglob("events.out.tfevents*")}
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    (point,) = acc.Scalars("precision/rl_gap/mean_abs")
    assert point.value == pytest.approx(before["mean_abs"], rel=1e-5)

    said.lines.clear()
    _, cb2 = _grpo(tmp_path / "match", "lora", "auto")  # fix mode: match
    after = _event(tmp_path / "match", "rl_gap")["rl_gap"]
    assert after["match"] is True and before["match"] is False
    assert after["mean_abs"] < before["mean_abs"] / 100
    assert cb2.guard.sections["rl_contract"]["mismatched"] == []
    assert not said.about("samples outside autocast")
    assert said.about("sampler-trainer gap over the first generations (matched)")


def test_full_fine_tune_every_group_differs_until_matched(tmp_path: Path):
    _, cb = _grpo(tmp_path / "measure", "full", "measure")
    c = cb.guard.sections["rl_contract"]
    assert c["mismatched"] == ["vision_encoder", "projector", "language_model", "lm_head"]
    head = next(r for r in c["rows"] if r["group"] == "lm_head")
    assert (head["sampler"], head["trainer"]) == ("float32", "bfloat16")
    before = cb.guard.sections["rl_gap"]["mean_abs"]
    _, cb2 = _grpo(tmp_path / "match", "full", "match")
    assert cb2.guard.sections["rl_gap"]["mean_abs"] < before / 100
    _, off = _grpo(tmp_path / "off", "full", "off")
    assert "rl_gap" not in off.guard.sections and "rl_contract" not in off.guard.sections


def test_rl_option_is_checked():
    with pytest.raises(PrecisionError, match="rl='sometimes'"):
        PrecisionGuardCallback(rl="sometimes")


@pytest.mark.slow
def test_the_launcher_reaches_trls_grpo_cli(tmp_path: Path):
    """``hf-precision run -- trl grpo ...``: TRL's own GRPO script (a model path, a local
    parquet dataset with images, TRL's ``think_format_reward``, LoRA, one step) gets the
    contract and the gap, matched (the launcher's guard is in fix mode)."""
    import os
    import subprocess
    import sys

    trl_cli = Path(sys.executable).parent / "trl"
    if not trl_cli.is_file():
        pytest.skip("TRL's CLI is not installed in this environment")
    tiny_llava(seed=0).save_pretrained(tmp_path / "model")
    tiny_llava_processor(str(tmp_path / "model"))
    (tmp_path / "data").mkdir()
    image_prompts().to_parquet(str(tmp_path / "data" / "train.parquet"))
    out = tmp_path / "out"
    args = [
        "--model_name_or_path",
        str(tmp_path / "model"),
        "--dataset_name",
        str(tmp_path / "data"),
    ]
    args += ["--reward_funcs", "think_format_reward", "--output_dir", str(out), "--max_steps", "1"]
    args += ["--per_device_train_batch_size", "2", "--num_generations", "2", "--beta", "0"]
    args += ["--max_completion_length", "4", "--use_cpu", "--report_to", "none"]
    args += ["--save_strategy", "no", "--disable_tqdm", "true", "--use_peft"]
    args += ["--lora_target_modules", "q_proj", "v_proj"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_PRECISION")}
    root = Path(__file__).resolve().parents[2]
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.update(HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
    env["PATH"] = f"{trl_cli.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    cmd = [sys.executable, "-m", "hf_precision.tools.cli", "run", "--", str(trl_cli), "grpo"]
    proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (contract_file,) = (out / "precision").glob("*-rl_contract.json")
    rows_ = json.loads(contract_file.read_text())["rl_contract"]
    assert rows_ == {"mismatched": 0, "match": 1.0}
    (gap_file,) = (out / "precision").glob("*-rl_gap.json")
    gap = json.loads(gap_file.read_text())["rl_gap"]
    assert gap["match"] is True and gap["tokens"] > 0 and gap["source"] == "generate logits"
