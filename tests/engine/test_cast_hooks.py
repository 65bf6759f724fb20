"""The guards' run-time hooks (``hf_precision.engine.cast_hooks``): the per-call cast."""

import torch

from hf_precision import PrecisionPolicy, enforce_policy, install_guards
from hf_precision.engine.cast_hooks import guard_hook
from hf_precision.engine.hooks import guard_targets
from hf_precision.tiny import tiny_llava


def _guarded(preset="bf16-true", **kw):
    model = tiny_llava()
    policy = PrecisionPolicy.from_preset(preset, **kw)
    report = enforce_policy(model, policy)
    return model, policy, install_guards(model, policy, report)


def test_hot_path_returns_none_when_nothing_to_cast():
    model, _, _ = _guarded()
    lin = model.model.multi_modal_projector
    x = torch.rand(2, 32, dtype=torch.bfloat16)
    assert guard_hook(lin, (x,), {}) is None
    new_args, _ = guard_hook(lin, (x.float(),), {})
    assert new_args[0].dtype == torch.bfloat16


def test_audit_mode_reads_and_casts_nothing():
    model, _, _ = _guarded(mode="audit")
    lin = model.model.multi_modal_projector
    assert guard_targets(model)["model.multi_modal_projector"][0] == "boundary"
    x = torch.rand(2, 32, dtype=torch.float16)
    assert guard_hook(lin, (x,), {"y": x}) is None  # off target, but audit only reads


def _states(model):
    # the guard's per-module state (private): where each hook sends inputs, in which dtype
    return [st for m in model.modules() if (st := m.__dict__.get("_hf_precision_guard"))]


def test_guards_follow_the_module_to_meta_and_back():
    # OneTrainer offloads models between devices during training; a move to or from meta (and
    # to_empty) puts new Parameter objects in the module: the guards read where it is now.
    from hf_precision.frontends.diffusion import guard_diffusion
    from hf_precision.tiny.diffusion import tiny_text_encoder

    te = tiny_text_encoder()
    ids = torch.randint(0, 10, (1, 7))
    guard = guard_diffusion({"text_encoder": te}, "fp16")
    assert {st.device for st in _states(te)} == {torch.device("cpu")}
    saved = {k: v.clone() for k, v in [*te.named_parameters(), *te.named_buffers()]}
    te.to("meta")  # offloaded: the weights are gone, the guards stay
    out = te(ids.to("meta"))  # main: the batch guard copied the ids back to the CPU
    assert out.last_hidden_state.device.type == "meta"
    assert {st.device for st in _states(te)} == {None}  # nothing to send inputs to on meta
    te.to_empty(device="cpu")
    with torch.no_grad():  # position_ids are not in the state dict: copy every tensor back
        for k, v in [*te.named_parameters(), *te.named_buffers()]:
            v.copy_(saved[k])
    te.float()  # and back in float32: the guards follow the weights now held, not the old ones
    out = te(ids)
    assert out.last_hidden_state.device.type == "cpu"
    assert out.last_hidden_state.dtype == torch.float32
    assert {st.device for st in _states(te)} == {torch.device("cpu")}
    assert {st.dtype for st in _states(te) if st.kind != "batch"} == {torch.float32}
    guard.remove()
