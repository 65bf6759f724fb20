"""Who holds the parameters, and the way to the model inside: real wrappers built on CPU
(DataParallel, torch.compile, PEFT); DDP/FSDP/DeepSpeed run in tests/engine/test_distributed.py."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from hf_precision import find_module_groups
from hf_precision.base.wrappers import (
    clean_name,
    detect_wrapper,
    is_sharded,
    owning_wrapper,
    unwrap_model,
    wrapper_of,
)
from hf_precision.tiny import tiny_llava


def test_unwrap_peels_compile_peft_and_data_parallel_in_any_nesting() -> None:
    base = tiny_llava()
    assert unwrap_model(base) == (base, "")
    peft = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    assert unwrap_model(peft) == (base, "base_model.model.")
    compiled = torch.compile(peft)  # lazy: nothing is compiled until it is called
    assert unwrap_model(compiled) == (base, "_orig_mod.base_model.model.")
    parallel = nn.DataParallel(compiled)
    inner, prefix = unwrap_model(parallel)
    assert inner is base and prefix == "module._orig_mod.base_model.model."
    # the prefix is the path of the inner model's parameters inside the wrapper
    name = "model.multi_modal_projector.linear_1.weight"
    assert dict(parallel.named_parameters())[prefix + name] is dict(base.named_parameters())[name]


def test_groups_are_found_through_the_wrappers() -> None:
    base = tiny_llava()
    wrapped = nn.DataParallel(torch.compile(base))
    groups = find_module_groups(wrapped)
    assert groups.root is base and groups.rule == "llava"
    assert groups.paths["projector"] == ("model.multi_modal_projector",)


def test_a_wrapper_that_holds_the_parameters_is_named() -> None:
    base = tiny_llava()
    parallel = nn.DataParallel(base)
    assert owning_wrapper(parallel) == "DataParallel" and owning_wrapper(base) is None
    assert wrapper_of(parallel) == "DDP"  # DataParallel replicates like DDP
    assert wrapper_of(base) is None and detect_wrapper(base) is None
    assert wrapper_of(torch.compile(base)) is None  # compile holds nothing of its own
    assert not any(is_sharded(p) for p in base.parameters())


def test_clean_name_drops_wrapper_segments_only() -> None:
    assert (
        clean_name("model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.weight")
        == "model.layers.0.mlp.weight"
    )
    assert clean_name("_orig_mod.lm_head.weight") == "lm_head.weight"
    assert clean_name("model.vision_tower._fsdp_wrapped_module") == "model.vision_tower"
    assert clean_name("model.orig_module.weight") == "model.orig_module.weight"
