import json
from typing import Any

import pytest
import torch
from transformers import TrainingArguments

from hf_precision import PrecisionError, PrecisionPolicy, PrecisionWarning
from hf_precision.rules.policy.precedence import Decision
from hf_precision.rules.policy.presets import PRESETS
from hf_precision.tiny import tiny_llava


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_json(name):
    policy = PrecisionPolicy.from_preset(
        name, group_dtypes={"vision_encoder": "fp32"}, keep_fp32=["re:norm$"]
    )
    data = json.loads(policy.to_json())
    assert data["version"] == 1
    assert data["group_dtypes"] == {"vision_encoder": "float32"}
    again = PrecisionPolicy.from_json(policy.to_json())
    assert again == policy
    assert again.compute_dtype == PRESETS[name][0]


def test_preset_values():
    bf16 = PrecisionPolicy.from_preset("bf16")
    assert (bf16.compute_dtype, bf16.frozen_dtype, bf16.trainable_dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
    )
    assert bf16.is_mixed
    assert not PrecisionPolicy.from_preset("bf16-true").is_mixed
    fp16 = PrecisionPolicy.from_preset("fp16")
    assert fp16.trainable_dtype == torch.float32  # the GradScaler needs fp32 grads


def test_unknown_preset_lists_allowed_and_suggests():
    with pytest.raises(PrecisionError) as err:
        PrecisionPolicy.from_preset("bf61")
    text = str(err.value)
    assert text.startswith("PrecisionPolicy.from_preset('bf61'): unknown preset 'bf61'.")
    assert "Did you mean 'bf16'" in text
    for name in PRESETS:
        assert name in text


def test_unknown_group_and_mode_and_field():
    with pytest.raises(
        PrecisionError, match="(?s)unknown group 'vision_encodr'.*Did you mean 'vision_encoder'"
    ):
        PrecisionPolicy.from_preset("bf16", group_dtypes={"vision_encodr": "fp32"})
    with pytest.raises(PrecisionError, match="(?s)unknown mode 'fixx'.*audit, fix, raise"):
        PrecisionPolicy(mode="fixx")
    with pytest.raises(PrecisionError, match="unknown field"):
        PrecisionPolicy.from_preset("bf16", comput_dtype="bf16")
    with pytest.raises(PrecisionError, match="unknown dtype 'bfloat61'"):
        PrecisionPolicy(group_dtypes={"projector": "bfloat61"})
    with pytest.raises(PrecisionError, match="bad regex"):
        PrecisionPolicy(keep_fp32=["re:(["])


def test_from_dict_reads_a_newer_policy_and_drops_what_it_does_not_know():
    policy = PrecisionPolicy.from_preset("bf16", group_dtypes={"vision_encoder": "fp32"})
    data = policy.to_dict()
    data.update(version=99, future_knob=True)
    with pytest.warns(PrecisionWarning, match=r"ignoring field\(s\) \['future_knob'\].*version 99"):
        loaded = PrecisionPolicy.from_dict(data)
    assert loaded == policy
    # the same fields from this version load silently; a hand-written typo still raises
    again = policy.to_dict()
    assert PrecisionPolicy.from_dict(again) == policy
    with pytest.raises(PrecisionError, match=r"unknown field\(s\) \['frozen_dtyp'\]"):
        PrecisionPolicy.from_dict({"frozen_dtyp": "bf16"})
    with pytest.raises(PrecisionError, match="integers >= 1"):
        PrecisionPolicy.from_dict({**again, "version": "1"})


def test_from_training_args(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, report_to=[])
    assert PrecisionPolicy.from_training_args(args).name == "bf16"
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16_full_eval=True
    )
    policy = PrecisionPolicy.from_training_args(args, tiny_llava(dtype=torch.bfloat16))
    assert policy.name == "bf16-true"  # no flag: the dtype the model was loaded in
    assert policy.full_eval_dtype == torch.bfloat16
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)  # the majority (LM) stays fp32
    assert (
        PrecisionPolicy.from_training_args(
            TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]), model
        ).name
        == "fp32"
    )


def test_from_accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    assert PrecisionPolicy.from_accelerator(acc).name == "bf16"
    AcceleratorState._reset_state(True)  # the state is a process-wide singleton
    acc_no = Accelerator(cpu=True)
    assert (
        PrecisionPolicy.from_accelerator(acc_no, tiny_llava(dtype=torch.float16)).name
        == "fp16-true"
    )
    AcceleratorState._reset_state(True)


def test_target_dtype_precedence():
    policy = PrecisionPolicy.from_preset(
        "bf16", group_dtypes={"vision_encoder": "fp32"}, keep_fp32=["model.language_model.norm"]
    )
    # keep-fp32 beats everything
    assert (
        policy.target_dtype("model.language_model.norm.weight", "language_model", trainable=True)[0]
        == torch.float32
    )
    # trainable beats the group override
    assert policy.target_dtype("lm_head.weight", "lm_head", trainable=True) == (
        torch.float32,
        "trainable",
    )
    assert policy.target_dtype("x.weight", "vision_encoder", trainable=False) == (
        torch.float32,
        "group_dtypes['vision_encoder']",
    )
    assert policy.target_dtype("x.weight", "projector", trainable=False) == (
        torch.bfloat16,
        "frozen",
    )
    # rotary inv_freq buffers stay fp32 by default
    assert (
        policy.target_dtype(
            "model.language_model.rotary_emb.inv_freq",
            "language_model",
            trainable=False,
            is_buffer=True,
        )[0]
        == torch.float32
    )
    # the model's own _keep_in_fp32_modules (component match): fp32 where the weight would be
    # fp16, as transformers' loader keeps it for fp16 loads only; under bf16 it follows the rules
    wo = "encoder.block.0.wo.weight"
    assert policy.decide(wo, "language_model", trainable=False, model_patterns=["wo"]) == (
        Decision(torch.bfloat16, "frozen", "frozen")
    )
    fp16 = PrecisionPolicy.from_preset("fp16")
    d = fp16.decide(wo, "language_model", trainable=False, model_patterns=["wo"])
    assert (d.dtype, d.rule) == (torch.float32, "keep_fp32")
    # _keep_in_fp32_modules_strict: fp32 under every preset, its own rule
    for p in (policy, fp16, PrecisionPolicy.from_preset("bf16-true")):
        d = p.decide(wo, "language_model", trainable=True, strict_patterns=["wo"])
        assert (d.dtype, d.rule, d.keeps_fp32) == (torch.float32, "keep_fp32_strict", True)


def test_resolve(tmp_path):
    assert PrecisionPolicy.resolve("fp16").name == "fp16"
    p = PrecisionPolicy.from_preset("fp32")
    assert PrecisionPolicy.resolve(p) is p
    assert PrecisionPolicy.resolve(p.to_dict()) == p
    with pytest.raises(PrecisionError, match="expected a PrecisionPolicy"):
        PrecisionPolicy.resolve(3.0)  # type: ignore[arg-type]


def test_resolve_reads_every_spelling_parse_policy_reads(tmp_path):
    """One reading of a string: what ``enforce_policy``, ``install_guards``, the collator and
    ``guard_diffusion`` take (``resolve``) is what the front ends take (``parse_policy``)."""
    from hf_precision.rules.policy.parse import parse_policy

    policy = PrecisionPolicy.from_preset("bf16", keep_fp32=("re:.*norm",), mode="audit")
    file = tmp_path / "policy.json"
    file.write_text(policy.to_json())
    for spec in (policy.to_json(), str(file), file, policy.to_dict(), "bf16"):
        assert PrecisionPolicy.resolve(spec) == parse_policy(spec), spec
    assert PrecisionPolicy.resolve(file) == policy
    with pytest.raises(PrecisionError, match="not valid JSON"):
        PrecisionPolicy.resolve("{bad")
    with pytest.raises(PrecisionError, match="unknown preset 'bf61'.*'bf16'"):
        PrecisionPolicy.resolve("bf61")


def test_inference_keeps_fp32_trainables_the_same_way_everywhere():
    import types

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from hf_precision.tiny import tiny_llava

    model = tiny_llava(torch.bfloat16)
    model.model.multi_modal_projector.float()  # trained in fp32
    AcceleratorState._reset_state(True)
    try:
        from_acc = PrecisionPolicy.from_accelerator(Accelerator(cpu=True), model)
    finally:
        AcceleratorState._reset_state(True)
    no_flags = types.SimpleNamespace(bf16=False, fp16=False)
    policies = [
        PrecisionPolicy.from_model(model),
        from_acc,
        PrecisionPolicy.from_training_args(no_flags, model),
    ]
    assert all(p == policies[0] for p in policies)
    policy = policies[0]
    assert policy.name == "bf16-true" and policy.keep_trainable_fp32
    name = "model.multi_modal_projector.linear_1.weight"
    assert policy.target_dtype(name, "projector", trainable=True, current=torch.float32) == (
        torch.float32,
        "keep_trainable_fp32",
    )
    # a trainable weight loaded in bf16 stays bf16; a frozen fp32 one follows the majority
    assert (
        policy.target_dtype(name, "projector", trainable=True, current=torch.bfloat16)[0]
        == torch.bfloat16
    )
    assert (
        policy.target_dtype(name, "projector", trainable=False, current=torch.float32)[0]
        == torch.bfloat16
    )
    # only a named *-true preset lowers fp32 trainables
    assert not PrecisionPolicy.from_preset("bf16-true").keep_trainable_fp32


def test_tensor_role_by_module_type_not_by_name() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    from hf_precision.rules.roles import tensor_role
    from hf_precision.tiny import tiny_qwen2_vl

    ln, rms = torch.nn.LayerNorm(4), LlamaRMSNorm(4)
    assert tensor_role(ln, "weight", ln.weight, is_buffer=False) == "norm"
    assert tensor_role(ln, "bias", ln.bias, is_buffer=False) == "norm"
    assert tensor_role(rms, "weight", rms.weight, is_buffer=False) == "norm"
    lin = torch.nn.Linear(4, 4)  # a "norm" in the name does not make a norm
    assert tensor_role(lin, "weight", lin.weight, is_buffer=False) is None
    # Qwen2-VL's merger.ln_q: a LayerNorm whose name holds no "norm"
    merger = tiny_qwen2_vl().model.visual.merger
    assert tensor_role(merger.ln_q, "weight", merger.ln_q.weight, is_buffer=False) == "norm"

    class RemoteRotaryEmbedding(torch.nn.Module):  # remote code: a cos/sin cache, no inv_freq
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cos_cached", torch.ones(4))
            self.register_buffer("positions", torch.arange(4))

    rot = RemoteRotaryEmbedding()
    assert tensor_role(rot, "cos_cached", rot.cos_cached, is_buffer=True) == "rotary"
    assert tensor_role(rot, "positions", rot.positions, is_buffer=True) is None  # integer
    other = torch.nn.Module()
    other.register_buffer("full_attention_inv_freq", torch.ones(2))  # by name, any module
    assert tensor_role(other, "full_attention_inv_freq", torch.ones(2), is_buffer=True) == "rotary"
    from hf_precision.tiny import tiny_config

    llama_rot = LlamaRotaryEmbedding(tiny_config("llama"))
    assert tensor_role(llama_rot, "inv_freq", llama_rot.inv_freq, is_buffer=True) == "rotary"


def test_deliberate_fp32_norm_line() -> None:
    policy = PrecisionPolicy.from_preset("bf16")

    def decide(pol=policy, **kw):
        args = dict(trainable=False, current=torch.float32, role="norm")
        args.update(kw)
        return pol.decide(
            "model.language_model.layers.0.input_layernorm.weight", "language_model", **args
        )

    def got(d):
        return d.dtype, d.rule

    # an fp32 norm in a group whose other weights are bf16: chosen, kept
    d = decide(group_dtype=torch.bfloat16)
    assert (d.dtype, d.rule, d.keeps_fp32) == (torch.float32, "deliberate_fp32", True)
    assert "bfloat16 group" in d.reason and "keep_fp32_norms=False" in d.reason
    # a norm whose whole group is fp32 follows the group (the seed's fp32 tower)
    assert got(decide(group_dtype=torch.float32)) == (torch.bfloat16, "frozen")
    # not a norm, a half norm, a trainable norm: the usual rules
    assert decide(role=None, group_dtype=torch.bfloat16).rule == "frozen"
    assert decide(current=torch.bfloat16, group_dtype=torch.bfloat16).rule == "frozen"
    assert decide(trainable=True, group_dtype=torch.bfloat16).rule == "trainable"
    # the user forces the cast: keep_fp32_norms=False, or the group named in group_dtypes
    off = policy.replace(keep_fp32_norms=False)
    assert got(decide(off, group_dtype=torch.bfloat16)) == (torch.bfloat16, "frozen")
    named = policy.replace(group_dtypes={"language_model": "bf16"})
    assert got(decide(named, group_dtype=torch.bfloat16)) == (torch.bfloat16, "group_dtypes")
    assert PrecisionPolicy.from_json(off.to_json()) == off


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("bfloat16", "Did you mean 'bf16' (frozen bf16, trainable fp32) or 'bf16-true'"),
        ("float16", "Did you mean 'fp16' (frozen fp16, trainable fp32) or 'fp16-true'"),
        ("bf16-mixed", "Did you mean 'bf16' (Lightning's bf16-mixed"),
        ("16-mixed", "Did you mean 'fp16'"),
        ("float32", "Did you mean 'fp32'?"),
        ("BF16", "Did you mean 'bf16'? (preset names are lower case)"),
        (" bf16-True", "Did you mean 'bf16-true'? (preset names are lower case)"),
    ],
)
def test_other_tools_names_are_refused_with_the_preset_meant(name, meant):
    """One vocabulary: Python refuses what the CLI refuses (tests/tools/test_cli.py), and
    'bfloat16' is no longer silently 'bf16-true' (trainable weights in bf16)."""
    with pytest.raises(PrecisionError) as err:
        PrecisionPolicy.from_preset(name)
    first = str(err.value).splitlines()[0]
    assert first.startswith(f"PrecisionPolicy.from_preset({name!r}): unknown preset {name!r}.")
    assert meant in first
    with pytest.raises(PrecisionError, match="unknown preset"):
        PrecisionPolicy.resolve(name)


def test_a_front_end_repeats_its_call_for_a_misnamed_preset():
    from hf_precision import PrecisionGuardCallback

    with pytest.raises(PrecisionError) as err:
        PrecisionGuardCallback("bfloat16")
    assert str(err.value).startswith(
        "PrecisionGuardCallback('bfloat16'): unknown preset 'bfloat16'. Did you mean 'bf16'"
    )


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("{garbage", "not valid JSON (Expecting property name"),
        ("[1, 2]", "the JSON is a list, not an object of policy fields"),
        ('"bf16"', "the JSON is a str"),
        (b"\xff\xfe{", "not valid JSON"),
        (None, "got a value of type NoneType"),
    ],
)
def test_from_json_of_what_is_not_a_policy_says_so(text, said):
    with pytest.raises(PrecisionError) as err:
        PrecisionPolicy.from_json(text)
    msg = str(err.value)
    assert msg.startswith(f"PrecisionPolicy.from_json({text!r}"[:28]) and said in msg
    assert "Fix: pass" in msg and "to_json()" in msg


def test_from_dict_of_what_is_not_a_dict_says_so():
    with pytest.raises(PrecisionError, match=r"from_dict\(\['bf16'\]\): expected a dict"):
        PrecisionPolicy.from_dict(["bf16"])


def vision_heavy_llava(seed: int = 0) -> torch.nn.Module:
    """A tiny LLaVA whose vision tower has more parameters than its language model and LM
    head together: vision fp32 (frozen), language model bf16 trained in full."""
    from transformers import LlavaForConditionalGeneration

    from hf_precision.tiny import tiny_config

    config = tiny_config("llava")
    config.vision_config.num_hidden_layers *= 4
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.to(torch.bfloat16)
    model.lm_head.to(torch.bfloat16)
    model.model.vision_tower.requires_grad_(False)
    return model


def _numel(params: Any) -> int:
    return sum(p.numel() for p in params)


def test_no_flag_frozen_dtype_follows_the_language_model_not_the_count():
    import types

    from hf_precision.rules.policy.inference import infer_preset, loaded_dtype

    model = vision_heavy_llava()
    fp32 = _numel(p for p in model.parameters() if p.dtype == torch.float32)
    bf16 = _numel(p for p in model.parameters() if p.dtype == torch.bfloat16)
    assert fp32 > bf16  # the old parameter-count rule inferred fp32 here
    assert loaded_dtype(model) == torch.bfloat16 and infer_preset(model) == "bf16-true"
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    try:
        from_acc = PrecisionPolicy.from_accelerator(Accelerator(cpu=True), model)
    finally:
        AcceleratorState._reset_state(True)
    no_flags = types.SimpleNamespace(bf16=False, fp16=False)
    policy = PrecisionPolicy.from_training_args(no_flags, model)
    assert policy == PrecisionPolicy.from_model(model) == from_acc
    assert (policy.name, policy.frozen_dtype, policy.trainable_dtype) == (
        "bf16-true",
        torch.bfloat16,
        torch.bfloat16,
    )
    lm = "model.language_model.layers.0.mlp.up_proj.weight"
    assert policy.decide(lm, "language_model", trainable=True, current=torch.bfloat16).dtype == (
        torch.bfloat16
    )


def test_no_flag_trainable_half_weights_stay_in_their_dtype_in_an_fp32_model():
    from hf_precision.tiny import tiny_llava

    model = tiny_llava()  # fp32, a bf16 projector trained as loaded
    model.requires_grad_(False)
    model.model.multi_modal_projector.to(torch.bfloat16).requires_grad_(True)
    policy = PrecisionPolicy.from_model(model)
    assert (policy.name, policy.frozen_dtype, policy.trainable_dtype) == (
        "fp32",
        torch.float32,
        torch.bfloat16,
    )
    assert policy.keep_trainable_fp32
    name = "model.multi_modal_projector.linear_1.weight"
    assert policy.decide(name, "projector", trainable=True, current=torch.bfloat16).dtype == (
        torch.bfloat16
    )
    # an explicit trainable_dtype still wins over the inferred one
    assert PrecisionPolicy.from_model(model, trainable_dtype="fp32").trainable_dtype == (
        torch.float32
    )


def test_loaded_dtype_prefers_frozen_language_model_weights():
    from peft import LoraConfig, get_peft_model

    from hf_precision.rules.policy.inference import loaded_dtype
    from hf_precision.tiny import tiny_text_llama

    model = tiny_text_llama(torch.float16)
    peft = get_peft_model(model, LoraConfig(r=256, target_modules=["q_proj", "v_proj"]))
    for n, p in peft.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()  # fp32 adapters, more than the fp16 weights of a tiny model
    assert loaded_dtype(peft) == torch.float16
    assert PrecisionPolicy.from_model(peft).name == "fp16-true"


def test_no_flag_fp16_trainables_outside_an_fp16_model_follow_the_preset():
    from hf_precision.tiny import tiny_llava

    model = tiny_llava()  # fp32, a trainable fp16 vision tower: fp16 cannot hold AdamW's eps
    model.model.vision_tower.to(torch.float16)
    policy = PrecisionPolicy.from_model(model)
    assert (policy.name, policy.trainable_dtype) == ("fp32", torch.float32)
    fp16 = tiny_llava(torch.float16)  # an fp16 model trained as loaded stays fp16
    assert PrecisionPolicy.from_model(fp16).trainable_dtype == torch.float16


def test_half_trainables_of_a_zero3_run_keep_their_dtype() -> None:
    """Under DeepSpeed ZeRO-3 in bf16 (``master_fp32``) a trainable bf16 weight stays bf16
    (rule wrapper_master_fp32: DeepSpeed's optimizer holds the fp32 copy); keep rules still come
    first; an fp32 trainable joins them (ZeRO-3 flattens every trainable partition into one
    buffer of one dtype: the engine passes ``master_fp32`` only where that is so); other runs
    keep the preset's trainable dtype."""
    policy = PrecisionPolicy.from_preset("bf16")
    bf16, fp32 = torch.bfloat16, torch.float32
    lora = "model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight"
    d = policy.decide(lora, "language_model", trainable=True, current=bf16, master_fp32=bf16)
    assert (d.dtype, d.rule, d.keeps_fp32, d.kept) == (bf16, "wrapper_master_fp32", False, True)
    assert "DeepSpeed ZeRO-3" in d.reason and "autocast_adapter_dtype=False" in d.reason
    assert policy.decide(lora, "language_model", trainable=True, current=bf16).rule == "trainable"
    joined = policy.decide(lora, "language_model", trainable=True, current=fp32, master_fp32=bf16)
    assert (joined.dtype, joined.rule) == (bf16, "wrapper_master_fp32")
    assert "joins the others" in joined.reason
    assert policy.decide(lora, "language_model", trainable=True, current=fp32).dtype == fp32
    assert (
        policy.decide(  # frozen weights follow the preset
            "lm_head.weight", "lm_head", trainable=False, current=bf16, master_fp32=bf16
        ).rule
        == "frozen"
    )
    kept = PrecisionPolicy.from_preset("bf16", keep_fp32=("lora_A",))
    assert (
        kept.decide(lora, "language_model", trainable=True, current=bf16, master_fp32=bf16).rule
        == "keep_fp32"
    )  # the user named it
    true = PrecisionPolicy.from_preset("bf16-true")  # nothing to keep: no rule said
    assert (
        true.decide(lora, "language_model", trainable=True, current=bf16, master_fp32=bf16).rule
        == "trainable"
    )
