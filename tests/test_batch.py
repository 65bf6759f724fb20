import pytest
import torch
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


def test_the_guard_adds_no_graph_break_under_torch_compile():
    """The batch hook fires every step: it must not read tensor values in Python (no bool() of
    a tensor, no .item()), which would break the compiled graph. The breaks left are the
    model's own (transformers'), the same with and without the guard."""
    import torch._dynamo as dynamo

    from hf_precision import enforce_policy, install_guards
    from hf_precision.tiny import tiny_batch, tiny_llava

    batch = {k: v for k, v in tiny_batch(tiny_llava()).items() if k != "labels"}
    assert batch["pixel_values"].dtype == torch.float32  # the hook has a narrowing cast to do

    def reasons(model, inputs):
        dynamo.reset()
        found = dynamo.explain(model)(**inputs).break_reasons
        return [(str(r.reason).splitlines()[0], [f.filename for f in r.user_stack]) for r in found]

    guarded = tiny_llava()
    enforce_policy(guarded, "fp16-true")
    install_guards(guarded, "fp16-true")
    with_guard = reasons(guarded, batch)
    bare = tiny_llava().half()
    without = reasons(bare, {**batch, "pixel_values": batch["pixel_values"].half()})
    assert not [r for r, files in with_guard if any("hf_precision" in f for f in files)]
    assert sorted(r for r, _ in with_guard) == sorted(r for r, _ in without)
    dynamo.reset()


def test_collator_arguments_of_the_wrong_type_say_so():
    with pytest.raises(PrecisionError, match=r"(?s)the collator must be callable.*type str"):
        PrecisionCollator("bf16")  # the policy where the collator goes
    with pytest.raises(PrecisionError, match=r"model=model\): expected a torch.nn.Module"):
        PrecisionCollator(default_data_collator, "bf16", model={"a": 1})
