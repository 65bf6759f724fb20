"""The three facts per module, read from real torchao, accelerate and diffusers objects."""

from __future__ import annotations

import pytest
import torch

from hf_precision.model import fp8

pytest.importorskip("torchao")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 16)
    )


@pytest.mark.parametrize(
    ("recipe", "text", "grads"),
    [
        (None, "weights fp32, matmuls fp8 e4m3 tensorwise (torchao)", "e5m2"),
        ("rowwise", "weights fp32, matmuls fp8 e4m3 rowwise (torchao)", None),
        ("rowwise_with_gw_hp", "weights fp32, matmuls fp8 e4m3 rowwise_with_gw_hp (torchao)", None),
    ],
)
def test_torchao_float8_linear_reads_its_config(recipe, text, grads) -> None:
    model = _mlp()
    config = (
        Float8LinearConfig.from_recipe_name(recipe) if recipe else Float8LinearConfig(emulate=True)
    )
    convert_to_float8_training(model, config=config)
    f = fp8.facts(model[0])
    assert f.text() == text
    assert f.storage is torch.float32 and f.compute is torch.float32
    assert f.matmul is not None and f.matmul.grads == grads
    assert f.matmul.emulate is (recipe is None)
    assert fp8.facts(model[1]).matmul is None and not fp8.facts(model[1]).fp8


def test_manifest_counts_fp8_linears_of_all_linears() -> None:
    model = _mlp()
    convert_to_float8_training(
        model, config=Float8LinearConfig(emulate=True), module_filter_fn=lambda m, n: n == "0"
    )
    man = fp8.manifest(model.named_modules())
    assert list(man.modules) == ["0"]
    assert man.lines() == ["weights fp32, matmuls fp8 e4m3 tensorwise (torchao), 1 of 2 Linears"]
    d = man.as_dict()
    assert d["modules"]["0"]["matmul"]["recipe"] == "tensorwise"
    assert d["modules"]["0"]["storage"] == "float32"


def test_torchao_training_weight_wrappers_are_fp8_matmuls() -> None:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization import quantize_

    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    quantize_(model, MXFP8TrainingOpConfig())
    f = fp8.facts(model[0])
    assert type(model[0]) is torch.nn.Linear  # the weight, not the module, carries it
    assert f.matmul is not None and (f.matmul.recipe, f.matmul.block) == ("mx", 32)


def test_layerwise_casting_is_fp8_storage_with_its_compute_dtype() -> None:
    from accelerate.big_modeling import attach_layerwise_casting_hooks
    from diffusers.hooks import apply_layerwise_casting

    a = _mlp()
    attach_layerwise_casting_hooks(
        a, torch.float8_e4m3fn, torch.bfloat16, skip_modules_pattern=["1"]
    )
    fa = fp8.facts(a[0])
    assert (fa.storage, fa.compute, fa.matmul) == (torch.float8_e4m3fn, torch.bfloat16, None)
    assert fa.text() == "weights fp8 e4m3, compute bf16 (layerwise casting, accelerate)"
    assert not fp8.facts(a[1]).fp8  # skipped by its pattern

    d = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Conv2d(2, 2, 1))
    apply_layerwise_casting(d, torch.float8_e5m2, torch.float16)
    assert fp8.facts(d[1]).text() == "weights fp8 e5m2, compute fp16 (layerwise casting, diffusers)"
    assert fp8.manifest(d.named_modules()).lines() == [
        "weights fp8 e5m2, compute fp16 (layerwise casting, diffusers), 2 of 2 layers"
    ]


def test_fp8_storage_without_a_hook_takes_the_callers_compute() -> None:
    """kohya's --fp8_base: fp8 weights, autocast decides the compute dtype."""
    lin = torch.nn.Linear(4, 4).to(torch.float8_e4m3fn)
    assert fp8.facts(lin).compute is None
    assert fp8.facts(lin).text() == "weights fp8 e4m3, compute unknown"
    assert fp8.facts(lin, torch.bfloat16).text() == "weights fp8 e4m3, compute bf16"
    assert fp8.facts(torch.nn.Linear(2, 2).bfloat16()).text() == "weights bf16"


def test_transformer_engine_is_found_by_name_without_importing_it() -> None:
    # TransformerEngine does not install on a CPU: a class with its module and class name
    Linear = type(
        "Linear", (torch.nn.Linear,), {"__module__": "transformer_engine.pytorch.module.linear"}
    )
    lin = Linear(16, 16)
    f = fp8.facts(lin)
    assert f.matmul is not None and f.matmul.backend == "transformer_engine"
    assert f.matmul.recipe == "set at its first forward"

    class MXFP8BlockScaling:
        fp8_format = type("F", (), {"name": "E4M3"})()

    lin.fp8_meta = {"recipe": MXFP8BlockScaling()}
    assert str(fp8.matmul_format(lin)) == "fp8 e4m3 mx (transformer_engine)"
    assert fp8.matmul_format(lin).block == 32
