"""What the model and the tools around it keep in float32 on purpose
(hf_precision.rules.keep_rules):
the model's ``_keep_in_fp32_modules_strict`` (a real GLM-4.5V-MoE, loaded as transformers
loads it), the non-strict list's transformers >= 5 semantics, and what the guard never touches
(optimizer state, EMA copies)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision import PrecisionGuardCallback, PrecisionPolicy, enforce_policy
from hf_precision.engine.hooks import guard_targets, install_guards, remove_guards
from hf_precision.errors import PrecisionError
from hf_precision.rules.keep_rules import model_keep_lists
from hf_precision.tiny import tiny_llava

transformers = pytest.importorskip("transformers")
HAS_GLM4V_MOE = bool(
    getattr(
        getattr(transformers, "Glm4vMoeForConditionalGeneration", None),
        "_keep_in_fp32_modules_strict",
        None,
    )
)
needs_glm = pytest.mark.skipif(
    not HAS_GLM4V_MOE,
    reason=f"transformers {transformers.__version__} has no Glm4vMoeForConditionalGeneration "
    "declaring _keep_in_fp32_modules_strict (its MoE router list came with the 5.x line)",
)
STRICT = (
    "model.language_model.layers.1.mlp.gate.weight",
    "model.language_model.layers.1.mlp.gate.e_score_correction_bias",
)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GLM-4.5V-MoE saved in float32 (one dense layer, one MoE layer of 4 experts), its
    router bias filled with values bf16 and fp16 cannot hold."""
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    text = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        moe_intermediate_size=16,
        num_experts_per_tok=2,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        # 16-dim heads, half of them rotary: 4 frequencies split over (t, h, w)
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=32,
        out_hidden_size=32,
        patch_size=4,
        image_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    ids = dict(
        image_token_id=120,
        video_token_id=121,
        image_start_token_id=122,
        image_end_token_id=123,
        video_start_token_id=124,
        video_end_token_id=125,
    )
    torch.manual_seed(0)
    model = Glm4vMoeForConditionalGeneration(
        Glm4vMoeConfig(text_config=text, vision_config=vision, **ids)
    )
    with torch.no_grad():
        model.get_buffer(STRICT[1]).uniform_(-1, 1)
    path = tmp_path_factory.mktemp("glm4v_moe")
    model.save_pretrained(path)
    return path


def _glm(path: Path, dtype: torch.dtype = torch.bfloat16) -> Any:
    """The model as ``from_pretrained(dtype=...)`` loads it: the strict list in float32."""
    from transformers import Glm4vMoeForConditionalGeneration

    model = Glm4vMoeForConditionalGeneration.from_pretrained(path, dtype=dtype)
    model.requires_grad_(False)
    return model


def _strict(model: Any) -> dict[str, torch.Tensor]:
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {n: named[n].detach().clone() for n in STRICT}


def _assert_exact(model: Any, before: dict[str, torch.Tensor]) -> None:
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, value in before.items():
        assert named[name].dtype == torch.float32, (name, named[name].dtype)
        assert torch.equal(named[name], value), name


@needs_glm
def test_the_loader_keeps_the_strict_list_fp32_as_the_tests_assume(glm_dir: Path) -> None:
    model = _glm(glm_dir)
    assert model_keep_lists(model)[1] and model.dtype == torch.bfloat16
    assert {t.dtype for t in _strict(model).values()} == {torch.float32}
    # not bf16-exact: a cast would change its bits
    bias = _strict(model)[STRICT[1]]
    assert not torch.equal(bias.bfloat16().float(), bias)


@needs_glm
@pytest.mark.parametrize(
    ("preset", "mode", "load"),
    [
        ("bf16", "fix", torch.bfloat16),
        ("bf16", "audit", torch.bfloat16),
        ("bf16", "raise", torch.bfloat16),
        ("bf16-true", "fix", torch.bfloat16),
        ("fp16", "fix", torch.bfloat16),
        ("fp16", "audit", torch.bfloat16),
        ("fp16-true", "fix", torch.float16),
        ("fp16-true", "raise", torch.float16),
    ],
)
def test_the_strict_list_stays_fp32_under_every_preset_and_mode(
    glm_dir: Path, preset: str, mode: str, load: torch.dtype
) -> None:
    model = _glm(glm_dir, load)
    before = _strict(model)
    report = enforce_policy(model, PrecisionPolicy.from_preset(preset, mode=mode))
    _assert_exact(model, before)
    rules = {n: r for n, _, r, _ in report.kept}
    assert all(rules.get(n) == "keep_fp32_strict" for n in STRICT), rules
    assert not {c.name for c in report.changes} & set(STRICT)
    assert report.to_dict()["kept"][0]["rule"]  # the JSON names the rule per row
    assert any("keep_fp32_strict" in line for line in report.summary().splitlines())


@needs_glm
def test_raise_mode_on_a_downcast_strict_weight_names_the_rule(glm_dir: Path) -> None:
    model = _glm(glm_dir)
    model.get_submodule("model.language_model.layers.1.mlp.gate").to(torch.bfloat16)
    with pytest.raises(PrecisionError, match="keep_in_fp32_modules_strict"):
        enforce_policy(model, PrecisionPolicy.from_preset("bf16", mode="raise"))


@needs_glm
def test_the_router_gets_no_leaf_guard(glm_dir: Path) -> None:
    model = _glm(glm_dir)
    report = enforce_policy(model, PrecisionPolicy.from_preset("bf16", leaf_guards="on"))
    install_guards(model, report.policy, report)
    try:
        targets = guard_targets(model)
        assert "model.language_model.layers.1.mlp.gate" not in targets
        # its neighbours still have theirs
        assert "model.language_model.layers.1.mlp.shared_experts.gate_proj" in targets
    finally:
        remove_guards(model)


@needs_glm
def test_trainer_bf16_keeps_the_router_bias_bit_exact(
    glm_dir: Path, make_trainer: Any, caplog: Any
) -> None:
    model = _glm(glm_dir)
    model.lm_head.requires_grad_(True)
    before = _strict(model)
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 8))
    cb = PrecisionGuardCallback()
    with caplog.at_level(logging.WARNING, logger="hf_precision"):
        trainer = make_trainer(
            model, {"input_ids": ids, "labels": ids}, callbacks=[cb], bf16=True, max_steps=1
        )
        _assert_exact(model, before)
        result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    _assert_exact(model, before)
    assert cb.policy is not None and cb.policy.name == "bf16"
    assert cb.last_report is not None
    rules = {n: r for n, _, r, _ in cb.last_report.kept}
    assert all(rules.get(n) == "keep_fp32_strict" for n in STRICT)
    line = next(r.getMessage() for r in caplog.records if " tensors → " in r.getMessage())
    assert "2 (keep_fp32_strict)" in line, line
    event = Path(trainer.args.output_dir, "precision")
    data = json.loads(sorted(event.glob("*on_init_end.json"))[0].read_text())
    kept = {row["name"]: row["rule"] for row in data["kept"]}
    assert all(kept.get(n) == "keep_fp32_strict" for n in STRICT), kept


@needs_glm
def test_enforce_fp16_keeps_the_router_bias(glm_dir: Path) -> None:
    model = _glm(glm_dir)
    before = _strict(model)
    enforce_policy(model, "fp16")
    _assert_exact(model, before)
    assert model.lm_head.weight.dtype == torch.float16


# ---------------------------------------------------------------- the non-strict list


def _keep_projector_out(dtype: torch.dtype) -> Any:
    model = tiny_llava(dtype)
    model.requires_grad_(False)
    model._keep_in_fp32_modules = ["multi_modal_projector.linear_2"]
    return model


def test_the_non_strict_list_follows_the_loader_bf16_left_bf16() -> None:
    """transformers >= 5 keeps ``_keep_in_fp32_modules`` in fp32 for fp16 loads only: under a
    bf16 policy a bf16 weight of the list is not upcast."""
    model = _keep_projector_out(torch.bfloat16)
    report = enforce_policy(model, "bf16")
    assert model.model.multi_modal_projector.linear_2.weight.dtype == torch.bfloat16
    assert not [k for k in report.kept if "linear_2" in k[0]]


def test_the_non_strict_list_stays_fp32_where_fp16_would_be() -> None:
    model = _keep_projector_out(torch.float32)
    w = model.model.multi_modal_projector.linear_2.weight
    exact = w.detach().clone()
    report = enforce_policy(model, "fp16")
    assert w.dtype == torch.float32 and torch.equal(w, exact)
    assert model.model.multi_modal_projector.linear_1.weight.dtype == torch.float16
    rules = {n: r for n, _, r, _ in report.kept}
    assert rules["model.multi_modal_projector.linear_2.weight"] == "keep_fp32"


def test_the_strict_list_on_any_model_is_kept_with_its_rule() -> None:
    model = tiny_llava(torch.float32)
    model.requires_grad_(False)
    model._keep_in_fp32_modules_strict = ["multi_modal_projector.linear_2"]
    w = model.model.multi_modal_projector.linear_2.weight
    exact = w.detach().clone()
    report = enforce_policy(model, "bf16")
    assert w.dtype == torch.float32 and torch.equal(w, exact)
    assert model.model.multi_modal_projector.linear_1.weight.dtype == torch.bfloat16
    rules = {n: r for n, _, r, _ in report.kept}
    assert rules["model.multi_modal_projector.linear_2.weight"] == "keep_fp32_strict"


# ---------------------------------------------------------------- never the guard's to cast


def test_optimizer_state_and_an_ema_copy_keep_their_dtypes_and_identity() -> None:
    """Optimizer state and an EMA shadow held outside the model follow their parameters: the
    guard casts the model's tensors, never those."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = tiny_llava(torch.float32)
    model.requires_grad_(False)
    proj = model.model.multi_modal_projector.requires_grad_(True)
    opt = torch.optim.AdamW(proj.parameters(), lr=1e-3)
    proj(torch.randn(2, proj.linear_1.in_features)).sum().backward()
    opt.step()
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema.update_parameters(model)
    state = {
        id(p): {k: (v, v.dtype, v.clone()) for k, v in s.items()} for p, s in opt.state.items()
    }
    shadow = {n: (t, t.dtype, t.detach().clone()) for n, t in ema.module.state_dict().items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    enforce_policy(model, "bf16", optimizer=opt)
    assert [p for g in opt.param_groups for p in g["params"]] == params  # same objects
    for p, s in opt.state.items():
        for k, v in s.items():
            ref, dtype, value = state[id(p)][k]
            assert v is ref and v.dtype == dtype and torch.equal(v, value)
    for n, t in ema.module.state_dict().items():
        ref, dtype, value = shadow[n]
        assert t.data_ptr() == ref.data_ptr() and t.dtype == dtype and torch.equal(t, value)
    assert model.model.vision_tower.embeddings.patch_embedding.weight.dtype == torch.bfloat16


def test_an_fp32_head_is_kept_only_when_the_trainer_asks() -> None:
    """``keep_fp32_head`` (set from ``cast_lm_head_to_fp32=True``): an fp32 ``lm_head`` beside
    a half model stays fp32; without it, fp32 shared by the whole head group is cast."""
    model = tiny_llava(torch.bfloat16)
    model.requires_grad_(False)
    model.lm_head.float()
    exact = model.lm_head.weight.detach().clone()
    enforce_policy(model, PrecisionPolicy.from_preset("bf16"))
    assert model.lm_head.weight.dtype == torch.bfloat16
    model.lm_head.weight.data = exact.clone()
    report = enforce_policy(model, PrecisionPolicy.from_preset("bf16", keep_fp32_head=True))
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, exact)
    rules = {n: r for n, _, r, _ in report.kept}
    assert rules["lm_head.weight"] == "deliberate_fp32"


# ---------------------------------------------------------------- model.dtype must not lie


def test_a_kept_first_parameter_is_bridged_and_said_with_model_dtype() -> None:
    """Idefics2 casts ``pixel_values.to(self.dtype)``, and ``model.dtype`` is the first floating
    parameter: the patch embedding. Pinned fp32 (``keep_fp32``) under bf16, it makes
    ``model.dtype`` float32; the guard hands the patch embedding's output on in bf16 (the tower
    gets bf16 activations) and says it once, naming ``model.dtype``, the parameter and the
    consumers."""
    from hf_precision.tiny import tiny_batch, tiny_idefics2

    model = tiny_idefics2(torch.float32)
    model.requires_grad_(False)
    first = "model.vision_model.embeddings.patch_embedding.weight"
    assert next(iter(model.named_parameters()))[0] == first
    policy = PrecisionPolicy.from_preset(
        "bf16", keep_fp32=["model.vision_model.embeddings.patch_embedding"]
    )
    with pytest.warns(Warning, match=r"\.dtype reads float32") as said:
        report = enforce_policy(model, policy)
    text = next(str(w.message) for w in said if "dtype reads" in str(w.message))
    assert first in text and "pixel_values.to(self.dtype)" in text and "keep_fp32" in text
    assert "hands its outputs on in bfloat16" in text
    assert model.dtype == torch.float32  # what the user pinned stays pinned
    seen: dict[str, torch.dtype] = {}
    layer = model.model.vision_model.encoder.layers[0]

    def record(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.setdefault("tower", (args[0] if args else kwargs["hidden_states"]).dtype)

    hook = layer.register_forward_pre_hook(record, with_kwargs=True)
    handle = install_guards(model, policy, report)
    assert "model.vision_model.embeddings.patch_embedding" in handle.exit
    try:
        out = model(**tiny_batch(model))
    finally:
        hook.remove()
        remove_guards(model)
    assert seen["tower"] == torch.bfloat16  # no fp32 activations into the bf16 tower
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    assert model.model.vision_model.embeddings.patch_embedding.weight.dtype == torch.float32


def test_a_whole_tower_kept_fp32_is_not_handed_over_in_half() -> None:
    """The layers after a kept first parameter are kept too (a whole tower on a keep list, as
    an audio tower on a strict list): its output must stay fp32 for them; no exit hook there."""
    from hf_precision.tiny import tiny_batch, tiny_idefics2

    model = tiny_idefics2(torch.float32)
    model.requires_grad_(False)
    policy = PrecisionPolicy.from_preset("bf16", keep_fp32=["model.vision_model"])
    with pytest.warns(Warning, match="kept in float32 too"):
        report = enforce_policy(model, policy)
    handle = install_guards(model, policy, report)
    try:
        assert "model.vision_model.embeddings.patch_embedding" not in handle.exit
        out = model(**tiny_batch(model))
    finally:
        remove_guards(model)
    assert torch.isfinite(out.loss)
    assert model.model.vision_model.encoder.layers[0].mlp.fc1.weight.dtype == torch.float32


# ---------------------------------------------------------------- found fp32: never rounded
def _saved(tmp_path: Path, name: str) -> Path:
    """A tiny BLIP-2 (``_keep_in_fp32_modules = ["query_tokens", "qformer"]``) or T5 (``["wo"]``)
    saved in float32, loaded back as a user would."""
    from transformers import T5Config, T5ForConditionalGeneration

    from hf_precision.tiny import tiny_blip2

    torch.manual_seed(0)
    if name == "blip2":
        model = tiny_blip2()
    else:
        config = T5Config(
            vocab_size=64,
            d_model=16,
            d_kv=4,
            d_ff=32,
            num_layers=1,
            num_heads=2,
            decoder_start_token_id=0,
        )
        model = T5ForConditionalGeneration(config)
    model.save_pretrained(tmp_path / name)
    return tmp_path / name


def _kept_names(model: Any, name: str) -> list[str]:
    if name == "blip2":
        return [n for n, _ in model.named_parameters() if n.startswith(("query_tokens", "qformer"))]
    return [n for n, _ in model.named_parameters() if ".wo." in n]


@pytest.mark.parametrize("name", ["blip2", "t5"])
@pytest.mark.parametrize("load", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_a_keep_module_found_fp32_stays_fp32_under_a_real_trainer(
    tmp_path: Path, make_trainer: Any, name: str, load: str, flag: str
) -> None:
    """``_keep_in_fp32_modules`` found in float32 (the loader kept it for an fp16 load, or the
    model was loaded in float32) stays float32, bit for bit, under ``bf16=True`` and
    ``fp16=True``; found in bfloat16 under a bf16 policy it stays bfloat16 (never upcast)."""
    import warnings

    from transformers import Blip2ForConditionalGeneration, T5ForConditionalGeneration

    from hf_precision.tiny import tiny_batch

    cls = Blip2ForConditionalGeneration if name == "blip2" else T5ForConditionalGeneration
    model = cls.from_pretrained(_saved(tmp_path, name), dtype=getattr(torch, load))
    kept = _kept_names(model, name)
    params = dict(model.named_parameters())
    found = {params[n].dtype for n in kept}
    assert found == {torch.float32 if load != "bfloat16" else torch.bfloat16}  # the loader
    exact = {n: params[n].detach().clone() for n in kept}
    for n in kept:  # the kept modules frozen: what the policy decides for them is the rule's
        params[n].requires_grad_(False)
    if name == "blip2":
        model.vision_model.requires_grad_(False)
        batch = tiny_batch(model, 2)
    else:
        ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids.clone()}
    callback = PrecisionGuardCallback()
    trainer = make_trainer(model, batch, callbacks=[callback], max_steps=1, **{flag: True})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    want = torch.bfloat16 if (load, flag) == ("bfloat16", "bf16") else torch.float32
    wrong = {n: params[n].dtype for n in kept if params[n].dtype != want}
    assert not wrong, f"{name} loaded {load}, {flag}=True: {wrong}"
    if want == torch.float32 and load != "bfloat16":  # found fp32: not rounded on the way
        assert all(torch.equal(params[n], exact[n]) for n in kept)
