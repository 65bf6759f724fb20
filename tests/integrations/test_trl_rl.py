"""TRL's RL trainers (hf_precision.integrations.trl_rl): a real ``trl.GRPOTrainer``
(``use_vllm=False``) with a real reward function on the tiny LLaVA, through the callback: the
contract per group, the gap of the first generation read from ``generate``'s logits, and the match
that closes it; the vLLM / continuous-batching contract read from real ``GRPOConfig``s without
vLLM installed."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_precision import PrecisionGuardCallback
from hf_precision.errors import PrecisionError
from hf_precision.integrations.trl_rl_contract import contract
from hf_precision.tiny import tiny_llava, tiny_llava_processor
from hf_precision.tiny.data import shape_image

trl = pytest.importorskip("trl", reason="TRL is in the 'integrations' test extra")
LM_ATTN = r".*language_model.*\.(q_proj|v_proj)"


def _reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A local reward function: longer completions score higher."""
    return [float(len(str(c))) for c in completions]


def _data() -> Any:
    from datasets import Dataset

    ask = [{"type": "image"}, {"type": "text", "text": "what is in the image ?"}]
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": ask}], "image": shape_image(s, c)}
            for s, c in [("circle", "red"), ("square", "blue")]
        ]
    )


def _grpo(tmp_path: Path, setup: str, rl: str, **kw: Any) -> tuple[Any, Any]:
    """One GRPO step (one generation of 2 x 2 completions, 8 tokens) on the tiny LLaVA: ``lora``
    (a bf16 base, adapters as after some training: ``init_lora_weights=False``) or ``full``
    (an fp32 model, bf16 autocast); returns the trainer and the callback."""
    model = tiny_llava(torch.bfloat16 if setup == "lora" else torch.float32)
    peft = LoraConfig(r=4, target_modules=LM_ATTN, init_lora_weights=False)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=True,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        beta=0.0,
        report_to=kw.pop("report_to", []),
        save_strategy="no",
        disable_tqdm=True,
        **kw,
    )
    cb = PrecisionGuardCallback(rl=rl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the findings channel is logging: still said
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=[_reward],
            args=args,
            train_dataset=_data(),
            processing_class=tiny_llava_processor(),
            peft_config=peft if setup == "lora" else None,
            callbacks=[cb],
        )
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
    _data().to_parquet(str(tmp_path / "data" / "train.parquet"))
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
