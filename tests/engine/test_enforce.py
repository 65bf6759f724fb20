import pytest
import torch

from hf_precision import PrecisionError, PrecisionPolicy, PrecisionWarning, enforce_policy
from hf_precision.engine.enforce import check_policy
from hf_precision.tiny import tiny_llava, tiny_paligemma


def _dtypes(module):
    return {p.dtype for p in module.parameters()}


def test_fix_casts_groups_together_and_keeps_identity():
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)
    params_before = {n: p for n, p in model.named_parameters()}
    report = enforce_policy(model, "bf16-true")
    assert report.applied and report.changes
    assert _dtypes(model) == {torch.bfloat16}
    for n, p in model.named_parameters():
        assert p is params_before[n]  # optimizer references stay valid
    # rotary inv_freq stays fp32
    rot = model.model.language_model.rotary_emb
    assert rot.inv_freq.dtype == torch.float32
    assert (
        "model.language_model.rotary_emb.inv_freq",
        "rotary inv_freq buffer",
    ) in report.kept_fp32


def test_mixed_policy_trainables_fp32_frozen_bf16_values_exact():
    model = tiny_llava()
    for p in model.parameters():
        p.requires_grad_(False)
    proj = model.model.multi_modal_projector
    for p in proj.parameters():
        p.requires_grad_(True)
    before = {n: p.detach().clone() for n, p in proj.named_parameters()}
    model.to(torch.bfloat16)
    proj.to(torch.float32)
    enforce_policy(model, "bf16")
    assert _dtypes(proj) == {torch.float32}
    assert _dtypes(model.model.vision_tower) == {torch.bfloat16}
    # a bf16 -> fp32 upcast is exact: value equals the bf16 rounding of the original
    for n, p in proj.named_parameters():
        assert torch.equal(p, before[n].to(torch.bfloat16).float())


def test_audit_changes_nothing_and_reports():
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)
    report = check_policy(model, "bf16-true")
    assert not report.applied
    assert report.changes
    assert torch.float16 in _dtypes(model.model.vision_tower)
    assert torch.float32 in _dtypes(model.model.language_model)


def test_raise_mode_lists_violations_and_fix():
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)
    with pytest.raises(PrecisionError) as err:
        enforce_policy(model, PrecisionPolicy.from_preset("fp32", mode="raise"))
    text = str(err.value)
    assert "model.vision_tower" in text and "float16 -> float32" in text
    assert "Fix:" in text


def test_tied_weights_stay_tied():
    model = tiny_paligemma()
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    enforce_policy(model, "fp16-true")
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float16
    assert (
        model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    )


def test_fp16_overflow_kept_fp32_with_warning_or_raises():
    model = tiny_llava()
    with torch.no_grad():
        model.model.multi_modal_projector.linear_1.weight[0, 0] = 70000.0
    with pytest.warns(PrecisionWarning, match=r"linear_1.weight.*70000.*kept in float32"):
        report = enforce_policy(model, "fp16-true")
    assert model.model.multi_modal_projector.linear_1.weight.dtype == torch.float32
    assert model.model.multi_modal_projector.linear_1.weight[0, 0].item() == 70000.0
    assert report.overflow == [("model.multi_modal_projector.linear_1.weight", 70000.0)]
    assert "projector" in report.mixed_groups
    model2 = tiny_llava()
    with torch.no_grad():
        model2.model.multi_modal_projector.linear_1.weight[0, 0] = 70000.0
    with pytest.raises(PrecisionError, match="linear_1.weight: max \\|value\\| 70000"):
        enforce_policy(model2, PrecisionPolicy.from_preset("fp16-true", mode="raise"))
    assert not torch.isinf(model2.model.multi_modal_projector.linear_1.weight).any()


def test_quantized_like_parameters_are_never_cast():
    model = tiny_llava()
    q = torch.nn.Parameter(torch.randint(-8, 8, (4, 4), dtype=torch.int8), requires_grad=False)
    model.model.multi_modal_projector.register_parameter("qweight", q)
    report = enforce_policy(model, "bf16-true")
    assert model.model.multi_modal_projector.qweight.dtype == torch.int8
    assert ("model.multi_modal_projector.qweight", "quantized storage (int8)") in report.skipped


def test_meta_group_among_real_weights_raises_naming_it():
    model = tiny_llava()
    model.model.vision_tower.to("meta")
    with pytest.raises(PrecisionError, match="meta device.*model.vision_tower"):
        enforce_policy(model, "bf16-true")


def test_optimizer_state_follows_dtype():
    model = tiny_llava()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    from hf_precision.tiny import tiny_batch

    model(**tiny_batch(model)).loss.backward()
    opt.step()
    model.model.multi_modal_projector.to(torch.bfloat16)  # drift, e.g. by a full-eval cast
    enforce_policy(model, "fp32", optimizer=opt)
    p = model.model.multi_modal_projector.linear_1.weight
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert any(p is q for g in opt.param_groups for q in g["params"])
    opt.step()  # still consistent


def test_grad_follows_dtype():
    model = tiny_llava()
    from hf_precision.tiny import tiny_batch

    model(**tiny_batch(model)).loss.backward()
    enforce_policy(model, "bf16-true")
    for p in model.parameters():
        if p.grad is not None:
            assert p.grad.dtype == p.dtype


def test_report_summary_and_dict():
    model = tiny_llava()
    report = enforce_policy(model, "bf16-true")
    text = str(report)
    assert "cast" in text and "model.vision_tower" in text
    d = report.to_dict()
    assert d["applied"] is True and d["rule"] == "llava"


def test_tied_weights_with_conflicting_targets_keep_the_tie_and_say_so():
    from transformers import LlamaForCausalLM

    from hf_precision.tiny import tiny_config

    config = tiny_config("llama")
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config).requires_grad_(False)  # frozen: the groups decide
    assert model.lm_head.weight is model.model.embed_tokens.weight
    policy = PrecisionPolicy.from_preset("bf16-true", group_dtypes={"lm_head": "fp32"})
    with pytest.warns(PrecisionWarning, match=r"lm_head.weight \[lm_head\] is tied to") as seen:
        enforce_policy(model, policy)
    message = next(str(w.message) for w in seen if "is tied to" in str(w.message))
    assert "model.embed_tokens.weight [language_model]" in message
    assert "float32 for lm_head.weight and bfloat16 for model.embed_tokens.weight" in message
    # the first name decides; the tie holds (one Parameter, one dtype)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("call", "name", "fix"),
    [
        (lambda m: enforce_policy(m, "bf16"), "enforce_policy(model, policy)", "from_pretrained"),
        (lambda m: check_policy(m, "bf16"), "check_policy(model, policy)", "hf-precision audit"),
    ],
)
def test_what_is_not_a_model_is_a_precision_error(call, name, fix):
    with pytest.raises(PrecisionError) as err:
        call({"a": 1})  # a state dict, not a model
    msg = str(err.value)
    assert msg.startswith(f"{name}: expected a torch.nn.Module") and "type dict" in msg
    assert "Fix: pass the model itself" in msg and fix in msg


@pytest.mark.parametrize("preset", ["bf16", "fp16", "bf16-true"])
def test_scalars_keep_their_dtype_and_their_bytes(preset):
    """0-D floating buffers and parameters (a LoRA alpha as kohya's networks.lora registers it,
    CLIP's logit_scale) are never cast: the state dict holds the same bytes after the cast."""

    class Lora(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lora_down = torch.nn.Linear(8, 2, bias=False)
            self.register_buffer("alpha", torch.tensor(0.3))
            self.logit_scale = torch.nn.Parameter(torch.tensor(2.6592), requires_grad=False)

    model = torch.nn.Sequential(Lora(), torch.nn.Linear(8, 8)).requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = enforce_policy(model, PrecisionPolicy.from_preset(preset))
    after = model.state_dict()
    for key in ("0.alpha", "0.logit_scale"):
        assert after[key].dtype == torch.float32
        assert after[key].numpy().tobytes() == before[key].numpy().tobytes()
    assert after["1.weight"].dtype != torch.float32  # the rest follows the policy
    assert {(n, r) for n, _, r, _ in report.kept} >= {("0.alpha", "scalar")}
