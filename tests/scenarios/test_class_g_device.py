"""Class G — wrong device: one group sits on another device than the rest of the model and its
inputs. On CPU the other device is ``meta`` (weights never loaded); the real CUDA case runs
under the ``gpu`` marker."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_precision import PrecisionError, PrecisionGuardCallback, enforce_policy, install_guards
from hf_precision.tiny import OmniLMMTiny, tiny_batch, tiny_llava, tower_body


def _omnilmm_vpm_on_meta():
    model = OmniLMMTiny(torch.bfloat16)
    model.model.vision_tower.to("meta")  # e.g. built under init_empty_weights, never loaded
    model.train()
    return model


def _guard_states(model):
    # the guard's per-module state (private): which device each hook sends inputs to
    return {
        path: st
        for path, m in model.named_modules()
        if (st := m.__dict__.get("_hf_precision_guard")) is not None
    }


def test_without_guard_a_meta_group_fails_inside_the_vision_tower():
    model = _omnilmm_vpm_on_meta()
    with pytest.raises(RuntimeError, match="meta"):
        model(**model.batch())


def test_guard_refuses_at_init_and_names_the_group(trainer_for):
    # bf16_full_eval postpones Trainer's own model.to(device) (which would fail with torch's
    # "Cannot copy out of meta tensor"), so the guard is the first to look at the devices.
    model = _omnilmm_vpm_on_meta()
    with pytest.raises(PrecisionError) as err:
        trainer_for(
            model,
            model.batch(4),
            bf16=True,
            bf16_full_eval=True,
            callbacks=[PrecisionGuardCallback()],
        )
    text = str(err.value)
    assert "model.vision_tower.pos_embed" in text and "meta device" in text and "cpu" in text
    assert "Fix:" in text
    with pytest.raises(PrecisionError, match=r"model\.vision_tower\.pos_embed"):
        enforce_policy(_omnilmm_vpm_on_meta(), "bf16")
    # audit mode reports the same finding without raising (and changes nothing)
    report = enforce_policy(_omnilmm_vpm_on_meta(), "bf16", mode="audit")
    assert any("model.vision_tower." in w and "meta" in w for w in report.warnings)
    assert not report.applied


def test_inputs_follow_each_receiving_groups_device():
    model = OmniLMMTiny(torch.bfloat16)
    report = enforce_policy(model, "bf16-true")
    assert report.device == torch.device("cpu")  # the language model's device
    install_guards(model, "bf16-true", report)
    states = _guard_states(model)
    assert {"", "model.vision_tower", "model.resampler", "model"} <= set(states)
    assert {st.device for st in states.values()} == {torch.device("cpu")}
    assert model(**model.batch()).logits.device.type == "cpu"


def test_a_device_map_places_groups_itself():
    # With hf_device_map (accelerate's dispatch/offload keeps offloaded weights on meta and
    # moves them in its own hooks) the guard neither moves groups nor raises, nor moves inputs.
    model = _omnilmm_vpm_on_meta()
    model.hf_device_map = {"model.vision_tower": "meta", "model.resampler": "cpu", "model": "cpu"}
    report = enforce_policy(model, "bf16-true")
    assert report.device is None
    assert not [c for c in report.changes if c.device_after != c.device_before]
    assert next(model.tower.parameters()).device.type == "meta"
    install_guards(model, "bf16-true", report)
    assert {st.device for st in _guard_states(model).values()} == {None}


@pytest.mark.gpu
def test_on_cuda_a_group_left_on_cpu_is_moved():
    model: Any = tiny_llava(torch.float16)
    model.to("cuda")
    model.model.vision_tower.to("cpu")
    batch = {k: v.cuda() for k, v in tiny_batch(model).items()}
    with pytest.raises(
        RuntimeError,
        match=r"Input type \(torch.cuda.HalfTensor\) and weight "
        r"type \(torch.HalfTensor\) should be the same",
    ):
        model(**batch)
    report = enforce_policy(model, "fp16-true")
    moved = [c for c in report.changes if c.device_before == "cpu"]
    assert moved and {c.group for c in moved} == {"vision_encoder"}
    assert {c.device_after for c in moved} == {"cuda:0"}
    # integer buffers move too (CLIP's position_ids index the position embedding)
    assert tower_body(model.model.vision_tower).embeddings.position_ids.device.type == "cuda"
    install_guards(model, "fp16-true", report)
    cpu_batch = tiny_batch(model)  # inputs left on CPU follow the receiving group to CUDA
    assert model(**cpu_batch).logits.device.type == "cuda"
    assert {p.device.type for p in model.parameters()} == {"cuda"}


@pytest.mark.gpu
def test_on_cuda_guards_follow_the_model_between_cpu_and_cuda():
    # OneTrainer's offloading: the guard installed on one device, the model moved after it. The
    # inputs go where the model is at each call, never where it was at install.
    model: Any = tiny_llava(torch.float16)
    install_guards(model, "fp16-true", enforce_policy(model, "fp16-true"))
    model.to("cuda")
    assert model(**tiny_batch(model)).logits.device.type == "cuda"  # CPU batch, CUDA model
    model.to("cpu")
    cuda_batch = {k: v.cuda() for k, v in tiny_batch(model).items()}
    assert model(**cuda_batch).logits.device.type == "cpu"
    assert {st.device for st in _guard_states(model).values()} == {torch.device("cpu")}
