"""Who holds the parameters, and the way to the model inside: real wrappers built on CPU
(DataParallel, torch.compile, PEFT); DDP/FSDP/DeepSpeed run in tests/engine/wrappers/test_ranks.py.
The wrapper table's wiring is tested with a registered kind no library has (``ShardKeeper``)."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from hf_precision import find_module_groups
from hf_precision.base.wrapper_kinds import (
    HOLDING_WRAPPERS,
    WRAPPERS,
    WrapperKind,
    clean_name,
    detect_wrapper,
    is_sharded,
    owned_by,
    owning_wrapper,
    planned_wrapper,
    register_wrapper,
    unwrap_model,
    wrapper_kind,
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


# ------------------------------------------------------------------ the table: one record a kind
class ShardKeeper(nn.Module):
    """A wrapper kind that exists nowhere: it only tests that the table is the one place a
    wrapper is described (the real wrappers run in tests/engine/wrappers/test_ranks.py and the
    torchrun scenarios). It holds the model under ``held``, not ``module``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.held = model


KEEPER = WrapperKind(
    "Keeper",
    classes=("ShardKeeper",),
    inner="held",
    param_test=lambda p: hasattr(p, "_keeper"),
    args_test=lambda args: bool(getattr(args, "keeper", False)),
    segments=("_keeper_wrapped",),
    owns_params=True,
    owned_test=lambda t, kind: hasattr(t, "_keeper"),
    owned_words="kept by Keeper",
)


@pytest.fixture
def keeper() -> Iterator[WrapperKind]:
    saved = dict(WRAPPERS)
    yield register_wrapper(KEEPER)
    WRAPPERS.clear()
    WRAPPERS.update(saved)


def test_a_registered_wrapper_kind_is_detected_and_unwrapped_everywhere(keeper) -> None:
    base = tiny_llava()
    wrapped = ShardKeeper(base)
    assert next(iter(WRAPPERS)) == "Keeper"  # a registered kind is asked first
    assert wrapper_of(wrapped) == "Keeper" and detect_wrapper(wrapped) == "Keeper"
    assert wrapper_kind("Keeper") is KEEPER
    assert unwrap_model(wrapped) == (base, "held.")
    assert owning_wrapper(wrapped) == "ShardKeeper"
    assert "Keeper" in HOLDING_WRAPPERS and "DDP" not in HOLDING_WRAPPERS
    assert clean_name("model._keeper_wrapped.lm_head.weight") == "model.lm_head.weight"
    assert planned_wrapper(args=types.SimpleNamespace(keeper=True, deepspeed=None)) == "Keeper"
    # a parameter it marks names it inside a plain model too, and the plan leaves it alone
    p = base.lm_head.weight
    p._keeper = True  # type: ignore[attr-defined]
    assert wrapper_of(base) == "Keeper" and owned_by(p, "param") is KEEPER
    assert owned_by(base.model.multi_modal_projector.linear_1.weight, "param") is None


def test_without_its_record_the_fake_wrapper_is_nobody(keeper) -> None:
    WRAPPERS.pop("Keeper")
    wrapped = ShardKeeper(tiny_llava())
    assert wrapper_of(wrapped) is None and owning_wrapper(wrapped) is None
    assert unwrap_model(wrapped) == (wrapped, "")  # "held" is not "module": not peeled
    assert "Keeper" not in HOLDING_WRAPPERS
    assert (
        clean_name("model._keeper_wrapped.lm_head.weight") == "model._keeper_wrapped.lm_head.weight"
    )


def test_the_built_in_kinds_keep_their_order_and_ownership() -> None:
    assert list(WRAPPERS) == ["FSDP2", "FSDP", "DeepSpeed", "DDP"]
    assert tuple(HOLDING_WRAPPERS) == ("FSDP2", "FSDP", "DeepSpeed")
    ns = types.SimpleNamespace  # a DeepSpeed config wins over fsdp, as in TrainingArguments
    both = ns(deepspeed="ds.json", fsdp="full_shard", fsdp_config={"version": 2}, world_size=2)
    assert planned_wrapper(args=both) == "DeepSpeed"


def test_no_step_compares_a_wrapper_name() -> None:
    """The steps read a ``WrapperKind``'s attributes (``reshards``, ``buckets_by_dtype``,
    ``partitions_at_build``, ``owns_autocast``); none compares a kind's name, so a registered
    kind with the same behaviour is handled the same."""
    import ast
    from pathlib import Path

    from hf_precision.base.wrapper_kinds import WRAPPERS

    pkg = Path(__file__).resolve().parents[2] / "hf_precision"
    names = set(WRAPPERS)
    compared = [
        f"{path.relative_to(pkg)}:{node.lineno}"
        for path in sorted(pkg.rglob("*.py"))
        if path.relative_to(pkg).as_posix() != "base/wrapper_kinds.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare)
        and any(
            isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators]
        )
    ]
    assert compared == [], compared
