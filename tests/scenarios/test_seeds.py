"""The five seed reports, reproduced offline and fixed by the guard.

1. XTuner LLaVA (CLIP + Llama) in fp16: sample generation during evaluation, ``lm_head`` gets
   fp32 hidden states (``expected mat1 and mat2 to have the same dtype, but got: float !=
   c10::Half``; torch 2.13 on CPU runs fp16 matmuls and says ``m1 and m2``).
2. OmniLMM LoRA: the vision tower sits on another device than its inputs (``Input type
   (torch.cuda.HalfTensor) and weight type (torch.HalfTensor) should be the same``).
3. InternLM-XComposer fp16 inference with an fp32 image (``mat1 and mat2 must have the same
   dtype, but got Float and Half``).
4. MiniCPM-V-2 LoRA with ``bf16=True``: the resampler's attention gets the fp32 numpy position
   table (``mat1 and mat2 must have the same dtype, but got Float and BFloat16``).
5. OneTrainer fp16 weights: an fp32 ``latent_mask`` concatenated with fp16 latents, and a
   timestep-embedding Linear fed fp32.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_precision import (
    PrecisionError,
    PrecisionGuardCallback,
    PrecisionPolicy,
    PrecisionWarning,
    enforce_policy,
    install_guards,
)
from hf_precision.tiny import (
    CONV_DTYPE_ERROR,
    MiniCPMV2Tiny,
    OmniLMMTiny,
    OneTrainerTiny,
    XComposerTiny,
    XTunerLLaVATiny,
    collate_onetrainer,
    onetrainer_batch,
    onetrainer_examples,
    tiny_batch,
    tiny_llava,
)

SEED1 = r"expected m(at)?1 and m(at)?2 to have the same dtype, but got: float != c10::Half"
# torch 2.11 on CUDA words the same lm_head mismatch differently
SEED1_CUDA = f"{SEED1}|expected scalar type Float but found Half"
SEED3 = r"expected m(at)?1 and m(at)?2 to have the same dtype, but got: float != c10::Half"
SEED4 = r"mat1 and mat2 must have the same dtype, but got Float and BFloat16"
SEED5_LINEAR = r"mat1 and mat2 must have the same dtype, but got Float and Half"
SEED2_CUDA = (
    r"Input type \(torch.cuda.HalfTensor\) and weight type \(torch.HalfTensor\) "
    r"should be the same"
)
LM_ATTENTION = r".*language_model.*\.(q_proj|v_proj)"


def _lora(model, targets=LM_ATTENTION):
    model.train()
    return get_peft_model(model, LoraConfig(r=4, target_modules=targets))


# ------------------------------------------------------------------ 1. XTuner LLaVA fp16


def _xtuner_llava(device: str = "cpu"):
    """fp16 LLaVA, LoRA on the LLM, the final norm trained in fp32 "for stability"."""
    base: Any = tiny_llava(torch.float16)
    model = _lora(base.to(device))
    norm = model.base_model.model.model.language_model.norm
    norm.weight.data = norm.weight.data.float()
    norm.weight.requires_grad = True
    return model


def test_seed1_xtuner_llava_fp16_eval_generation(trainer_for, generate_on_evaluate, record_inputs):
    model = _xtuner_llava()
    head_in = record_inputs(model.base_model.model.lm_head)
    samples = generate_on_evaluate(tiny_batch(tiny_llava()))
    trainer = trainer_for(model, tiny_batch(tiny_llava(), 4), fp16=True, callbacks=[samples])
    with pytest.raises(RuntimeError, match=SEED1):
        trainer.evaluate()
    with pytest.raises(RuntimeError, match=SEED1):  # the sample hook on its own, as reported
        samples.on_evaluate(trainer.args, trainer.state, trainer.control, model=model)
    assert set(head_in) == {torch.float32}  # fp32 hidden states into the fp16 lm_head

    model = _xtuner_llava()
    samples = generate_on_evaluate(tiny_batch(tiny_llava()))
    trainer = trainer_for(
        model,
        tiny_batch(tiny_llava(), 4),
        fp16=True,
        eval_strategy="steps",
        eval_steps=1,
        callbacks=[PrecisionGuardCallback(), samples],
    )
    head_in = record_inputs(model.base_model.model.lm_head)  # after the guard's hooks
    out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert len(samples.samples) == 2
    assert set(head_in) == {torch.float16}
    base = model.base_model.model
    assert base.lm_head.weight.dtype == torch.float16
    assert base.model.language_model.norm.weight.dtype == torch.float32
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.float16), name


def _xtuner_layout():
    """XTuner's own LLaVAModel (llm / visual_encoder / projector) in fp16, LoRA put on the LLM
    the way XTuner puts it (``self.llm = get_peft_model(self.llm, ...)``), the final norm
    trained in fp32."""
    base = XTunerLLaVATiny(torch.float16)
    base.requires_grad_(False)
    base.train()
    base.llm = get_peft_model(base.llm, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    norm = base.llm.base_model.model.model.norm
    norm.weight.data = norm.weight.data.float()
    norm.weight.requires_grad = True
    return base, base


def test_seed1_on_xtuners_own_llava_layout(trainer_for, generate_on_evaluate, record_inputs):
    model, base = _xtuner_layout()
    samples = generate_on_evaluate(base.batch(2))
    trainer = trainer_for(model, base.batch(4), fp16=True, callbacks=[samples])
    with pytest.raises(RuntimeError, match=SEED1):
        trainer.evaluate()  # the sample generation at evaluation time

    model, base = _xtuner_layout()
    samples = generate_on_evaluate(base.batch(2))
    guard = PrecisionGuardCallback()
    trainer = trainer_for(
        model,
        base.batch(4),
        fp16=True,
        eval_strategy="steps",
        eval_steps=1,
        callbacks=[guard, samples],
    )
    assert guard.groups is not None and guard.groups.rule == "xtuner_llava"
    head = base.llm.base_model.model.lm_head
    head_in = record_inputs(head)
    out = trainer.train()
    assert out.global_step == 2 and len(samples.samples) == 2
    assert set(head_in) == {torch.float16}
    assert head.weight.dtype == torch.float16
    assert base.llm.base_model.model.model.norm.weight.dtype == torch.float32
    assert {p.dtype for p in base.projector.parameters()} == {torch.float16}


@pytest.mark.gpu
def test_seed1_on_cuda_autocast_hides_it_until_generate(trainer_for, generate_on_evaluate):
    data, prompt = tiny_batch(tiny_llava(), 4), tiny_batch(tiny_llava())
    samples = generate_on_evaluate(prompt)
    trainer = trainer_for(
        _xtuner_llava("cuda"),
        data,
        fp16=True,
        use_cpu=False,
        eval_strategy="steps",
        eval_steps=1,
        callbacks=[samples],
    )
    with pytest.raises(RuntimeError, match=SEED1_CUDA):
        trainer.train()
    assert trainer.state.global_step == 1  # the fp16 autocast step itself went through
    samples = generate_on_evaluate(prompt)
    trainer = trainer_for(
        _xtuner_llava("cuda"),
        data,
        fp16=True,
        use_cpu=False,
        eval_strategy="steps",
        eval_steps=1,
        callbacks=[PrecisionGuardCallback(), samples],
    )
    assert trainer.train().global_step == 2 and len(samples.samples) == 2


# ------------------------------------------------------------------ 2. OmniLMM LoRA, vpm device


OMNI_LM = r"model\.layers.*\.(q_proj|v_proj)"  # the Mistral body ``model`` is the LM


def _omnilmm(dtype: torch.dtype, device: str = "cpu"):
    return _lora(OmniLMMTiny(dtype).to(device), targets=OMNI_LM)


def test_seed2_omnilmm_lora_vpm_on_another_device(trainer_for):
    model = _omnilmm(torch.bfloat16)
    base = model.base_model.model
    base.tower.to("meta")  # the vision module was never materialised on the model's device
    with pytest.raises(RuntimeError, match="meta"):
        model(**base.batch())
    # bf16_full_eval postpones Trainer's own model.to(device): the guard sees the devices first
    with pytest.raises(
        PrecisionError, match=r"(?s)meta device while the model is on cpu.*model\.vision_tower\."
    ):
        trainer_for(
            model,
            base.batch(4),
            bf16=True,
            bf16_full_eval=True,
            callbacks=[PrecisionGuardCallback()],
        )
    # once the weights are loaded, the same setup trains
    base.tower.to_empty(device="cpu")
    base.tower.load_state_dict(OmniLMMTiny(torch.bfloat16).tower.state_dict())
    trainer = trainer_for(model, base.batch(4), bf16=True, callbacks=[PrecisionGuardCallback()])
    assert trainer.train().global_step == 2
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {p.dtype for p in base.tower.parameters()} == {torch.bfloat16}


def test_seed2_list_held_tower_bf16_flag_meta_and_dtype_map(trainer_for):
    """The done-when of the seeds-on-real-code work, on OmniLMM's real holding."""
    from hf_precision import dtype_map, find_module_groups

    base = OmniLMMTiny(torch.bfloat16, tune_clip=False)
    with pytest.warns(PrecisionWarning):
        groups = find_module_groups(base)
    assert groups.hidden == {"vision_encoder": "model.vision_tower"}
    assert groups.held == {"vision_encoder": "list"}
    model = _lora(base, targets=OMNI_LM)
    with pytest.warns(PrecisionWarning, match="held in a list"):
        trainer = trainer_for(model, base.batch(4), bf16=True, callbacks=[PrecisionGuardCallback()])
    assert trainer.train().global_step == 2
    tower = base.model.vision_tower[0]
    assert {p.dtype for p in tower.parameters()} == {torch.bfloat16}
    assert {p.device for p in tower.parameters()} == {next(base.lm_head.parameters()).device}
    assert not any(p in {id(q) for q in model.parameters()} for p in map(id, tower.parameters()))
    dmap = dtype_map(base)  # the map lists the hidden tower under its group
    assert dmap.groups["vision_encoder"].dtypes == ("bfloat16",)
    assert any(r.path.startswith("model.vision_tower") for r in dmap)

    meta = OmniLMMTiny(torch.bfloat16, tune_clip=False)
    meta.model.vision_tower[0].to("meta")
    with (
        pytest.warns(PrecisionWarning),
        pytest.raises(
            PrecisionError, match=r"(?s)model\.vision_tower \(held in a list, outside the module"
        ),
    ):
        enforce_policy(meta, "bf16")


def test_seed2_omnilmm_hidden_vpm_is_reached_by_the_guard(trainer_for, record_inputs):
    # OmniLMM's tune_clip=False keeps the tower in a list (self.vision_tower = [tower]):
    # model.to() never reaches it (the seed's root cause). The guard finds it, warns, then
    # casts it with its group by attribute access.
    base = OmniLMMTiny(torch.bfloat16, tune_clip=False)
    assert base.tower.pos_embed.dtype == torch.float32  # model.to(bf16) skipped it
    model = _lora(base, targets=OMNI_LM)
    with pytest.raises(RuntimeError, match="same dtype"):
        model(**base.batch())
    with pytest.warns(PrecisionWarning, match=r"model\.vision_tower.*held in a list.*registered"):
        trainer = trainer_for(model, base.batch(4), callbacks=[PrecisionGuardCallback()])
    assert {p.dtype for p in base.tower.parameters()} == {torch.bfloat16}
    resampler_in = record_inputs(base.model.resampler.kv_proj)
    assert trainer.train().global_step == 2
    assert set(resampler_in) == {torch.bfloat16}


@pytest.mark.gpu
def test_seed2_on_cuda_hidden_vpm_left_on_cpu(trainer_for):
    """The seed's exact failure: the list-held tower stays on the CPU when the model moves."""
    base = OmniLMMTiny(tune_clip=False)
    base.to(torch.float16)
    base.tower.half()  # loaded with torch_dtype=float16 like the rest (from_pretrained casts all)
    base.to("cuda")  # ... but .cuda()/.to() never reaches the list-held tower: it stays on CPU
    assert {p.device.type for p in base.tower.parameters()} == {"cpu"}
    batch = {k: v.cuda() for k, v in base.batch().items()}
    with pytest.raises(RuntimeError, match=SEED2_CUDA):
        base(**batch)
    model = _lora(base, targets=OMNI_LM)
    with pytest.warns(PrecisionWarning, match=r"model\.vision_tower.*held in a list.*registered"):
        trainer = trainer_for(
            model, base.batch(4), fp16=True, use_cpu=False, callbacks=[PrecisionGuardCallback()]
        )
    assert {p.device.type for p in base.tower.parameters()} == {"cuda"}
    assert trainer.train().global_step == 2


@pytest.mark.gpu
def test_seed2_on_cuda_vpm_left_on_cpu(trainer_for):
    model = _omnilmm(torch.float16, "cuda")
    base = model.base_model.model
    base.tower.to("cpu")
    batch = {k: v.cuda() for k, v in base.batch().items()}
    with pytest.raises(RuntimeError, match=SEED2_CUDA):
        model(**batch)
    report = enforce_policy(model, "fp16")
    assert {c.device_after for c in report.changes if c.device_before == "cpu"} == {"cuda:0"}
    assert {p.device.type for p in base.tower.parameters()} == {"cuda"}
    trainer = trainer_for(
        model, base.batch(4), fp16=True, use_cpu=False, callbacks=[PrecisionGuardCallback()]
    )
    assert trainer.train().global_step == 2


# ------------------------------------------------------------------ 3. XComposer fp16 inference


def test_seed3_xcomposer_fp16_inference_with_an_fp32_image(record_inputs):
    model = XComposerTiny(torch.float16)  # from_pretrained(..., dtype=float16)
    batch = model.batch(2)
    prompt = {k: batch[k] for k in ("input_ids", "pixel_values", "attention_mask")}
    assert prompt["pixel_values"].dtype == torch.float32
    with pytest.raises(RuntimeError, match=SEED3):
        model.generate(prompt["input_ids"], prompt["pixel_values"])

    policy = PrecisionPolicy.from_model(model)
    assert policy.name == "fp16-true"
    install_guards(model, policy, enforce_policy(model, policy))
    patch_in = record_inputs(model.vit.vision_tower.patch_embed)
    seq = model.generate(prompt["input_ids"], prompt["pixel_values"], max_new_tokens=3)
    assert seq.shape == (2, prompt["input_ids"].shape[1] + 3)
    assert torch.isfinite(model(**batch).logits).all()
    assert set(patch_in) == {torch.float16}
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


# ------------------------------------------------------------------ 4. MiniCPM-V-2 LoRA bf16


def _minicpmv2_lora():
    return _lora(MiniCPMV2Tiny(torch.bfloat16), targets=r"llm.*\.(q_proj|v_proj)")


def test_seed4_minicpmv2_lora_bf16_resampler_table(
    trainer_for, generate_on_evaluate, record_inputs
):
    prompt = MiniCPMV2Tiny().batch(2)
    model = _minicpmv2_lora()
    with pytest.raises(RuntimeError, match=SEED4):  # no autocast (DeepSpeed bf16, or eval)
        model(**prompt)
    samples = generate_on_evaluate(prompt)
    trainer = trainer_for(
        model, prompt, bf16=True, eval_strategy="steps", eval_steps=1, callbacks=[samples]
    )
    with pytest.raises(RuntimeError, match=SEED4):
        trainer.train()  # the autocast training step passes; generate() does not
    assert trainer.state.global_step == 1

    model = _minicpmv2_lora()
    samples = generate_on_evaluate(prompt)
    trainer = trainer_for(
        model,
        MiniCPMV2Tiny().batch(4),
        bf16=True,
        eval_strategy="steps",
        eval_steps=1,
        callbacks=[PrecisionGuardCallback(), samples],
    )
    attn_in = record_inputs(model.base_model.model.resampler.attn)
    assert trainer.train().global_step == 2
    assert len(samples.samples) == 2
    assert set(attn_in) == {torch.bfloat16}
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    with torch.no_grad():  # and without autocast, the DeepSpeed-style forward
        assert torch.isfinite(model(**prompt).loss)


# ------------------------------------------------------------------ 5. OneTrainer fp16 weights


def _onetrainer_lora():
    return _lora(
        OneTrainerTiny(torch.float16), targets=["conv", "time_emb_proj", "time_embedding.2"]
    )


def _loss(outputs, labels, num_items_in_batch=None):
    return outputs.loss


def test_seed5_onetrainer_fp16_latent_mask_and_timestep(trainer_for, record_inputs):
    batch = onetrainer_batch(2, torch.float16)
    assert batch["latents"].dtype == torch.float16 and batch["latent_mask"].dtype == torch.float32
    plain = OneTrainerTiny(torch.float16)
    with pytest.raises(RuntimeError, match=SEED5_LINEAR):  # fp32 sinusoidal embedding
        plain(**batch)
    with pytest.raises(RuntimeError, match=CONV_DTYPE_ERROR):  # fp32 mask promotes the cat
        plain.conv_in(torch.cat([batch["latents"], batch["latent_mask"]], dim=1))
    examples = onetrainer_examples(4, torch.float16)
    trainer = trainer_for(
        _onetrainer_lora(),
        examples,
        fp16=True,
        collator=collate_onetrainer,
        compute_loss_func=_loss,
    )
    with pytest.raises(RuntimeError, match=SEED5_LINEAR):
        trainer.train()

    model = _onetrainer_lora()
    base = model.base_model.model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)  # fp16 on CPU: no autocast, noted
        trainer = trainer_for(
            model,
            examples,
            fp16=True,
            collator=collate_onetrainer,
            compute_loss_func=_loss,
            callbacks=[PrecisionGuardCallback()],
        )
        conv_in, temb_in = record_inputs(base.conv_in), record_inputs(base.time_embedding[0])
        out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    assert set(conv_in) == set(temb_in) == {torch.float16}
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.float16), name
