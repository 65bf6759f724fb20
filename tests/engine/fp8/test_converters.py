"""fp8 in the one policy, on real accelerate + torchao (emulated) + PEFT runs of a tiny LLaVA:
what stays out of fp8, brought back when a converter took it, and the fp8 manifest."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")
from accelerate import Accelerator
from accelerate.utils import AORecipeKwargs
from peft import LoraConfig, get_peft_model
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from hf_precision import PrecisionGuardPlugin
from hf_precision.engine.fp8.converters import module_filter, skip_modules_pattern
from hf_precision.model import fp8
from hf_precision.tiny import tiny_batch, tiny_llava

EMULATED = Float8LinearConfig(emulate=True)
LM_ATTN = r".*language_model.*\.(q_proj|v_proj)"


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """fp8 is set when accelerate's state is first built: each test starts from a fresh one
    (an earlier test's Accelerator in the same process would fix its mixed precision)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _accelerator(**kwargs) -> Accelerator:
    return Accelerator(
        mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(config=EMULATED, **kwargs)]
    )


def _fp8_names(model: nn.Module) -> list[str]:
    return list(fp8.manifest(model.named_modules()).modules)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    loss = model(**tiny_batch(model)).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def test_accelerate_fp8_keeps_the_vision_side_projector_and_head_out(tmp_path) -> None:
    # unguarded, accelerate's first/last filter takes the vision tower's first Linear as "first"
    bare = tiny_llava()
    _accelerator().prepare(bare)
    assert "model.multi_modal_projector.linear_1" in _fp8_names(bare)
    assert "model.vision_tower.encoder.layers.0.self_attn.v_proj" in _fp8_names(bare)

    model = tiny_llava()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = PrecisionGuardPlugin(report_dir=tmp_path)
    model, opt = guard.prepare(_accelerator(), model, opt)
    names = _fp8_names(model)
    assert names and all(".language_model.layers." in n for n in names)
    assert type(model.lm_head) is nn.Linear
    assert type(model.model.multi_modal_projector.linear_1) is nn.Linear
    assert type(model.model.language_model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    assert torch.isfinite(torch.tensor(_step(model, opt)))
    event = json.loads((tmp_path / "000000-after_prepare.json").read_text())
    assert event["fp8"]["lines"] == [
        f"weights fp32, matmuls fp8 e4m3 tensorwise (torchao), {len(names)} of 29 Linears"
    ]
    group = event["dtype_map"]["groups"]["language_model"]
    assert group["fp8"] == [
        f"weights fp32, matmuls fp8 e4m3 tensorwise (torchao), {len(names)} of 14 Linears"
    ]
    up = "model.language_model.layers.0.mlp.up_proj"
    assert event["dtype_map"]["records"][up]["fp8"].startswith("weights fp32, matmuls fp8 e4m3")
    # the step's forward ran under accelerate's bf16 autocast: the compute fact says what ran
    [engine] = guard.guards
    assert engine.sections["fp8"]["lines"] == [
        f"weights fp32, compute bf16, matmuls fp8 e4m3 tensorwise (torchao), {len(names)} of "
        "29 Linears"
    ]
    assert engine.sections["fp8"]["modules"][up]["compute"] == "bfloat16"
    assert engine.sections["compute"]["fp8_modules"][up]["autocast"] == "bfloat16"


def test_lora_adapters_stay_out_of_fp8_under_accelerate() -> None:
    def lora() -> nn.Module:
        return get_peft_model(tiny_llava(), LoraConfig(r=16, target_modules=LM_ATTN))

    bare = lora()
    _accelerator().prepare(bare)
    assert any(".lora_A." in n for n in _fp8_names(bare))  # the adapters run fp8 matmuls

    model = lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = PrecisionGuardPlugin(report=False).prepare(_accelerator(), model, opt)
    names = _fp8_names(model)
    assert not any(".lora_" in n for n in names)
    assert any(n.endswith("q_proj.base_layer") for n in names)  # the frozen base still fp8
    assert torch.isfinite(torch.tensor(_step(model, opt)))


def test_a_converted_module_the_policy_keeps_out_is_brought_back_with_its_parameters() -> None:
    """convert_to_float8_training on everything, then the guard: the projector (keep_fp32),
    head and vision side go back to nn.Linear holding the very same Parameters."""
    model = tiny_llava()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    convert_to_float8_training(model, config=EMULATED)
    proj = model.model.multi_modal_projector.linear_1
    weight, bias = proj.weight, proj.bias
    assert type(proj).__name__ == "Float8Linear"
    guard = PrecisionGuardPlugin(keep_fp32=["model.multi_modal_projector"], report=False)
    guard.setup(model)
    back = model.model.multi_modal_projector.linear_1
    assert type(back) is nn.Linear and back.weight is weight and back.bias is bias
    assert weight.dtype is torch.float32
    assert any(p is weight for p in opt.param_groups[0]["params"])  # optimizer refs valid
    assert type(model.lm_head) is nn.Linear
    assert all(".language_model.layers." in n for n in _fp8_names(model))
    section = guard.guards[0].sections["fp8"]
    assert "model.multi_modal_projector.linear_1" in section["restored"]
    assert section["kept_out_running_fp8"]["model.multi_modal_projector.linear_1"] in (
        "group projector",
        "keep_fp32 model.multi_modal_projector",
    )
    assert torch.isfinite(torch.tensor(_step(model, opt)))


def test_the_filter_feeds_torchao_directly_and_first_last_blocks_is_an_option() -> None:
    from hf_precision.rules.policy.precision_policy import PrecisionPolicy

    def converted(words: tuple[str, ...]) -> list[str]:
        model = tiny_llava()
        policy = PrecisionPolicy.from_preset("bf16", keep_out_of_fp8=words)
        filt = module_filter(model, policy)
        convert_to_float8_training(model, config=EMULATED, module_filter_fn=filt)
        return _fp8_names(model)

    names = converted(("vision_encoder", "projector", "lm_head"))
    assert len(names) == 14 and all(".language_model.layers." in n for n in names)
    # the tiny LM has two blocks: both are its first and last
    assert converted(("vision_encoder", "projector", "lm_head", "first_last_blocks")) == []


def test_unused_entry_and_zero_converted_are_named(tmp_path, said) -> None:
    model = tiny_llava()
    guard = PrecisionGuardPlugin(
        PrecisionGuardPlugin("bf16").policy.replace(
            keep_out_of_fp8=("lm_head", "model.no_such_block")
        ),
        report_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the findings channel is not a warning
        guard.prepare(_accelerator(module_filter_func=lambda mod, fqn: False), model)
    [line] = said.about(": fp8: ")
    assert "'model.no_such_block' matched no module" in line
    assert "fp8 requested (Accelerator(mixed_precision='fp8')) but 0 of 29" in line
    assert "no component recorded choosing another precision" in line  # no provenance here
    [found] = [json.loads(p.read_text()) for p in tmp_path.glob("*-fp8.json")]
    assert found["finding"]["severity"] == "warning"
    assert found["fp8"]["unused_keep_out"] == ["model.no_such_block"]
    assert found["finding"]["groups"]["language_model"] == 0.0
    assert (tmp_path / "000000-fp8.png").read_bytes()[:4] == b"\x89PNG"
    event = json.loads((tmp_path / "000000-after_prepare.json").read_text())
    assert [f["source"] for f in event["findings"]] == ["fp8"]


def test_skip_modules_pattern_feeds_layerwise_casting() -> None:
    from accelerate.big_modeling import attach_layerwise_casting_hooks

    model = tiny_llava()
    pats = skip_modules_pattern(model)
    attach_layerwise_casting_hooks(
        model, torch.float8_e4m3fn, torch.float32, skip_modules_pattern=pats
    )
    man = fp8.manifest(model.named_modules())
    assert man.modules and all(".language_model.layers." in n for n in man.modules)
    assert not any("norm" in n for n in man.modules)


def test_fp8_turned_off_by_trls_bf16_default_is_named(tmp_path, monkeypatch, said) -> None:
    # TRL 3860: ACCELERATE_MIXED_PRECISION=fp8, and SFTConfig turns bf16 on by itself
    trl = pytest.importorskip("trl")
    from transformers import Trainer

    from hf_precision import PrecisionGuardCallback

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        gradient_checkpointing=False,
        save_strategy="no",
    )
    assert args.bf16 and args.mixed_precision == "bf16"  # fp8 is gone before any model
    model = tiny_llava()
    cb = PrecisionGuardCallback(report_dir=tmp_path / "precision")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=model, args=args, train_dataset=[tiny_batch(model)], callbacks=[cb])
    [line] = said.about(": fp8: ")
    assert "fp8 requested (ACCELERATE_MIXED_PRECISION=fp8) but 0 of 29 Linears run fp8" in line
    assert "fp8 was turned off: script decided the precision (bf16 — SFTConfig's bf16=True" in line
    assert "trl turns it on when neither bf16 nor fp16 is given" in line
    assert "Fix: drop bf16 where it was set" in line
    [found] = [json.loads(p.read_text()) for p in (tmp_path / "precision").glob("*-fp8.json")]
    assert found["fp8"]["requested"] == "ACCELERATE_MIXED_PRECISION=fp8"
    assert found["fp8"]["chosen_by"] == "script" and found["finding"]["severity"] == "warning"
    # the event JSON carries the manifest with no edit beyond the callback
    event = json.loads(next((tmp_path / "precision").glob("*-on_init_end.json")).read_text())
    assert event["fp8"]["fp8_modules"] == 0 and event["fp8"]["linears"] == 29
    assert "fp8" in [f["source"] for f in event["findings"]]
