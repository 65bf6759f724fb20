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
