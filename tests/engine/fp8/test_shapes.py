"""The fp8 shape gate on real torchao Float8Linear layers (CPU emulation), a real accelerate
fp8 Accelerator, and accelerate's TransformerEngine conversion."""

from __future__ import annotations

import contextlib
import itertools
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import PrecisionError, PrecisionPolicy
from hf_precision.engine.fp8.shapes import (
    fp8_layers,
    gate_shapes,
    remove_token_checks,
    skipped_layers,
)
from hf_precision.engine.guard import PrecisionGuard
from hf_precision.model.view import ModelView

pytest.importorskip("torchao")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training

EMULATE = Float8LinearConfig(emulate=True)


class Chain(nn.Module):
    def __init__(self, *dims: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _fp8(*dims: int, config: Float8LinearConfig = EMULATE) -> Chain:
    model = Chain(*dims)
    convert_to_float8_training(model, config=config)
    return model


def _guard(model: nn.Module, mode: str = "fix") -> PrecisionGuard:
    guard = PrecisionGuard(model, PrecisionPolicy.from_preset("fp32").replace(mode=mode))
    guard.verify("setup")
    return guard


def test_emulation_runs_what_the_kernel_refuses_and_the_gate_refuses_it() -> None:
    model = _fp8(32, 24, 40, 32)
    model(torch.randn(3, 32)).sum().backward()  # emulated: Linear(24, 40) on 3 tokens runs
    with pytest.raises(PrecisionError) as err:
        _guard(_fp8(32, 24, 40, 32))
    msg = str(err.value)
    assert "3 of 3 fp8 Linear layer(s)" in msg
    assert "layers.0 (out_features 24 % 16 != 0)" in msg
    assert "layers.1 (in_features 24 % 16 != 0, out_features 40 % 16 != 0)" in msg
    assert "layers.2 (in_features 40 % 16 != 0)" in msg
    assert "fp8 e4m3 tensorwise (torchao)" in msg and "module_filter_fn" in msg


def test_padded_inner_dim_still_needs_the_outer_dims() -> None:
    """pad_inner_dim pads k of each GEMM, never n: K=24 is n of grad_input."""
    padded = Float8LinearConfig(emulate=True, pad_inner_dim=True)
    layers = fp8_layers(ModelView.of(_fp8(24, 32, config=padded)))
    assert layers[0].dims() == ["in_features 24 % 16 != 0"]
    assert layers[0].token_multiple is None  # the token dim is only ever inner: padded
    assert fp8_layers(ModelView.of(_fp8(24, 32)))[0].token_multiple == 16


def test_token_count_is_checked_per_batch_before_the_backward() -> None:
    model = _fp8(32, 32, 16)
    guard = _guard(model)
    model(torch.randn(2, 8, 32)).sum().backward()  # 16 tokens
    with pytest.raises(PrecisionError, match=r"layers.0: 3 tokens reach this fp8 Linear"):
        model(torch.randn(3, 32)).sum().backward()
    with torch.no_grad():  # no backward: any count runs
        model(torch.randn(3, 32))
    guard.teardown()
    model(torch.randn(3, 32)).sum().backward()  # the gate's hooks are gone


def test_token_check_traces_without_a_graph_break() -> None:
    model = _fp8(32, 32, 16)
    gate_shapes(ModelView.of(model), "setup", "fix", lambda f: None)
    explained = torch._dynamo.explain(model)(torch.randn(16, 32))
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_rowwise_with_gw_hp_has_no_token_rule() -> None:
    import dataclasses

    config = Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
    config = dataclasses.replace(config, emulate=True)
    layer = fp8_layers(ModelView.of(_fp8(32, 32, config=config)))[0]
    assert "grad_weight" not in layer.gemms and layer.token_multiple is None


def test_out_features_below_the_fsdp_shard_count_is_refused() -> None:
    view = ModelView.of(_fp8(32, 32, 16))
    with pytest.raises(PrecisionError, match=r"out_features 16 < 32 FSDP shards"):
        gate_shapes(view, "setup", "fix", lambda f: None, shards=32)


def test_audit_mode_reports_instead(said: Any) -> None:
    model = _fp8(32, 24, 32)
    guard = _guard(model, mode="audit")
    model(torch.randn(3, 32)).sum().backward()
    assert said.about("have dimensions the fp8 kernels refuse")
    assert said.about("3 tokens reach this fp8 Linear")
    guard.teardown()


def test_real_accelerator_fp8_recipe_gets_the_token_gate(said: Any) -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # a fresh Accelerator: fp8 is set at its first build
    GradientState._reset_state()
    try:
        _accelerate_fp8_run(said)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _accelerate_fp8_run(said: Any) -> None:
    from accelerate import Accelerator
    from accelerate.utils import AORecipeKwargs

    from hf_precision import PrecisionGuardPlugin
    from hf_precision.tiny import tiny_text_llama

    model = tiny_text_llama()
    acc = Accelerator(
        mixed_precision="fp8", cpu=True, kwargs_handlers=[AORecipeKwargs(config=EMULATE)]
    )
    opt = torch.optim.AdamW(model.parameters())
    plugin = PrecisionGuardPlugin()
    with pytest.warns(Warning):
        model, opt = plugin.prepare(acc, model, opt)
    ids = torch.randint(0, 200, (2, 8))  # 16 tokens
    acc.backward(model(input_ids=ids, labels=ids).loss)
    ids = torch.randint(0, 200, (2, 11))  # 22 tokens: a GPU refuses the backward
    with pytest.raises(PrecisionError, match=r"22 tokens reach this fp8 Linear"):
        model(input_ids=ids, labels=ids)
    # the filter keeps the LM head out (keep_out_of_fp8): listed, not refused
    assert said.about("lm_head (left out by the converter's filter)")
    plugin.remove()


def _fake_transformer_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """TransformerEngine needs a GPU to install: a stand-in module with its class names, so
    accelerate's real ``convert_model`` runs."""

    class Linear(nn.Linear):
        def __init__(self, i: int, o: int, bias: bool = True, params_dtype: object = None):
            super().__init__(i, o, bias=bias, dtype=params_dtype)  # type: ignore[arg-type]

    Linear.__module__ = "transformer_engine.pytorch.module.linear"
    te = types.ModuleType("transformer_engine")
    te_torch = types.ModuleType("transformer_engine.pytorch")
    te_torch.Linear = Linear  # type: ignore[attr-defined]
    te_torch.LayerNorm = nn.LayerNorm  # type: ignore[attr-defined]
    te.pytorch = te_torch  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_torch)
    import accelerate.utils.transformer_engine as ate

    monkeypatch.setattr(ate, "is_transformer_engine_available", lambda: True)
    # DeepSpeed ZeRO-3's gather around each copy: nothing to gather without DeepSpeed
    monkeypatch.setattr(ate, "GatheredParameters", lambda *a, **k: contextlib.nullcontext())


def test_transformer_engine_conversion_stop_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_transformer_engine(monkeypatch)
    from accelerate.utils.transformer_engine import convert_model

    model = nn.Module()
    model.block = nn.Module()
    model.block.q = nn.Linear(32, 32)
    model.block.odd = nn.Linear(32, 24)
    model.block.v = nn.Linear(32, 32)
    model.head = nn.Linear(32, 32)
    with torch.no_grad():
        convert_model(model, _convert_ln=False)
    assert type(model.block.v) is nn.Linear  # left behind: the conversion returned at odd
    view = ModelView.of(model)
    layers = fp8_layers(view)
    assert [layer.path for layer in layers] == ["block.q", "head"]
    skipped = dict(skipped_layers(view, layers))
    assert "block.v" in skipped and "returned at block.odd" in skipped["block.v"]
    found = []
    gate_shapes(view, "setup", "fix", found.append)
    assert found[0].severity == "warning" and "block.v" in found[0].message


def test_no_fp8_layer_installs_nothing() -> None:
    model = Chain(24, 40)
    assert gate_shapes(ModelView.of(model), "setup", "fix", lambda f: None) == []
    assert not model.layers[0]._forward_pre_hooks


@pytest.mark.gpu
def test_gate_predicts_the_real_scaled_mm_refusal() -> None:
    """On an fp8 GPU (H100/H200): the kernel refuses what the gate refused on the CPU."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs fp8 tensor cores (sm89+)")
    model = Chain(32, 24, 32).cuda().to(torch.bfloat16)
    convert_to_float8_training(model)  # real kernels
    with pytest.raises(PrecisionError, match="layers.0 .out_features 24 % 16"):
        gate_shapes(ModelView.of(model), "setup", "fix", lambda f: None)
    x = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="divisible by 16"):
        model(x).sum().backward()
    good = Chain(32, 32, 16).cuda().to(torch.bfloat16)
    convert_to_float8_training(good)
    gate_shapes(ModelView.of(good), "setup", "fix", lambda f: None)  # passes, and so do they
    good(torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)).sum().backward()
    three = torch.randn(3, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(PrecisionError, match="3 tokens"):
        good(three).sum().backward()
    remove_token_checks(good)
    with pytest.raises(RuntimeError, match="divisible by 16"):  # what the gate predicted
        good(three).sum().backward()
