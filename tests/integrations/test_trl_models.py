"""hf_precision/integrations/trl_models.py: the other models a TRL trainer runs (its reference model
here) get the callback's policy, guards and report, on the real DPOTrainer."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import PrecisionGuardCallback
from hf_precision.engine.hooks import installed_guards
from hf_precision.integrations.trl_models import trainer_models


def _tests_trl() -> ModuleType:
    """tests/test_trl.py: its tiny-LLaVA SFT/DPO helpers (datasets, processor, config)."""
    path = Path(__file__).resolve().parents[1] / "test_trl.py"
    spec = importlib.util.spec_from_file_location("hf_precision_tests_trl", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trainer_models_reads_attributes_then_init_arguments():
    ref, late, reward, teacher = (nn.Linear(2, 2) for _ in range(4))
    early = SimpleNamespace(reward_funcs=[len, reward, "a-model-name"])
    # at on_init_end: DPOTrainer has not stored its ref_model yet, its __init__ argument has it
    assert trainer_models(early, {"ref_model": ref, "teacher_model": "a-name"}) == {
        "ref_model": ref,
        "reward_funcs.1": reward,
    }
    later = SimpleNamespace(ref_model=late, teacher_model=teacher)  # the attribute wins
    assert trainer_models(later, {"ref_model": ref}) == {
        "ref_model": late,
        "teacher_model": teacher,
    }
    assert trainer_models(SimpleNamespace()) == {}


def test_the_adapter_imports_without_trl():
    code = (
        "import sys; sys.modules['trl'] = None\n"  # import trl raises
        "from hf_precision.integrations.trl_models import trainer_models\n"
        "assert 'trl' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _split_ref() -> Any:
    """A reference model loaded separately, split: tower fp32 (another checkpoint), LM bf16."""
    from hf_precision.tiny import tiny_llava

    ref = tiny_llava(torch.bfloat16)
    ref.model.vision_tower.float()
    ref.requires_grad_(False)
    return ref


def _dpo(tt: ModuleType, tmp_path: Path, callbacks: list[Any], **kw: Any) -> Any:
    """DPO with LoRA on a tiny LLaVA loaded whole in bf16 (it runs without the guard), and a
    separately loaded split reference model, no precision flag."""
    from hf_precision.tiny import tiny_llava

    return tt._trainer(
        "DPO",
        tmp_path,
        tiny_llava(torch.bfloat16),
        tt._preferences(),
        callbacks,
        bf16=False,
        trainer_kw={"ref_model": _split_ref()},
        **kw,
    )


def _ref_frames(excinfo: pytest.ExceptionInfo[BaseException]) -> bool:
    return any("ref_model" in str(entry.statement) for entry in excinfo.traceback)


def test_dpo_reference_model_gets_the_policy_guards_and_report(tmp_path: Path):
    pytest.importorskip("trl")
    tt = _tests_trl()
    # without the guard the reference forward fails (no autocast: fp32 tower, bf16 projector)
    with pytest.raises(RuntimeError, match="same dtype") as excinfo:
        _dpo(tt, tmp_path / "bare", []).train()
    assert _ref_frames(excinfo)
    cb = PrecisionGuardCallback()
    trainer = _dpo(tt, tmp_path / "guarded", [cb])
    ref = trainer.ref_model
    # guarded at on_init_end, from DPOTrainer.__init__'s argument (stored only after it)
    assert ref.model.vision_tower.embeddings.patch_embedding.weight.dtype == torch.bfloat16
    out = trainer.train()
    assert torch.isfinite(torch.tensor(out.training_loss))
    assert cb.policy is not None and cb.policy.name == "bf16-true"
    frozen = {p.dtype for p in trainer.model.parameters() if not p.requires_grad}
    assert {p.dtype for p in ref.parameters()} == frozen == {torch.bfloat16}
    assert installed_guards(ref) > 0 and list(cb.trainer_guards) == ["ref_model"]
    events = [e for e, _ in cb.trainer_guards["ref_model"].events]
    assert events[:2] == ["on_init_end.ref_model", "on_train_begin.ref_model"]
    # its own report files, beside the policy model's
    report = tmp_path / "guarded" / "precision"
    first = json.loads((report / "000000-on_init_end.ref_model.json").read_text())
    assert first["event"] == "on_init_end.ref_model" and first["mismatches"]["found"] > 0
    groups = first["dtype_map"]["groups"]
    assert {g: sorted(groups[g]["numel"]) for g in ("vision_encoder", "language_model")} == {
        "vision_encoder": ["bfloat16"],
        "language_model": ["bfloat16"],
    }
    assert (report / "000000-on_init_end.json").is_file()  # the policy model's own


def _dpo_config(out: Path, **kw: Any) -> Any:
    """One DPO step on CPU, no flag (the tests plant the dtypes), nothing saved or logged."""
    import trl

    return trl.DPOConfig(
        output_dir=str(out),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        bf16=False,
        max_length=None,
        **kw,
    )


def _text_dpo(tmp_path: Path, callbacks: list[Any]) -> Any:
    """DPO on a tiny text Llama with ``precompute_ref_log_probs=True`` (TRL refuses it for
    vision datasets), a reference loaded separately with its embeddings in fp32."""
    import trl
    from datasets import Dataset
    from peft import LoraConfig

    from hf_precision.tiny import tiny_llava_processor, tiny_text_llama

    ref = tiny_text_llama(torch.bfloat16)
    ref.model.embed_tokens.float()  # fp32 embeddings feed the bf16 layers: no autocast, a crash
    ref.requires_grad_(False)
    pairs = [
        {"prompt": "what is in the image ?", "chosen": f"a {c} circle", "rejected": f"a {c} square"}
        for c in ("red", "blue", "green", "yellow")
    ]
    config = _dpo_config(tmp_path, precompute_ref_log_probs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.DPOTrainer(
            model=tiny_text_llama(torch.bfloat16),
            ref_model=ref,
            args=config,
            train_dataset=Dataset.from_list(pairs),
            processing_class=tiny_llava_processor().tokenizer,
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
            callbacks=callbacks,
        )


def test_dpo_precompute_runs_the_reference_inside_init_guarded(tmp_path: Path):
    """``precompute_ref_log_probs=True`` runs the reference model inside ``DPOTrainer.__init__``
    right after ``on_init_end``: the guard reached it there, through ``__init__``'s argument."""
    pytest.importorskip("trl")
    with pytest.raises(RuntimeError, match="same dtype"):
        _text_dpo(tmp_path / "bare", [])
    cb = PrecisionGuardCallback(report=False)
    trainer = _text_dpo(tmp_path / "guarded", [cb])
    assert trainer.ref_model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.isfinite(torch.tensor(trainer.train_dataset["ref_chosen_logps"])).all()
    assert torch.isfinite(torch.tensor(trainer.train().training_loss))


def test_a_reference_model_trl_loads_itself_is_guarded_from_train_begin(tmp_path: Path):
    """No ``ref_model`` and no PEFT: DPOTrainer loads the reference from the policy's path after
    ``on_init_end``; the guard reaches it at ``on_train_begin``."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from hf_precision.tiny import tiny_llava_processor, tiny_text_llama

    tiny_text_llama().save_pretrained(tmp_path / "policy")
    pairs = [{"prompt": "a red", "chosen": " circle", "rejected": " square"}] * 2
    config = _dpo_config(tmp_path / "out")
    cb = PrecisionGuardCallback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.DPOTrainer(
            model=str(tmp_path / "policy"),
            args=config,
            train_dataset=Dataset.from_list(pairs),
            processing_class=tiny_llava_processor().tokenizer,
            callbacks=[cb],
        )
    assert trainer.ref_model is not None and cb.trainer_guards == {}  # not there at init end
    trainer.train()
    assert installed_guards(trainer.ref_model) > 0
    events = [e for e, _ in cb.trainer_guards["ref_model"].events]
    assert events[0] == "on_train_begin.ref_model"
    assert (tmp_path / "out" / "precision" / "000000-on_train_begin.ref_model.json").is_file()
