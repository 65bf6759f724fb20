from typing import Any

import pytest
import torch
from torch import nn
from transformers import BatchFeature, default_data_collator

from hf_precision import PrecisionCollator, PrecisionError, PrecisionPolicy, PrecisionWarning
from hf_precision.batch import cast_batch, cast_tensor
from hf_precision.tiny import tiny_llava


def test_floating_cast_ints_bools_labels_untouched():
    batch = {
        "pixel_values": torch.rand(2, 3),
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "mask": torch.ones(2, dtype=torch.bool),
        "labels": torch.rand(2),
    }
    out = cast_batch(batch, torch.bfloat16, skip_keys=("labels",))
    assert out["pixel_values"].dtype == torch.bfloat16
    assert out["input_ids"] is batch["input_ids"]
    assert out["mask"] is batch["mask"]
    assert out["labels"] is batch["labels"]


def test_nested_containers_keep_types():
    feat = BatchFeature({"pixel_values": torch.rand(1, 3), "ids": torch.ones(1, dtype=torch.long)})
    batch = {
        "a": [torch.rand(2), torch.rand(2)],
        "b": (torch.rand(1),),
        "c": feat,
        "d": {"latents": torch.rand(2)},
    }
    out = cast_batch(batch, torch.float16)
    assert isinstance(out["a"], list) and out["a"][0].dtype == torch.float16
    assert isinstance(out["b"], tuple) and out["b"][0].dtype == torch.float16
    assert type(out["c"]) is BatchFeature and out["c"]["pixel_values"].dtype == torch.float16
    assert out["d"]["latents"].dtype == torch.float16
    assert feat["pixel_values"].dtype == torch.float32  # input not mutated


def test_unchanged_batch_is_returned_as_is():
    batch = {"x": torch.rand(2, dtype=torch.bfloat16)}
    assert cast_batch(batch, torch.bfloat16) is batch


@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16])
def test_mask_sentinels_remapped_not_inf(dst):
    src_min = torch.finfo(torch.float32).min
    mask = torch.tensor([[0.0, src_min], [float("-inf"), 0.0]])
    out = cast_tensor(mask, dst, key="attention_mask")
    assert not torch.isinf(out).any()
    assert out[0, 1].item() == torch.finfo(dst).min
    assert out[1, 0].item() == torch.finfo(dst).min
    scores = torch.zeros(2, 2, dtype=dst) + out
    assert not torch.isnan(torch.softmax(scores.float(), -1)).any()


def test_value_overflow_clamped_with_warning_or_raises():
    t = torch.tensor([1.0, 70000.0])
    with pytest.warns(PrecisionWarning, match="70000.*clamped"):
        out = cast_tensor(t, torch.float16, key="latents")
    assert out[1].item() == torch.finfo(torch.float16).max
    with pytest.raises(PrecisionError, match="latents is float32"):
        cast_tensor(t, torch.float16, key="latents", mode="raise")


def test_collator_wraps_default_and_follows_group_dtype():
    model = tiny_llava()
    model.model.vision_tower.to(torch.float32)
    model.model.language_model.to(torch.bfloat16)
    collate = PrecisionCollator(
        default_data_collator, PrecisionPolicy.from_preset("bf16"), model=model
    )
    feats = [
        {
            "pixel_values": torch.rand(3, 4, 4),
            "input_ids": torch.tensor([1, 2]),
            "labels": torch.tensor([1, 2]),
        }
        for _ in range(2)
    ]
    batch = collate(feats)
    # pixel_values follow the vision encoder (fp32 here), not the compute dtype
    assert batch["pixel_values"].dtype == torch.float32
    assert batch["input_ids"].dtype == torch.long
    plain = PrecisionCollator(policy="bf16")(feats)
    assert plain["pixel_values"].dtype == torch.bfloat16
    assert "policy='bf16 (frozen bfloat16" in repr(PrecisionCollator(policy="bf16"))


def test_collator_audit_mode_changes_nothing():
    feats = [{"pixel_values": torch.rand(3)}]
    out = PrecisionCollator(policy=PrecisionPolicy.from_preset("bf16", mode="audit"))(feats)
    assert out["pixel_values"].dtype == torch.float32


def _explain(model: Any, inputs: dict[str, Any]) -> tuple[int, int, list[str]]:
    """(graphs, graph breaks, first line of each break reason) of one compiled forward."""
    import torch._dynamo as dynamo

    dynamo.reset()
    try:
        out = dynamo.explain(model)(**inputs)
    finally:
        dynamo.reset()
    reasons = [str(r.reason).splitlines()[0] for r in out.break_reasons]
    assert not [
        r for r in out.break_reasons if any("hf_precision" in f.filename for f in r.user_stack)
    ], "a break in hf-precision's code"
    return out.graph_count, out.graph_break_count, sorted(reasons)


def test_the_guard_adds_no_graph_break_under_torch_compile():
    """A whole forward of a bf16 model on an fp32 batch: ``torch.compile(model)`` runs the
    model's hooks outside its graph, and a hook that casts would be compiled as a graph of its
    own (one more graph break in ``explain`` than the batch cast by hand: 7 against 6 here).
    The guard's hooks run eagerly there, so the counts match; the breaks left are the model's
    own (transformers': ``.item()`` in the image-token check), the same with and without it."""
    from hf_precision import enforce_policy, install_guards
    from hf_precision.tiny import tiny_batch, tiny_llava

    batch = {k: v for k, v in tiny_batch(tiny_llava()).items() if k != "labels"}
    assert batch["pixel_values"].dtype == torch.float32  # the hook has a cast to do
    guarded = tiny_llava()
    enforce_policy(guarded, "bf16-true")
    install_guards(guarded, "bf16-true")
    by_hand = {**batch, "pixel_values": batch["pixel_values"].bfloat16()}
    bare = tiny_llava().to(torch.bfloat16)
    assert _explain(guarded, batch) == _explain(bare, by_hand)


@pytest.mark.filterwarnings("ignore::hf_precision.PrecisionWarning")  # a bare Linear: no groups
def test_the_guard_is_traced_inside_a_compiled_caller():
    """When a compiled caller calls the guarded model (a compiled PeftModel calls the base
    model), the hooks are traced into the caller's graph: one graph, no break, and the
    fp16 cast's inf check (``torch.compiler.is_compiling()``) branch-free in it."""
    from hf_precision import install_guards

    class Caller(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x * 2)

    inner = nn.Linear(4, 4).half()
    inner.weight.data.fill_(1e-4)  # 4 inputs at fp16's max (65504) sum to ~26: finite
    install_guards(inner, "fp16-true")
    assert _explain(Caller(inner), {"x": torch.randn(2, 4)}) == (1, 0, [])
    out = torch.compile(Caller(inner), backend="eager")(torch.full((1, 4), 1e6))
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())  # clamped, not inf


def test_collator_arguments_of_the_wrong_type_say_so():
    with pytest.raises(PrecisionError, match=r"(?s)the collator must be callable.*type str"):
        PrecisionCollator("bf16")  # the policy where the collator goes
    with pytest.raises(PrecisionError, match=r"model=model\): expected a torch.nn.Module"):
        PrecisionCollator(default_data_collator, "bf16", model={"a": 1})
