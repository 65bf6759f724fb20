"""FSDP2's output_dtype (hf_precision/engine/wrappers/fsdp2.py): real ``fully_shard`` on a
one-rank gloo group (FSDP2 runs with world size 1 on CPU), accelerate's own default FSDP2 policy
for bf16, a tiny LLaVA, the accelerate plugin's guard."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from hf_precision import PrecisionGuardPlugin, PrecisionWarning
from hf_precision.engine.wrappers.fsdp2 import fsdp2_outputs
from hf_precision.tiny import tiny_batch, tiny_llava


@pytest.fixture
def one_rank(tmp_path):
    """A real one-process gloo group (FSDP2 needs one); destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _shard(model, inner, root, unit=lambda layer: layer):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.language_model.layers:
        fully_shard(unit(layer), mp_policy=inner, mesh=mesh)
    fully_shard(model, mp_policy=root, mesh=mesh)


def _attention(layer):
    return layer.self_attn


def _verify(guard, model):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", PrecisionWarning)
        report = guard.verify(model, "after_wrap")
    said = [str(w.message) for w in seen if w.category is PrecisionWarning]
    return report, said


def test_accelerates_default_bf16_policy_rounds_the_loss_and_is_said(one_rank, tmp_path):
    """accelerate's FSDP2 plugin for mixed_precision='bf16' sets output_dtype=bf16: the fp32
    loss transformers computes comes back rounded. The guard says so, with the fix."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")  # what Accelerator(mixed_precision="bf16") sets
    default = plugin.mixed_precision_policy
    assert default.output_dtype == torch.bfloat16
    model = tiny_llava(seed=0)
    guard = PrecisionGuardPlugin("bf16", report_dir=str(tmp_path / "precision"))
    guard.setup(model)
    _shard(model, default, default)
    found = fsdp2_outputs(model)
    assert found.rounded == [("", torch.bfloat16)] and found.bridges == []
    report, said = _verify(guard, model)
    assert len(report.wrapper_findings) == 1
    msg = report.wrapper_findings[0]
    assert msg.startswith(
        "PrecisionGuardPlugin: the FSDP2 root unit <model> has MixedPrecisionPolicy("
        "output_dtype=torch.bfloat16): what the model returns is cast to bfloat16, "
        "transformers' float32 loss included"
    )
    assert (
        "mixed_precision_policy=MixedPrecisionPolicy(" in msg
        and "output_dtype=torch.float32" in msg
    )
    assert said.count(msg) == 1
    (path,) = (tmp_path / "precision").glob("*after_wrap.json")
    event = json.loads(path.read_text())
    assert event["wrapper_findings"] == [msg]
    loss = model(**tiny_batch(model)).loss
    guard.remove()
    # the rounding the message names: the same model with output_dtype=fp32 at the root
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fixed = tiny_llava(seed=0)
    second = PrecisionGuardPlugin("bf16", report=False)
    second.setup(fixed)
    fp32_out = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.float32
    )
    _shard(fixed, default, fp32_out)
    assert fsdp2_outputs(fixed).rounded == []
    assert _verify(second, fixed)[0].wrapper_findings == []
    exact = fixed(**tiny_batch(fixed)).loss
    second.remove()
    assert (loss.dtype, exact.dtype) == (torch.bfloat16, torch.float32)
    assert loss.item() == exact.to(torch.bfloat16).item() != exact.item()


def test_nested_unit_returning_fp32_into_a_bf16_parent_is_bridged(one_rank, tmp_path):
    """Attention blocks sharded with output_dtype=fp32 inside a bf16 root: the root's own MLP
    Linears, in the same group (no group boundary guard between), get fp32 and F.linear fails.
    The guard casts those outputs to bf16 with a forward hook (no FSDP2 tensor written): the
    step runs, loss finite, shards untouched."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    inner = MixedPrecisionPolicy(**bf16, output_dtype=torch.float32)
    root = MixedPrecisionPolicy(**bf16, output_dtype=torch.float32)
    bare = tiny_llava(seed=0)
    _shard(bare, inner, root, _attention)
    with pytest.raises(RuntimeError, match="same dtype"):  # the crash, without the guard
        bare(**tiny_batch(bare))
    model = tiny_llava(seed=0)
    guard = PrecisionGuardPlugin("bf16", report=False)
    guard.setup(model)
    _shard(model, inner, root, _attention)
    shards = {n: (p.dtype, p.to_local().data_ptr()) for n, p in model.named_parameters()}
    report, said = _verify(guard, model)
    bridges = fsdp2_outputs(model).bridges
    assert [b.unit for b in bridges] == [
        "model.language_model.layers.0.self_attn",
        "model.language_model.layers.1.self_attn",
    ]
    assert {(b.parent, b.output, b.compute) for b in bridges} == {
        ("", torch.float32, torch.bfloat16)
    }
    assert len(report.wrapper_findings) == 1  # one message for the two layers
    msg = report.wrapper_findings[0]
    assert msg.startswith(
        "PrecisionGuardPlugin: FSDP2 unit model.language_model.layers.0.self_attn (and 1 more "
        "unit(s) "
        "like it) returns float32 (MixedPrecisionPolicy(output_dtype=torch.float32)) into its "
        "parent unit <model>, which computes in bfloat16"
    )
    assert "output_dtype=None" in msg and said.count(msg) == 1
    out = model(**tiny_batch(model))
    assert out.logits.dtype == torch.float32  # the root's own output_dtype
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert {n: (p.dtype, p.to_local().data_ptr()) for n, p in model.named_parameters()} == shards
    guard.verify(model, "again")  # a second event installs no second hook
    engine = guard._guarded[0]
    assert sum(len(h) for h in engine.wrapper_step.bridges.values()) == 2
    guard.remove()  # the hooks go with the guard
    assert engine.wrapper_step.bridges == {}
