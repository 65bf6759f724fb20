import pytest
import torch

from hf_precision import (
    PrecisionError,
    PrecisionPolicy,
    enforce_policy,
    install_guards,
)
from hf_precision.engine.hooks import guard_targets, installed_guards, remove_guards
from hf_precision.tiny import tiny_batch, tiny_llava


def _guarded(preset="bf16-true", **kw):
    model = tiny_llava()
    policy = PrecisionPolicy.from_preset(preset, **kw)
    report = enforce_policy(model, policy)
    return model, policy, install_guards(model, policy, report)


def test_install_is_idempotent_and_removable():
    model, policy, handle = _guarded()
    n = installed_guards(model)
    # batch + 4 group boundaries + the first weighted leaf of 3 groups (lm_head is a leaf)
    assert n == handle.count == 8
    kinds = sorted(kind for kind, _ in guard_targets(model).values())
    assert kinds == ["batch"] + ["boundary"] * 4 + ["entry"] * 3
    hooks_before = sum(len(m._forward_pre_hooks) for m in model.modules())
    again = install_guards(model, policy, enforce_policy(model, policy))
    assert again.added == 0
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks_before
    assert remove_guards(model) == n
    assert installed_guards(model) == 0
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0


def test_batch_and_generate_paths_cast_fp32_inputs():
    model, _, _ = _guarded()
    batch = tiny_batch(model)
    assert batch["pixel_values"].dtype == torch.float32
    out = model(**batch)
    assert out.logits.dtype == torch.bfloat16
    out.loss.backward()
    gen_in = {k: v for k, v in batch.items() if k != "labels"}
    # generate() encodes images through get_image_features outside the top-level forward
    seq = model.generate(**gen_in, max_new_tokens=2, do_sample=False)
    assert seq.shape[1] == batch["input_ids"].shape[1] + 2
    feats = model.model.get_image_features(pixel_values=batch["pixel_values"])
    assert feats is not None


def test_without_guard_a_component_split_fails():
    model = tiny_llava()
    model.model.vision_tower.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="same dtype|should be the same"):
        model(**tiny_batch(model))


def test_raise_mode_names_module_dtypes_and_fix():
    model, _, _ = _guarded(mode="fix")
    policy = PrecisionPolicy.from_preset("bf16-true", mode="raise")
    install_guards(model, policy, enforce_policy(model, policy))
    with pytest.raises(PrecisionError) as err:
        model.model.multi_modal_projector(torch.rand(2, 32))
    text = str(err.value)
    assert "model.multi_modal_projector" in text and "float32" in text and "bfloat16" in text
    assert "Fix:" in text


def test_leaf_guards_in_mixed_group_fix_fp32_norm_leak():
    # class C: an fp32 norm inside a bf16 LM feeds fp32 activations into bf16 linears
    model = tiny_llava()
    policy = PrecisionPolicy.from_preset("bf16-true", keep_fp32=["re:.*input_layernorm"])
    report = enforce_policy(model, policy)
    assert "language_model" in report.mixed_groups
    handle = install_guards(model, policy, report)
    assert handle.leaf, "leaf guards go where dtypes mix"
    kinds = guard_targets(model)
    # the fp32 norm takes bf16 inputs itself: no guard casts them up (its output would carry
    # fp32 into what follows); the layers after it get the leaf guards
    assert "model.language_model.layers.0.input_layernorm" not in kinds
    assert kinds["model.language_model.layers.1.self_attn.q_proj"] == ("leaf", "bfloat16")
    out = model(**tiny_batch(model))
    assert torch.isfinite(out.loss)
    # without leaf guards the same model fails
    remove_guards(model)
    install_guards(model, policy, report, leaf_groups=())
    with pytest.raises(RuntimeError, match="same dtype"):
        model(**tiny_batch(model))


def test_leaf_guards_follow_re_enforcement():
    model, _, handle = _guarded(leaf_guards="on")
    assert handle.leaf
    off = PrecisionPolicy.from_preset("bf16-true", leaf_guards="off")
    handle2 = install_guards(model, off, enforce_policy(model, off))
    assert not handle2.leaf
    assert installed_guards(model) == handle2.count


def test_audit_mode_hooks_change_nothing():
    model = tiny_llava()
    model.model.vision_tower.to(torch.bfloat16)
    policy = PrecisionPolicy.from_preset("bf16-true", mode="audit")
    install_guards(model, policy, enforce_policy(model, policy))
    with pytest.raises(RuntimeError, match="same dtype|should be the same"):
        model(**tiny_batch(model))


def test_exit_hook_hands_a_fp32_projector_over_in_the_embeddings_dtype():
    from hf_precision.tiny import INDEX_PUT_DTYPE_ERROR, InternVLTiny

    model = InternVLTiny(torch.bfloat16)
    model.mlp1.float()  # trained in fp32, as InternVL's finetune recipe keeps it
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("mlp1")
    batch = model.batch()
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="same dtype"):  # bf16 features into the fp32 mlp1
        model(**batch)
    # what the boundary guard alone does (mlp1's input cast): the index put still fails
    entry = model.mlp1.register_forward_pre_hook(lambda m, a: (a[0].float(),))
    with pytest.raises(RuntimeError, match=INDEX_PUT_DTYPE_ERROR):
        model(**batch)
    entry.remove()
    policy = PrecisionPolicy.from_model(model)  # no flag: mlp1 stays fp32
    handle = install_guards(model, policy, enforce_policy(model, policy))
    assert handle.exit == ["mlp1"] and model.mlp1[1].weight.dtype == torch.float32
    assert "exit=1" in repr(handle)
    out = model(**batch)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.mlp1[1].weight.grad is not None
    # generate's own merge (``input_embeds[selected] = vit_embeds``) too
    model.generate(batch["input_ids"], batch["pixel_values"], max_new_tokens=1)
    # the target follows the embeddings when they are cast later
    model.language_model.to(torch.float32)
    assert model.extract_feature(batch["pixel_values"]).dtype == torch.float32
    model.language_model.to(torch.bfloat16)
    assert model.extract_feature(batch["pixel_values"]).dtype == torch.bfloat16
    remove_guards(model)
    assert not model.mlp1._forward_hooks
    assert model.mlp1(torch.randn(1, 4, 64)).dtype == torch.float32  # no exit hook left


def test_install_guards_on_what_is_not_a_model_says_so():
    with pytest.raises(PrecisionError, match=r"^install_guards\(model, policy\): expected a torch"):
        install_guards({"a": 1}, PrecisionPolicy.from_preset("bf16"))


def test_the_notice_hears_the_first_cast_of_each_kind_once() -> None:
    from hf_precision.engine.cast_hooks import Notice

    model = tiny_llava(torch.bfloat16)
    model.model.multi_modal_projector.float()  # a trainable fp32 projector in a bf16 model
    policy = PrecisionPolicy.from_model(model)
    report = enforce_policy(model, policy)
    heard: list[tuple[object, ...]] = []
    handle = install_guards(model, policy, report, notice=Notice(lambda *a: heard.append(a)))
    batch = {k: v for k, v in tiny_batch(model).items() if k != "labels"}
    for _ in range(3):
        model(**batch)
    kinds = [h[0] for h in heard]
    assert len(kinds) == len(set(kinds))  # once per kind, however many forwards
    assert ("batch", "", "pixel_values", torch.float32, torch.bfloat16) in heard
    assert (
        "boundary",
        "model.multi_modal_projector",
        "input 0",
        torch.bfloat16,
        torch.float32,
    ) in heard
    handle.remove()
