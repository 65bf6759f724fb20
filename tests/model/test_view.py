"""ModelView: one walk of the model per event, every module with its path and group."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from hf_precision import find_module_groups
from hf_precision.model.view import ModelView, walk_modules
from hf_precision.rules.groups.group_rule import OTHER
from hf_precision.tiny import OmniLMMTiny, tiny_llava, tiny_text_llama


def test_every_module_once_in_pre_order_with_its_group() -> None:
    model = tiny_llava()
    view = ModelView.of(model)
    assert [path for path, _, _ in view.modules] == [p for p, _ in model.named_modules()]
    assert [m for _, _, m in view.modules] == list(model.modules())
    group = {path: g for path, g, _ in view.modules}
    assert group[""] == OTHER and group["model"] == OTHER
    assert group["model.vision_tower"] == "vision_encoder"
    fc1 = [p for p in group if p.endswith("layers.0.mlp.fc1")]  # the CLIP tower's first MLP
    assert fc1 and all(group[p] == "vision_encoder" for p in fc1)
    assert group["model.multi_modal_projector.linear_1"] == "projector"
    q_proj = [p for p in group if p.endswith("layers.1.self_attn.q_proj")]
    assert [group[p] for p in q_proj] == ["vision_encoder", "language_model"]
    assert group["lm_head"] == "lm_head"


def test_modules_held_outside_the_tree_come_last_under_their_group() -> None:
    model = OmniLMMTiny(tune_clip=False)  # the vision tower sits in a plain list
    tower = model.model.vision_tower[0]
    groups = find_module_groups(model)
    view = ModelView.of(model, groups)
    tail = view.modules[-len(list(tower.modules())) :]
    assert [m for _, _, m in tail] == list(tower.modules())
    assert {g for _, g, _ in tail} == {"vision_encoder"}
    assert tail[0][0] == "model.vision_tower"
    assert all(m is not tower for m in model.modules())  # not registered: only the view sees it
    ids = {id(p) for p in view.parameters()}
    assert all(id(p) in ids for p in tower.parameters())
    assert len(ids) == len(view.parameters())


def test_parameters_once_each_even_when_tied() -> None:
    model = tiny_text_llama()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = ModelView.of(model).parameters()
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))


def test_a_peft_model_is_walked_from_the_model_inside() -> None:
    base = tiny_llava()
    peft = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    view = ModelView.of(peft)
    assert view.root is base and view.groups.root is base
    lora = {p: g for p, g, _ in view.modules if p.endswith("q_proj.lora_A.default")}
    assert len(lora) == 4  # two layers of each tower: the adapters follow the layer they sit in
    for path, group in lora.items():
        assert group == ("vision_encoder" if "vision_tower" in path else "language_model"), path


def test_reuse_keeps_the_events_walk_for_the_same_model_only() -> None:
    model, other = tiny_llava(), tiny_llava()
    view = ModelView.of(model)
    assert ModelView.reuse(view, model) is view
    assert ModelView.reuse(None, model) is not view
    fresh = ModelView.reuse(view, other)
    assert fresh is not view and fresh.root is other


def test_walk_modules_is_lazy_and_matches_the_view() -> None:
    model = tiny_llava(torch.float32)
    groups = find_module_groups(model)
    walk = walk_modules(model, groups)
    assert next(walk)[0] == ""  # a generator: the view materialises it once
    assert [p for p, _, _ in ModelView.of(model, groups).modules][1:] == [p for p, _, _ in walk]


def test_a_subtree_and_its_receiving_dtype_come_from_the_walk() -> None:
    from hf_precision.model.view import receiving

    model = tiny_llava(torch.bfloat16)
    model.model.multi_modal_projector.float()
    view = ModelView.of(model)
    tower = model.model.vision_tower
    assert [m for _, _, m in view.within(tower)] == list(tower.modules())
    assert view.within(tower)[0][0] == "model.vision_tower"
    assert view.parameters_of(tower) == list(tower.parameters())
    projector = model.model.multi_modal_projector
    assert (
        view.receiving_of(projector) == receiving(projector) == (torch.float32, torch.device("cpu"))
    )
    assert view.receiving_dtypes()["projector"] == torch.float32
    assert view.receiving_dtypes()["language_model"] == torch.bfloat16
    assert view.model_device() == torch.device("cpu")
    assert set(view.named_parameters()) == {n for n, _ in model.named_parameters()}


def test_the_wrappers_peeled_are_listed_outermost_first() -> None:
    base = tiny_llava()
    peft = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    view = ModelView.of(peft)
    assert view.outer == (peft, peft.base_model)
    assert view.every_module() == list(peft.modules())
    assert view.modules_of(peft) == list(peft.modules())
    assert view.modules_of(base) == list(base.modules())
    assert view.modules_of(tiny_llava()) is None  # another model: the caller walks it
    inner = ModelView.reuse(view, base)  # the model inside the wrappers: the same walk
    assert inner.model is base and inner.outer == () and inner.modules is view.modules
