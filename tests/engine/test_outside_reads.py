"""Weights read outside their module: TRL's fused LM head (a real SFTTrainer), Liger's fused
linear cross-entropy (a stand-in: its Triton kernel cannot run here), Gemma 3's raw-parameter
projector (a real tiny Gemma3ForConditionalGeneration)."""

from __future__ import annotations

import json
import logging
import math
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import PrecisionError, PrecisionGuardCallback, PrecisionWarning


def _count_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    return calls


def _events(report_dir: Path) -> dict[str, Any]:
    return {
        json.loads(p.read_text())["event"]: json.loads(p.read_text())
        for p in report_dir.glob("*.json")
    }


# ------------------------------------------------------------------------- TRL's fused LM head


def test_trl_sft_fused_head_is_said_in_the_report_and_the_console(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """TRL 1.16's SFTTrainer patches the model's forward with its fused LM head after
    ``Trainer.__init__``: ``lm_head``'s pre-hook is called 0 times in training. The guard finds
    the patch at ``on_train_begin`` and says so (report JSON and one console line)."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from peft import LoraConfig

    from hf_precision.tiny import tiny_llava, tiny_llava_processor
    from hf_precision.tiny.data import shape_image

    conv = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what ?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a red circle"}]},
    ]
    data = Dataset.from_list([{"messages": conv, "images": [shape_image("circle", "red")]}] * 2)
    model = tiny_llava(torch.bfloat16)
    head_calls = _count_calls(model.lm_head)
    cb = PrecisionGuardCallback(report_dir=tmp_path / "precision")
    config = trl.SFTConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        max_length=None,
        bf16=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.SFTTrainer(
            model=model,
            args=config,
            train_dataset=data,
            processing_class=tiny_llava_processor(),
            peft_config=LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)"),
            callbacks=[cb],
        )
        with caplog.at_level(logging.WARNING, logger="hf_precision"):
            out = trainer.train()
    assert math.isfinite(out.training_loss)
    assert head_calls == [0]  # the read no hook sees
    read = _events(tmp_path / "precision")["on_train_begin"]["outside_reads"][0]
    assert read["tensor"] == "lm_head.weight" and read["kind"] == "fused_head"
    assert read["reader"].startswith("TRL's fused LM head") and read["casts_itself"]
    line = next(
        r.getMessage() for r in caplog.records if "read outside its module" in r.getMessage()
    )
    assert "lm_head.weight (bfloat16)" in line and "TRL's fused LM head" in line


# ------------------------------------------------------------------ Liger's fused cross-entropy


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    return LlamaForCausalLM(config)


def _liger_like_lce_forward(self: Any, input_ids: Any = None, labels: Any = None, **kw: Any) -> Any:
    """A stand-in for ``liger_kernel.transformers.model.llama.lce_forward`` (Liger needs Triton,
    which a CPU torch does not have): like it, it runs the backbone and hands ``hidden`` and
    ``self.lm_head.weight`` to the fused kernel, which multiplies them as they are."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden = self.model(input_ids=input_ids, **kw).last_hidden_state[:, :-1]
    logits = hidden.reshape(-1, hidden.size(-1)) @ self.lm_head.weight.t()  # the kernel's matmul
    loss = nn.functional.cross_entropy(logits.float(), labels[:, 1:].reshape(-1))
    return CausalLMOutputWithPast(loss=loss)


_liger_like_lce_forward.__module__ = "liger_kernel.transformers.model.llama"


def _liger_patched() -> Any:
    """A bf16 Llama with a trainable fp32 ``lm_head`` (``modules_to_save``-like) and the forward
    Liger's ``apply_liger_kernel_to_llama(model=model)`` sets: ``model.forward = MethodType``."""
    model = _tiny_llama().to(torch.bfloat16)
    model.requires_grad_(False)
    model.lm_head.float().requires_grad_(True)
    model.forward = types.MethodType(_liger_like_lce_forward, model)
    return model


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.arange(2, 10).view(1, -1)
    return {"input_ids": ids, "labels": ids.clone()}


def test_liger_patched_forward_is_found_without_importing_liger() -> None:
    from hf_precision.engine.outside_reads import find_outside_reads, fused_head_reader

    model = _liger_patched()
    assert fused_head_reader(model) == ("Liger's fused linear cross-entropy", False)
    read = next(r for r in find_outside_reads(model) if r.kind == "fused_head")
    assert (read.tensor, read.dtype, read.casts_itself) == ("lm_head.weight", torch.float32, False)
    assert fused_head_reader(_tiny_llama()) is None


def test_liger_fp32_head_beside_bf16_hidden_is_refused_with_the_fix(tmp_args: Any) -> None:
    """Without the guard the kernel's matmul fails (on a GPU inside
    fused_linear_cross_entropy_forward); with it, a PrecisionError names lm_head, both dtypes
    and the fix, before the backbone runs. Under autocast (bf16=True) the step runs."""
    from transformers import Trainer

    with pytest.raises(RuntimeError, match="same dtype"):
        _liger_patched()(**_batch())
    trainer = Trainer(
        model=_liger_patched(),
        args=tmp_args(),
        train_dataset=[_batch()],
        data_collator=lambda f: f[0],
        callbacks=[PrecisionGuardCallback()],
    )
    with pytest.raises(PrecisionError) as err:
        trainer.train()
    text = str(err.value)
    assert "lm_head.weight is float32 and the hidden states are bfloat16" in text
    assert "Liger's fused linear cross-entropy" in text
    assert "bf16=True" in text and "group_dtypes={'lm_head': 'bfloat16'}" in text
    trainer = Trainer(
        model=_liger_patched(),
        args=tmp_args(bf16=True),
        train_dataset=[_batch()],
        data_collator=lambda f: f[0],
        callbacks=[PrecisionGuardCallback()],
    )
    assert math.isfinite(trainer.train().training_loss)


def test_cut_cross_entropy_patched_class_forward_is_found() -> None:
    """``cce_patch`` replaces the class's ``forward`` with one from
    ``cut_cross_entropy.transformers.*`` (a stand-in: the package needs Triton)."""
    from hf_precision.engine.outside_reads import find_outside_reads, fused_head_reader

    def cce_forward(self: Any, *args: Any, **kw: Any) -> Any:
        return _liger_like_lce_forward(self, *args, **kw)

    cce_forward.__module__ = "cut_cross_entropy.transformers.llama"
    model = _tiny_llama()
    patched = type("LlamaForCausalLM", (type(model),), {"forward": cce_forward})
    model.__class__ = patched
    assert fused_head_reader(model) == ("cut-cross-entropy (linear_cross_entropy)", False)
    assert [r.tensor for r in find_outside_reads(model) if r.kind == "fused_head"] == [
        "lm_head.weight"
    ]


@pytest.fixture
def tmp_args(tiny_args: Any) -> Any:
    return lambda **kw: tiny_args(max_steps=1, per_device_train_batch_size=1, **kw)


# ------------------------------------------------------------- Gemma 3's raw-parameter projector


def _tiny_gemma3() -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny Gemma3ForConditionalGeneration in bf16 with its projector (a raw
    ``mm_input_projection_weight``, not a Linear) trainable in fp32, the rest frozen."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=272,
            sliding_window=8,
            layer_types=["full_attention"],
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
        ),
        mm_tokens_per_image=4,
        image_token_index=260,
        boi_token_index=261,
        eoi_token_index=262,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).to(torch.bfloat16)
    model.requires_grad_(False)
    model.model.multi_modal_projector.float().requires_grad_(True)
    ids = torch.tensor([[2, 261, 260, 260, 260, 260, 262, 5, 6, 7, 8]])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(1, 3, 16, 16),
        "token_type_ids": (ids == 260).long(),
        "labels": ids.clone(),
    }
    return model, batch


@pytest.mark.parametrize("bf16", [False, True], ids=["no-flag", "bf16"])
def test_gemma3_raw_parameter_projector_runs_mixed_and_is_reported(
    bf16: bool, tmp_args: Any
) -> None:
    from transformers import Trainer

    model, batch = _tiny_gemma3()
    with pytest.raises(RuntimeError, match="same dtype"):
        model(**batch)  # no guard, no autocast: fp32 projector weight meets bf16 features
    weight = model.model.multi_modal_projector.mm_input_projection_weight
    before = weight.detach().clone()
    cb = PrecisionGuardCallback()
    trainer = Trainer(
        model=model,
        args=tmp_args(bf16=bf16),
        train_dataset=[batch],
        data_collator=lambda f: f[0],
        callbacks=[cb],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        loss = trainer.train().training_loss
    assert math.isfinite(loss)
    assert weight.dtype == torch.float32 and not torch.equal(weight.detach(), before)  # trained
    assert cb.last_report is not None
    # SigLIP's pooling head (probe, nn.MultiheadAttention's in_proj_weight) reads raw too
    raw = {r.tensor: r for r in cb.last_report.outside_reads if r.kind == "raw_parameter"}
    read = raw["model.multi_modal_projector.mm_input_projection_weight"]
    assert read.dtype == torch.float32
    assert "Gemma3MultiModalProjector.forward (a raw nn.Parameter" in read.describe()
    assert "model.vision_tower.head.probe" in raw
    with torch.no_grad():
        assert bool(torch.isfinite(model(**batch).logits).all())


def test_module_doctests() -> None:
    import doctest

    from hf_precision.engine import outside_reads

    assert doctest.testmod(outside_reads).failed == 0


def test_the_report_says_it_in_text_and_json() -> None:
    from hf_precision import enforce_policy
    from hf_precision.engine.outside_reads import find_outside_reads

    model = _liger_patched()
    report = enforce_policy(model, "bf16-true", mode="audit")
    report.outside_reads = find_outside_reads(model)
    assert (
        "read outside its module: lm_head.weight (float32) is read outside its module by "
        "Liger's fused linear cross-entropy (LlamaForCausalLM.forward patched)"
    ) in report.summary()
    assert report.to_dict()["outside_reads"] == [
        {
            "tensor": "lm_head.weight",
            "dtype": "float32",
            "reader": "Liger's fused linear cross-entropy (LlamaForCausalLM.forward patched)",
            "kind": "fused_head",
            "casts_itself": False,
        }
    ]


def test_trl_fused_head_with_fp32_cast_is_named() -> None:
    """``trl.trainer.add_fused_lm_head(model, cast_lm_head_to_fp32=True)`` (GRPO, ScaleRL):
    the reader says the head computes in float32 on purpose."""
    trainer = pytest.importorskip("trl.trainer")
    from hf_precision.engine.outside_reads import find_outside_reads, fused_head_reader

    model = _tiny_llama()
    trainer.add_fused_lm_head(model, cast_lm_head_to_fp32=True)
    reader, casts = fused_head_reader(model) or ("", False)
    assert casts and reader == (
        "TRL's fused LM head (add_fused_lm_head) with cast_lm_head_to_fp32=True "
        "(float32, on purpose)"
    )
    plain = _tiny_llama()
    trainer.add_fused_lm_head(plain)
    assert fused_head_reader(plain) == ("TRL's fused LM head (add_fused_lm_head)", True)
    assert [r.tensor for r in find_outside_reads(model) if r.kind == "fused_head"] == [
        "lm_head.weight"
    ]


def test_trl_models_of_its_own_are_not_fused_heads() -> None:
    """A forward written in TRL that is not its fused head (a value-head model) is no reader."""
    from hf_precision.engine.outside_reads import fused_head_reader

    def forward(self: Any, *args: Any, **kw: Any) -> Any:
        return None

    forward.__module__ = "trl.models.modeling_value_head"
    model = _tiny_llama()
    model.forward = types.MethodType(forward, model)
    assert fused_head_reader(model) is None
