"""find_module_groups on the tiny models (exact paths), wrappers, the fallback and the registry."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import PrecisionError, PrecisionWarning, find_module_groups, tiny
from hf_precision.rules.groups import group_rule as GS
from hf_precision.rules.groups import registry as GR
from hf_precision.rules.groups.group_rule import OTHER, GroupRule, register_group
from hf_precision.rules.groups.registry import register_group_rule

Paths = dict[str, tuple[str, ...]]
_LLAVA: Paths = {
    "vision_encoder": ("model.vision_tower",),
    "projector": ("model.multi_modal_projector",),
    "language_model": ("model.language_model",),
    "lm_head": ("lm_head",),
}
# builder -> (rule, paths, direct params)
TINY: dict[str, tuple[str, Paths, Paths]] = {
    "tiny_llava": ("llava", _LLAVA, {}),
    "tiny_llava_next": ("llava", _LLAVA, {"resampler": ("model.image_newline",)}),
    "tiny_idefics2": (
        "idefics2",
        {
            "vision_encoder": ("model.vision_model",),
            "resampler": ("model.connector.perceiver_resampler",),
            "projector": ("model.connector.modality_projection",),
            "language_model": ("model.text_model",),
            "lm_head": ("lm_head",),
        },
        {},
    ),
    "tiny_idefics3": (
        "idefics3",
        {
            "vision_encoder": ("model.vision_model",),
            "resampler": ("model.connector",),
            "projector": ("model.connector.modality_projection",),
            "language_model": ("model.text_model",),
            "lm_head": ("lm_head",),
        },
        {},
    ),
    "tiny_qwen2_vl": (
        "qwen2_vl",
        {
            "vision_encoder": ("model.visual",),
            "projector": ("model.visual.merger",),
            "language_model": ("model.language_model",),
            "lm_head": ("lm_head",),
        },
        {},
    ),
    "tiny_paligemma": ("vision_tower_projector", _LLAVA, {}),
    "tiny_minicpmv4_6": (
        "minicpmv",
        {
            "vision_encoder": ("model.vision_tower",),
            "resampler": ("model.merger",),
            "language_model": ("model.language_model",),
            "lm_head": ("lm_head",),
        },
        {},
    ),
    "tiny_blip2": (
        "blip_2",
        {
            "vision_encoder": ("vision_model",),
            "resampler": ("qformer",),
            "projector": ("language_projection",),
            "language_model": ("language_model",),
            "lm_head": ("language_model.lm_head",),
        },
        {"resampler": ("query_tokens",)},
    ),
    "tiny_kosmos2": (
        "kosmos2",
        {
            "vision_encoder": ("vision_model",),
            "resampler": ("image_to_text_projection",),
            "projector": ("image_to_text_projection.dense",),
            "language_model": ("text_model",),
            "lm_head": ("text_model.lm_head",),
        },
        {"resampler": ("image_to_text_projection.latent_query",)},
    ),
    "MiniCPMV2Tiny": (
        "minicpmv2_omnilmm",
        {
            "vision_encoder": ("vpm",),
            "resampler": ("resampler",),
            "language_model": ("llm",),
            "lm_head": ("llm.lm_head",),
        },
        {},
    ),
    "OmniLMMTiny": (
        "minicpmv2_omnilmm",
        {
            "vision_encoder": ("model.vision_tower",),
            "resampler": ("model.resampler",),
            "language_model": ("model",),
            "lm_head": ("lm_head",),
        },
        {},
    ),
    "XComposerTiny": (
        "internlm_xcomposer",
        {
            "vision_encoder": ("vit",),
            "projector": ("vision_proj",),
            "language_model": ("model",),
            "lm_head": ("output",),
        },
        {"vision_encoder": ("plora_glb_GN", "plora_sub_GN")},
    ),
    "XTunerLLaVATiny": (
        "xtuner_llava",
        {
            "vision_encoder": ("visual_encoder",),
            "projector": ("projector",),
            "language_model": ("llm",),
            "lm_head": ("llm.lm_head",),
        },
        {},
    ),
    "InternVLTiny": (
        "internvl_chat",
        {
            "vision_encoder": ("vision_model",),
            "projector": ("mlp1",),
            "language_model": ("language_model",),
            "lm_head": ("language_model.lm_head",),
        },
        {},
    ),
    "DeepSeekVLTiny": (
        "deepseek_vl_remote",
        {
            "vision_encoder": ("vision_model",),
            "projector": ("aligner",),
            "language_model": ("language_model",),
            "lm_head": ("language_model.lm_head",),
        },
        {},
    ),
}


@pytest.fixture(scope="module")
def llava() -> nn.Module:
    return tiny.tiny_llava()


@pytest.mark.parametrize("builder", list(TINY))
def test_tiny_models_exact_groups(builder: str) -> None:
    if builder == "tiny_minicpmv4_6" and not tiny.tiny_available("minicpmv4_6"):
        pytest.skip("MiniCPM-V 4.6 is not in this transformers (it came with 5.x)")
    model = getattr(tiny, builder)()
    rule, paths, params = TINY[builder]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known layout never warns
        groups = find_module_groups(model)
    assert (groups.rule, groups.paths, groups.params) == (rule, paths, params)
    assert groups.prefix == "" and groups.hidden == {}
    registered = dict(model.named_modules())
    for group, group_paths in paths.items():
        for path in group_paths:
            assert path in registered
            assert groups.group_of(path) == group  # nested groups: the longest prefix wins
    # Every parameter belongs to a named group; direct parameters to theirs.
    for name, _ in model.named_parameters():
        assert groups.group_of(name) != OTHER, name
    for group, names in params.items():
        assert all(groups.group_of(n) == group for n in names)


def test_nested_merger_and_tied_head() -> None:
    g = find_module_groups(tiny.tiny_qwen2_vl())
    assert g.group_of("model.visual.merger.mlp.0.weight") == "projector"
    assert g.group_of("model.visual.blocks.0.attn.qkv.weight") == "vision_encoder"
    assert g.group_of("model.visual") == "vision_encoder"
    pali = tiny.tiny_paligemma()  # lm_head tied to the LM embeddings: both names resolve
    assert pali.lm_head.weight is pali.model.language_model.embed_tokens.weight
    g = find_module_groups(pali)
    assert g.group_of("lm_head.weight") == "lm_head"
    assert g.group_of("model.language_model.embed_tokens.weight") == "language_model"
    assert g.names == ("vision_encoder", "projector", "language_model", "lm_head")


def test_text_only_causal_lm_uses_the_fallback_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = find_module_groups(tiny.tiny_text_llama())
    assert g.paths == {"language_model": ("model",), "lm_head": ("lm_head",)}
    assert g.rule == "fallback(language_model=get_decoder, lm_head=get_output_embeddings)"
    assert "vision_encoder" not in g


class NamedVLM(nn.Module):
    """A custom VLM with the names transformers' get_encoder/get_decoder look for."""

    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = nn.Linear(4, 4)
        self.mm_projector = nn.Linear(4, 8)
        self.language_model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
        self.lm_head = nn.Linear(8, 10)
        self.image_newline = nn.Parameter(torch.zeros(8))


class GetterVLM(nn.Module):
    """Odd names, but the transformers accessors point at the parts."""

    def __init__(self) -> None:
        super().__init__()
        self.eye, self.bridge = nn.Linear(4, 4), nn.Linear(4, 8)
        self.brain, self.mouth = nn.Linear(8, 8), nn.Linear(8, 10)

    def get_encoder(self, modality: str | None = None) -> nn.Module:
        return self.eye if modality == "image" else self  # transformers: self = not found

    def get_decoder(self) -> nn.Module:
        return self.brain

    def get_output_embeddings(self) -> nn.Module:
        return self.mouth


def test_fallback_reports_name_and_pattern_matches() -> None:
    g = find_module_groups(NamedVLM())
    assert g.rule == (
        "fallback(vision_encoder=name:vision_tower, language_model=name:"
        "language_model, lm_head=name:lm_head, projector=pattern:mm_projector, "
        "resampler=param:image_newline)"
    )
    assert g.paths == {
        "vision_encoder": ("vision_tower",),
        "language_model": ("language_model",),
        "lm_head": ("lm_head",),
        "projector": ("mm_projector",),
    }
    assert g.params == {"resampler": ("image_newline",)}
    assert g.group_of("image_newline") == "resampler"
    assert g.group_of("language_model.1.weight") == "language_model"


def test_fallback_reports_getter_matches() -> None:
    g = find_module_groups(GetterVLM())
    assert g.rule == (
        "fallback(vision_encoder=get_encoder(image), language_model=get_decoder, "
        "lm_head=get_output_embeddings)"
    )
    assert g.paths == {
        "vision_encoder": ("eye",),
        "language_model": ("brain",),
        "lm_head": ("mouth",),
    }
    assert g.group_of("bridge.weight") == OTHER  # nothing says what it is


def test_unrecognised_plain_model_is_one_group_quietly(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Fix: register_group_rule" for a model with no VLM
        with caplog.at_level("DEBUG", logger="hf_precision"):
            g = find_module_groups(model)
    assert (g.rule, g.paths, g.names) == ("none", {}, ())
    assert g.group_of("0.weight") == OTHER
    said = [r for r in caplog.records if r.name == "hf_precision"]
    assert len(said) == 1 and said[0].levelname == "DEBUG"
    assert "find_module_groups(Sequential): no module groups recognised" in said[0].getMessage()
    assert "register_group_rule" not in said[0].getMessage()
    with pytest.raises(
        PrecisionError,
        match=r"(?s)no module groups recognised.*Fix: register_group_rule\(GroupRule",
    ):
        find_module_groups(model, strict=True)


class _UnknownVLM(nn.Module):
    """Looks multimodal (an image adapter) but no rule or fallback name matches it."""

    def __init__(self) -> None:
        super().__init__()
        self.image_adapter = nn.Linear(2, 2)
        self.body = nn.Linear(2, 2)


def test_unrecognised_multimodal_model_warns_with_the_fix() -> None:
    with pytest.warns(
        PrecisionWarning,
        match=r"(?s)find_module_groups\(_UnknownVLM\): no module groups recognised "
        r"\(model_type=None\).*looks multimodal \(module image_adapter \(Linear\)\).*"
        r"Fix: register_group_rule",
    ):
        g = find_module_groups(_UnknownVLM())
    assert g.rule == "none"


def test_qwen2_vl_merger_is_the_projector_and_the_old_name_is_renamed() -> None:
    g = find_module_groups(tiny.tiny_qwen2_vl())
    assert g.paths["projector"] == ("model.visual.merger",) and "resampler" not in g
    assert g.renamed == {"resampler": "projector"}
    assert find_module_groups(tiny.tiny_llava()).renamed == {}  # only where the rule says so


def _wrapped_names_resolve(wrapped: nn.Module, prefix: str) -> None:
    g = find_module_groups(wrapped)
    assert (g.rule, g.paths, g.prefix) == ("llava", _LLAVA, prefix)
    names = [n for n, _ in wrapped.named_parameters()]
    assert names and all(n.startswith(prefix) for n in names)
    assert all(g.group_of(n) != OTHER for n in names)
    vision = [n for n in names if ".vision_tower." in n]
    assert vision and all(g.group_of(n) == "vision_encoder" for n in vision)


def test_peft_lora_is_unwrapped() -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(tiny.tiny_llava(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert isinstance(model, PeftModel)
    _wrapped_names_resolve(model, "base_model.model.")
    g = find_module_groups(model)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert {g.group_of(n) for n in lora} == {"vision_encoder", "language_model"}


def test_torch_compile_and_data_parallel_are_unwrapped(llava: nn.Module) -> None:
    compiled: Any = torch.compile(llava)  # never run: only the wrapper is inspected
    assert type(compiled).__name__ == "OptimizedModule"
    _wrapped_names_resolve(compiled, "_orig_mod.")
    # DDP needs a process group; DataParallel (CPU: no devices) has the same ``.module`` shape.
    _wrapped_names_resolve(nn.DataParallel(llava), "module.")
    _wrapped_names_resolve(nn.DataParallel(compiled), "module._orig_mod.")


def test_hidden_tower_is_reported_not_grouped() -> None:
    model = tiny.OmniLMMTiny(tune_clip=False)  # OmniLMM: self.vision_tower = [tower]
    with pytest.warns(
        PrecisionWarning,
        match=r"(?s)vision_encoder='model.vision_tower' \(held "
        r"in a list\) is reachable as an attribute but is not a registered "
        r"submodule.*Fix: register it",
    ):
        g = find_module_groups(model)
    assert g.hidden == {"vision_encoder": "model.vision_tower"}
    assert g.held == {"vision_encoder": "list"}
    assert g.to_dict()["hidden"] == {
        "vision_encoder": {"path": "model.vision_tower", "held": "list"}
    }
    assert "model.vision_tower (hidden: held in a list" in str(g)
    assert "vision_encoder" not in g.paths and g.paths["resampler"] == ("model.resampler",)


@pytest.mark.parametrize("how", ["tuple", "dict", "attribute"])
def test_hidden_modules_of_every_kind(how: str) -> None:
    from hf_precision.rules.groups.module_groups import hidden_module, resolve_hidden

    model = tiny.OmniLMMTiny()
    tower = model.model._modules.pop("vision_tower")
    holder: Any = {"tuple": (tower,), "dict": {"clip": tower}}.get(how)
    if holder is not None:
        model.model.__dict__["vision_tower"] = holder
    else:  # a module in the instance __dict__, bypassing nn.Module.__setattr__
        model.model.__dict__["vision_tower"] = tower
    assert resolve_hidden(model, "model.vision_tower") == (tower, how)
    assert hidden_module(model, "model.vision_tower") is tower
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        g = find_module_groups(model)
    assert g.hidden == {"vision_encoder": "model.vision_tower"} and g.held["vision_encoder"] == how


def test_module_groups_api(llava: Any) -> None:
    g = find_module_groups(llava)
    assert "projector" in g and "resampler" not in g
    assert g.modules("vision_encoder") == [llava.model.vision_tower]
    assert g.modules("resampler") == []
    assert g.to_dict() == {
        "rule": "llava",
        "model_type": "llava",
        "groups": {k: list(v) for k, v in _LLAVA.items()},
        "params": {},
        "hidden": {},
    }
    assert "vision_encoder  model.vision_tower" in str(g)
    assert dict(g.items()) == _LLAVA


# --- registry ------------------------------------------------------------------------------


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Rules and group names registered by a test vanish after it."""
    rules, names = list(GR.group_rules()), list(GS.GROUP_NAMES)
    yield
    GR._RULES[:], GS.GROUP_NAMES[:] = rules, names


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (
            GroupRule("llava", paths={"language_model": "x"}),
            r"GroupRule\(name='llava'\)\): a rule of that name exists. Fix: choose another name",
        ),
        (
            GroupRule("MyVLM", paths={"language_model": "x"}),
            r"GroupRule\(name='MyVLM'\)\): rule names are lowercase identifiers",
        ),
        (
            GroupRule("my_vlm", paths={"vision": ("x",), "language_model": "y"}),
            r"unknown group\(s\) \['vision'\]. Allowed: vision_encoder, resampler, projector, "
            r"audio_encoder, language_model, lm_head\b.*Fix: register_group\(name\) first",
        ),
        (
            GroupRule("my_vlm", paths={"language_model": "y"}, required=("decoder",)),
            r"unknown group\(s\) \['decoder'\]",
        ),
    ],
)
def test_register_group_rule_validation(
    clean_registry: None, rule: GroupRule, message: str
) -> None:
    before = GR.group_rules()
    with pytest.raises(PrecisionError, match=message):
        register_group_rule(rule)
    assert GR.group_rules() == before


def test_group_rule_paths_are_normalised_and_checked() -> None:
    rule = GroupRule("my_vlm", paths={"language_model": "decoder"}, model_types="my_vlm")  # type: ignore[arg-type]
    assert rule.paths == {"language_model": ("decoder",)} and rule.model_types == ("my_vlm",)
    with pytest.raises(
        PrecisionError,
        match=r"GroupRule\(name='my_vlm'\): paths\['lm_head'\]="
        r"\(3,\) must be module paths",
    ):
        GroupRule("my_vlm", paths={"lm_head": (3,)})  # type: ignore[dict-item]
    with pytest.raises(PrecisionError, match=r"params\['resampler'\]=\(''\,\)"):
        GroupRule("my_vlm", paths={}, params={"resampler": ("",)})


@pytest.mark.parametrize("name", ["Depth", "depth-encoder", "1st", OTHER])
def test_register_group_validation(clean_registry: None, name: str) -> None:
    with pytest.raises(
        PrecisionError,
        match=rf"register_group\({name!r}\): group names are "
        "lowercase identifiers",
    ):
        register_group(name)


def test_registered_rule_and_group_are_used(clean_registry: None) -> None:
    model = NamedVLM()
    model.config = type("Cfg", (), {"model_type": "my_vlm"})()  # type: ignore[assignment]
    register_group("depth_encoder")
    register_group_rule(
        GroupRule(
            "my_vlm",
            model_types=("my_vlm",),
            paths={"depth_encoder": "vision_tower", "language_model": "language_model"},
            params={"resampler": "image_newline"},
        )
    )
    g = find_module_groups(model)
    assert (g.rule, g.model_type) == ("my_vlm", "my_vlm")
    assert g.names == ("resampler", "language_model", "depth_encoder")
    assert g.group_of("vision_tower.weight") == "depth_encoder"
    # first=True overrides a built-in rule for its model type.
    register_group_rule(
        GroupRule("llava_flat", model_types=("llava",), paths={"language_model": "model"}),
        first=True,
    )
    assert find_module_groups(tiny.tiny_llava()).paths == {"language_model": ("model",)}
    GR.unregister_group_rule("llava_flat")
    assert find_module_groups(tiny.tiny_llava()).rule == "llava"


def test_rule_whose_required_group_is_missing_falls_through(clean_registry: None) -> None:
    register_group_rule(
        GroupRule(
            "needs_qformer",
            model_types=("llava",),
            paths={"resampler": "qformer", "language_model": "model"},
            required=("resampler",),
        ),
        first=True,
    )
    assert find_module_groups(tiny.tiny_llava()).rule == "llava"


# --- cost ------------------------------------------------------------------------------------


def _best(fn: Callable[[], Any], n: int = 7) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def test_cheap_on_7b_meta_models() -> None:
    """Benchmarks call this on 7B meta models: a rule costs a few dict lookups, the fallback one
    shallow walk; both stay below one bare pass over named_parameters()."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    with torch.device("meta"):
        models = [LlavaForConditionalGeneration(LlavaConfig()), LlamaForCausalLM(LlamaConfig())]
    for model in models:
        assert sum(p.numel() for p in model.parameters()) > 6e9
        bare = _best(lambda: sum(1 for _ in model.named_parameters()))  # noqa: B023
        found = _best(lambda: find_module_groups(model))  # noqa: B023
        assert found < bare, (type(model).__name__, found, bare)


def _real_remote_layouts() -> dict[str, tuple[nn.Module, str, Paths, Paths]]:
    """Variants of the remote layouts the tiny models do not carry."""
    omni = tiny.tiny_text_llama()  # OmniLMM-12B: towers inside the Mistral body ``model``
    omni.model.vision_tower, omni.model.resampler = nn.Linear(4, 4), nn.Linear(4, 32)
    omni.config.model_type = "omnilmm"
    minicpmo = tiny.MiniCPMV2Tiny()  # MiniCPM-o: Whisper ``apm`` + its projection
    minicpmo.apm, minicpmo.audio_projection_layer = nn.Linear(4, 4), nn.Linear(4, 32)
    xc25 = tiny.XComposerTiny()  # XComposer 2.5: separators fed to the vit, a video projector
    xc25.plora_glb_GN = nn.Parameter(torch.zeros(1, 1, 16))
    xc25.plora_sub_GN = nn.Parameter(torch.zeros(1, 1, 1, 16))
    xc25.video_mem_proj = nn.Linear(16, 32)
    return {
        "omnilmm": (
            omni,
            "minicpmv2_omnilmm",
            {
                "vision_encoder": ("model.vision_tower",),
                "resampler": ("model.resampler",),
                "language_model": ("model",),
                "lm_head": ("lm_head",),
            },
            {},
        ),
        "minicpmo": (
            minicpmo,
            "minicpmv2_omnilmm",
            {
                "vision_encoder": ("vpm",),
                "resampler": ("resampler",),
                "language_model": ("llm",),
                "lm_head": ("llm.lm_head",),
                "audio_encoder": ("apm", "audio_projection_layer"),
            },
            {},
        ),
        "xcomposer2_5": (
            xc25,
            "internlm_xcomposer",
            {
                "vision_encoder": ("vit",),
                "projector": ("vision_proj", "video_mem_proj"),
                "language_model": ("model",),
                "lm_head": ("output",),
            },
            {"vision_encoder": ("plora_glb_GN", "plora_sub_GN")},
        ),
    }


@pytest.mark.parametrize("layout", ["omnilmm", "minicpmo", "xcomposer2_5"])
def test_real_remote_layout_variants(layout: str) -> None:
    model, rule, paths, params = _real_remote_layouts()[layout]
    g = find_module_groups(model)
    assert (g.rule, g.paths, g.params) == (rule, paths, params)
    for name, _ in model.named_parameters():
        assert g.group_of(name) != OTHER, name
    if layout == "omnilmm":  # nested towers win over the LM body around them
        assert g.group_of("model.vision_tower.weight") == "vision_encoder"
        assert g.group_of("model.layers.0.self_attn.q_proj.weight") == "language_model"


def test_find_module_groups_of_what_is_not_a_model_says_so() -> None:
    with pytest.raises(PrecisionError, match=r"^find_module_groups\(model\): expected a torch"):
        find_module_groups("llava-hf/llava-1.5-7b-hf")  # type: ignore[arg-type]


def test_a_config_with_a_vision_config_looks_multimodal() -> None:
    import types

    model = nn.Sequential(nn.Linear(2, 2))
    model.config = types.SimpleNamespace(model_type="my_vlm", vision_config={})  # type: ignore[assignment]
    with pytest.warns(PrecisionWarning, match=r"looks multimodal \(config\.vision_config\)"):
        assert find_module_groups(model).rule == "none"
