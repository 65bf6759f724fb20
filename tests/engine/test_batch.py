import math
import warnings
from typing import Any

import pytest
import torch
import transformers
from torch import nn
from transformers import BatchFeature, default_data_collator

from hf_precision import PrecisionCollator, PrecisionError, PrecisionPolicy, PrecisionWarning
from hf_precision.engine.batch import cast_batch, cast_tensor
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
    # known activation keys: cast even 1-D (an unknown 1-D key would be kept: test_batch_keys)
    batch = {
        "inputs_embeds": [torch.rand(2), torch.rand(2)],
        "input_values": (torch.rand(1),),
        "c": feat,
        "d": {"latents": torch.rand(2)},
    }
    out = cast_batch(batch, torch.float16)
    assert isinstance(out["inputs_embeds"], list)
    assert out["inputs_embeds"][0].dtype == torch.float16
    assert isinstance(out["input_values"], tuple) and out["input_values"][0].dtype == torch.float16
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


# ---------------------------------------------------------------- time metadata in video batches

VIDEO, V_START, V_END = 251, 252, 253
SECONDS = 0.416667  # seconds per temporal grid; bf16 rounds it to 0.416016
GRID_T = 16  # temporal grids: position 12 reads 125 from fp32 seconds and 124 from bf16 ones
_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=256,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),
)
_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=32,
    patch_size=2,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=8,
    fullatt_block_indexes=[0],
)


def _qwen_video(family: str) -> tuple[nn.Module, dict[str, torch.Tensor], str]:
    """A tiny Qwen2.5-VL or Qwen2.5-Omni thinker from its config, and a video batch built by
    hand as the processor makes it (torchvision, which the processors need, is not here):
    ``pixel_values_videos`` (T·H·W patches, C·2·2·2), ``video_grid_thw`` (1, 3) int64 and the
    float32 seconds per grid. Returns the model, the batch and the seconds key."""
    import transformers as tf

    ids = dict(vision_start_token_id=V_START, vision_end_token_id=V_END)
    if family == "qwen2_5_vl":
        config: Any = tf.Qwen2_5_VLConfig(
            vision_config={**_VISION, "tokens_per_second": 25},
            text_config=_TEXT,
            image_token_id=250,
            video_token_id=VIDEO,
            **ids,
        )
        model_cls: Any = tf.Qwen2_5_VLForConditionalGeneration
        key = "second_per_grid_ts"
    else:
        config = tf.Qwen2_5OmniThinkerConfig(
            audio_config=dict(
                num_mel_bins=8,
                encoder_layers=1,
                encoder_attention_heads=2,
                encoder_ffn_dim=32,
                d_model=16,
                output_dim=32,
                n_window=4,
                max_source_positions=32,
            ),
            vision_config=_VISION,
            text_config=_TEXT,
            audio_token_index=249,
            image_token_index=250,
            video_token_index=VIDEO,
            audio_start_token_id=247,
            audio_end_token_id=248,
            position_id_per_seconds=25,
            **ids,
        )
        model_cls = tf.Qwen2_5OmniThinkerForConditionalGeneration
        key = "video_second_per_grid"
    torch.manual_seed(0)
    model = model_cls(config)
    input_ids = torch.tensor([[V_START] + [VIDEO] * GRID_T + [V_END, 5, 6, 7, 8]])
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values_videos": torch.randn(GRID_T * 4, 3 * 2 * 2 * 2),
        "video_grid_thw": torch.tensor([[GRID_T, 2, 2]]),
        key: torch.tensor([SECONDS]),
        "labels": input_ids.clone(),
    }
    if family == "qwen2_5_vl":  # text 0, video 2: what the processor returns (drives M-RoPE)
        batch["mm_token_type_ids"] = (input_ids == VIDEO).long() * 2
    return model, batch, key


def _rope_ids(model: nn.Module, batch: dict[str, torch.Tensor], seconds: torch.Tensor) -> Any:
    """The M-RoPE position ids the model computes for ``batch`` with ``seconds`` per grid."""
    inner: Any = model.model
    if "mm_token_type_ids" in batch:
        return inner.get_rope_index(
            batch["input_ids"],
            batch["mm_token_type_ids"],
            video_grid_thw=batch["video_grid_thw"],
            second_per_grid_ts=seconds,
            attention_mask=batch["attention_mask"],
        )[0]
    return inner.get_rope_index(
        batch["input_ids"],
        None,
        batch["video_grid_thw"],
        batch["attention_mask"],
        False,
        None,
        seconds,
    )[0]


def _position_ids_seen(model: nn.Module) -> list[torch.Tensor]:
    """The position ids the language model receives at each forward."""
    seen: list[torch.Tensor] = []
    lm: Any = model.model.language_model  # type: ignore[union-attr]
    lm.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["position_ids"].clone()), with_kwargs=True
    )
    return seen


#: transformers 4.57 builds Qwen2.5-VL/Omni video positions through another API (no
#: ``get_rope_index`` on the Omni thinker's text model, other video arguments): these tests drive
#: 5.x's; the rule itself (metadata keys never cast) is version-free and tested in
#: tests/rules/test_batch_keys.py on both lines' code
_QWEN_5X = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="Qwen2.5-VL/Omni video positions go through transformers 5.x's API",
)


@_QWEN_5X
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_5_omni"])
def test_collator_keeps_video_seconds_and_the_position_ids(family: str) -> None:
    """``PrecisionCollator('bf16')`` casts the video patches and leaves the seconds per grid
    float32: the M-RoPE temporal ids equal those of the float32 metadata, bit-exact (a bf16
    0.416016 read 124 for 125 at grid 12)."""
    model, batch, key = _qwen_video(family)
    expected = _rope_ids(model, batch, batch[key])
    assert not torch.equal(expected, _rope_ids(model, batch, batch[key].bfloat16()))  # at stake
    out = PrecisionCollator(lambda features: features[0], "bf16")([batch])
    assert out["pixel_values_videos"].dtype == torch.bfloat16
    assert out[key].dtype == torch.float32 and torch.equal(out[key], batch[key])
    seen = _position_ids_seen(model)
    with torch.no_grad():
        model(**out)
    assert torch.equal(seen[-1], expected)


@_QWEN_5X
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_5_omni"])
def test_trainer_bf16_with_the_callback_keeps_the_position_ids(family: str, tiny_args: Any) -> None:
    """A real ``Trainer(bf16=True)`` step with ``PrecisionGuardCallback``: the batch hook casts
    the patches but not the seconds per grid, so the position ids the language model receives
    equal those of float32 metadata, bit-exact, and the loss is finite."""
    from transformers import Trainer

    from hf_precision import PrecisionGuardCallback

    model, batch, key = _qwen_video(family)
    expected = _rope_ids(model, batch, batch[key])
    seen = _position_ids_seen(model)
    trainer = Trainer(
        model=model,
        args=tiny_args(bf16=True, max_steps=1, per_device_train_batch_size=1, logging_steps=1),
        train_dataset=[batch],
        data_collator=lambda features: features[0],
        callbacks=[PrecisionGuardCallback()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)
        result = trainer.train()
    assert seen and all(torch.equal(s, expected) for s in seen)
    assert math.isfinite(result.training_loss)


@_QWEN_5X
def test_accelerate_plugin_loader_keeps_the_video_seconds(tmp_path: Any) -> None:
    """The accelerate plugin wraps the loader's ``collate_fn`` in ``PrecisionCollator``: the
    patches follow the vision encoder (bf16), the seconds per grid stay float32, and the
    position ids equal those of float32 metadata, bit-exact."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from hf_precision import PrecisionGuardPlugin

    model, batch, key = _qwen_video("qwen2_5_vl")
    model.model.visual.requires_grad_(False)  # a frozen tower: bf16 under the bf16 preset
    expected = _rope_ids(model, batch, batch[key])
    loader = torch.utils.data.DataLoader([batch], batch_size=1, collate_fn=lambda f: f[0])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrecisionWarning)
            model, optimizer, loader = PrecisionGuardPlugin().prepare(
                accelerator, model, optimizer, loader
            )
        out = next(iter(loader))
        assert out["pixel_values_videos"].dtype == torch.bfloat16
        assert out[key].dtype == torch.float32 and torch.equal(out[key], batch[key])
        seen = _position_ids_seen(model)
        with torch.no_grad(), accelerator.autocast():
            model(**out)
        assert torch.equal(seen[-1], expected)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
