"""Where the guards go and what they target (``hf_precision.engine.hook_targets``)."""

from hf_precision import PrecisionPolicy, enforce_policy, find_module_groups, install_guards
from hf_precision.engine.hook_targets import handover_roots
from hf_precision.tiny import tiny_llava


def test_exit_hooks_sit_where_features_leave_the_image_path():
    from hf_precision.tiny import tiny_blip2, tiny_idefics2, tiny_idefics3, tiny_qwen2_vl

    cases = {
        tiny_llava: ["model.multi_modal_projector"],
        # no projector: the resampler hands over, through the vision tower that holds it
        tiny_qwen2_vl: ["model.visual"],
        tiny_idefics3: ["model.connector"],  # the projector sits inside the connector
        tiny_idefics2: ["model.connector"],  # projection, then perceiver: their common module
        tiny_blip2: ["language_projection"],  # qformer and projection beside the LM: the last
    }
    for build, expected in cases.items():
        model = build()
        groups = find_module_groups(model)
        assert [p for p, _ in handover_roots(model, groups)] == expected, build.__name__
    model = tiny_llava()
    audit = PrecisionPolicy.from_preset("bf16-true", mode="audit")
    assert install_guards(model, audit, enforce_policy(model, audit)).exit == []


def _bf16_with_trainable_fp32_q_proj():
    import torch

    model = tiny_llava(torch.bfloat16)
    model.requires_grad_(False)
    q_proj = model.model.language_model.layers[0].self_attn.q_proj
    q_proj.float().weight.requires_grad_(True)
    return model, q_proj


def test_a_trainable_fp32_layer_in_a_bf16_group_hands_its_output_on_in_bf16():
    """Outside autocast, a trainable fp32 ``q_proj`` in a bf16 language model made an fp32 ``q``
    beside bf16 ``k``/``v``, which SDPA refuses (and flash kernels have none for): its output
    now leaves in bf16, as under autocast; its weight stays fp32 for the optimizer."""
    import pytest
    import torch

    from hf_precision.tiny import tiny_batch

    model, q_proj = _bf16_with_trainable_fp32_q_proj()
    batch = tiny_batch(model)
    with pytest.raises(RuntimeError, match="dtype"):
        model(**batch)  # unguarded: fp32 into bf16 k_proj (or q beside k/v)
    weight = q_proj.weight
    report = enforce_policy(model, "bf16")  # frozen and compute bf16, trainable fp32
    handle = install_guards(model, "bf16", report)
    assert "model.language_model.layers.0.self_attn.q_proj" in handle.exit
    seen: list[torch.dtype] = []
    q_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    out = model(**batch)
    assert seen == [torch.bfloat16]  # after the exit hook (registered before ours)
    out.loss.backward()
    assert q_proj.weight is weight and weight.dtype == torch.float32  # nothing lowered
    assert weight.grad is not None and weight.grad.dtype == torch.float32
    assert torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0


def test_adapters_the_head_and_kept_layers_keep_their_fp32_outputs():
    import torch
    from peft import LoraConfig, get_peft_model

    from hf_precision.engine.hook_targets import trainable_handovers
    from hf_precision.model.view import ModelView

    model = tiny_llava(torch.bfloat16)
    model.lm_head.float().weight.requires_grad_(True)  # trained head: logits stay fp32
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    for name, p in peft.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()  # peft casts its adapters' outputs itself
    view = ModelView.of(peft)
    assert trainable_handovers(view, ()) == []
    # the same layer named by a keep rule keeps its fp32 output too
    model, _ = _bf16_with_trainable_fp32_q_proj()
    path = "model.language_model.layers.0.self_attn.q_proj"
    view = ModelView.of(model)
    assert [p for p, _, _ in trainable_handovers(view, ())] == [path]
    kept = [(f"{path}.weight", "language_model", "keep_fp32", "user")]
    assert trainable_handovers(view, kept) == []
