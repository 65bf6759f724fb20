"""Quantized weights from the real libraries (CPU): recognised by type, never cast, never
range-checked, never written; the rest of the model follows the policy and runs."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from hf_precision import dtype_map, enforce_policy, install_guards
from hf_precision.engine.enforce import check_policy
from hf_precision.rules.dtypes import is_quantized, quantized_library, register_quantized
from hf_precision.tiny import tiny_batch, tiny_llava, tower_body


def _snapshot(model: torch.nn.Module) -> dict[str, tuple[int, dict[str, torch.Tensor]]]:
    """Every quantized parameter: its object id and a copy of its inner storage tensors."""
    out = {}
    for name, p in model.named_parameters():
        if not is_quantized(p):
            continue
        if hasattr(p, "__tensor_flatten__"):
            inner = {k: getattr(p, k).detach().clone() for k in p.__tensor_flatten__()[0]}
        else:
            inner = {"": p.detach().clone()}
        out[name] = (id(p), inner)
    return out


def _same(model: torch.nn.Module, before: dict[str, Any]) -> None:
    now = dict(model.named_parameters())
    for name, (pid, inner) in before.items():
        p = now[name]
        assert id(p) == pid, name
        for k, v in inner.items():
            t = getattr(p, k) if k else p.detach()
            assert t.dtype == v.dtype and torch.equal(t, v), (name, k)


def _torchao(model: torch.nn.Module) -> str:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model.model.language_model, Int8WeightOnlyConfig())
    return "torchao"


def _quanto(model: torch.nn.Module) -> str:
    from optimum.quanto import freeze, qint8, quantize

    quantize(model.model.language_model, weights=qint8)
    freeze(model.model.language_model)
    return "optimum-quanto"


@pytest.mark.parametrize("quantize", [_torchao, _quanto], ids=["torchao", "quanto"])
def test_subclass_weights_are_never_touched(quantize: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_llava(torch.bfloat16)
        library = quantize(model)
    before = _snapshot(model)
    assert len(before) >= 7, "q/k/v/o + mlp of the language model"
    assert {quantized_library(p) for n, p in model.named_parameters() if n in before} == {library}
    # fp16-true used to crash (quanto: "dtype of a weights Tensor cannot be changed", torchao:
    # aminmax on the subclass); the split policy casts the rest and leaves them alone
    for policy in ("fp16-true", "bf16", "bf16-true"):
        report = enforce_policy(model, policy)
        assert all(c.name not in before for c in report.changes), policy
        assert sum(w.startswith("quantized") for _, w in report.skipped) >= len(before)
        _same(model, before)
    dmap = dtype_map(model)
    assert dmap.groups["language_model"].quantized > 0
    handle = install_guards(model, "bf16-true", enforce_policy(model, "bf16-true"))
    with torch.no_grad():
        out = model(**tiny_batch(model))
        generated = model.generate(
            **{k: v for k, v in tiny_batch(model).items() if k != "labels"}, max_new_tokens=2
        )
    assert torch.isfinite(out.logits).all() and generated.shape[1] > 2
    handle.remove()
    _same(model, before)


@pytest.mark.parametrize("quantize", [_torchao, _quanto], ids=["torchao", "quanto"])
def test_a_group_follows_the_dtype_its_quantized_layers_compute_in(
    quantize: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16-computing quantized layers under an fp16 policy: the language model's other frozen
    weights (embeddings, norms: they set the dtype of the rotary tables) stay bf16, or q/k
    (bf16 x fp16 rotary -> fp32) and v (bf16) reach attention in different dtypes."""
    from hf_precision import PrecisionWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_llava(torch.bfloat16)
        library = quantize(model)
    model.requires_grad_(False)
    before = _snapshot(model)
    with pytest.warns(PrecisionWarning, match=r"language_model: its quantized layers") as seen:
        report = enforce_policy(model, "fp16-true")
    message = next(str(w.message) for w in seen if "quantized layers" in str(w.message))
    assert f"({library}:" in message and "compute in bfloat16, not the policy's float16" in message
    # the fix in the words of the tool the user runs: LLaMA-Factory users set bf16:/fp16:,
    # never bnb_4bit_compute_dtype
    monkeypatch.setenv("HF_PRECISION_TOOL", "llamafactory")
    said = "\n".join(check_policy(model, "fp16-true").warnings)
    assert "Fix: fp16: true so they compute in float16, or train in bfloat16 (bf16: true)" in said
    assert "bnb_4bit_compute_dtype" not in said
    lm = model.model.language_model
    assert lm.embed_tokens.weight.dtype == torch.bfloat16
    assert lm.norm.weight.dtype == torch.bfloat16
    assert report.group_dtypes["language_model"] == {torch.bfloat16}
    # the other groups follow the policy
    assert model.model.multi_modal_projector.linear_1.weight.dtype == torch.float16
    assert model.lm_head.weight.dtype == torch.float16
    handle = install_guards(model, "fp16-true", report)
    seen_qkv: list[tuple[torch.dtype, ...]] = []
    attn = lm.layers[0].self_attn
    hooks = [
        getattr(attn, n).register_forward_hook(lambda m, a, o: seen_qkv.append((o.dtype,)))
        for n in ("q_proj", "k_proj", "v_proj")
    ]
    with torch.no_grad():
        out = model(**tiny_batch(model))
    for h in hooks:
        h.remove()
    handle.remove()
    assert torch.isfinite(out.logits).all() and out.logits.dtype == torch.float16
    assert {d for (d,) in seen_qkv} == {torch.bfloat16}
    _same(model, before)


def _train_and_evaluate(
    make_trainer: Any, model: Any, batch: Any, policy: Any, flags: dict[str, Any]
) -> None:
    """A Trainer run with the callback (an evaluation every step), then evaluate(): both
    losses finite."""
    from hf_precision import PrecisionGuardCallback

    cb = PrecisionGuardCallback(policy, report=False)
    trainer = make_trainer(
        model, batch, callbacks=[cb], eval_strategy="steps", eval_steps=1, **flags
    )
    out = trainer.train()
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor([out.training_loss, metrics["eval_loss"]])).all()


#: (policy given to the callback, TrainingArguments flags, how the model is loaded)
_RUNS = {
    "bf16": (None, {"bf16": True}, "bf16"),  # the policy inferred from bf16=True
    "fp16-true": ("fp16-true", {}, "bf16"),  # a pure fp16 policy over bf16-computing weights
    "split": (None, {}, "split"),  # vision tower fp32, the rest bf16, no flag
}


@pytest.mark.parametrize("run", list(_RUNS))
@pytest.mark.parametrize("quantize", [_torchao, _quanto], ids=["torchao", "quanto"])
def test_training_evaluate_generate_with_quantized_weights(
    quantize: Any, run: str, make_trainer: Any
) -> None:
    """A trainable projector over a quantized language model: the callback trains, evaluates
    and generates under each policy; the quantized tensors stay the same objects and bytes."""

    policy, flags, load = _RUNS[run]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_llava(torch.bfloat16)
        if load == "split":
            model.model.vision_tower.float()
        library = quantize(model)
    for name, p in model.named_parameters():
        p.requires_grad = "multi_modal_projector" in name
    before = _snapshot(model)
    projector = model.model.multi_modal_projector.linear_1.weight
    start = projector.detach().clone()
    _train_and_evaluate(make_trainer, model, tiny_batch(model), policy, flags)
    assert not torch.equal(projector.detach().float(), start.float()), "the projector trained"
    # trainable weights are fp32 for the optimizer under a flag, fp16 where the policy names
    # pure fp16, and with no flag in the dtype they were loaded in (bf16 here: the language
    # model's dtype decides the frozen weights, not the fp32 vision tower's parameter count)
    want = {"bf16": torch.float32, "fp16-true": torch.float16, "split": torch.bfloat16}
    assert projector.dtype == want[run]
    if run == "split":
        assert {p.dtype for p in model.model.vision_tower.parameters()} == {torch.bfloat16}
    _same(model, before)
    with torch.no_grad():
        ids = model.generate(
            **{k: v for k, v in tiny_batch(model).items() if k != "labels"}, max_new_tokens=2
        )
    assert ids.shape[1] == tiny_batch(model)["input_ids"].shape[1] + 2
    _same(model, before)
    lm = dtype_map(model).groups["language_model"]
    label = next(d for d in lm.numel if d.startswith(library))
    assert label.endswith("->bfloat16"), label  # the dtype they compute in
    assert lm.numel[label] == sum(p.numel() for n, p in model.named_parameters() if n in before)
    # real storage: one int8 byte per weight plus the scales, less than the bf16 it replaces
    assert lm.numel[label] < lm.bytes[label] < lm.numel[label] * 2


def test_bitsandbytes_4bit_from_pretrained(tmp_path: Any) -> None:
    from transformers import BitsAndBytesConfig, LlavaForConditionalGeneration

    tiny_llava(torch.bfloat16).save_pretrained(tmp_path)
    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlavaForConditionalGeneration.from_pretrained(
            tmp_path, quantization_config=config, dtype=torch.bfloat16
        )
    before = _snapshot(model)
    assert before and {
        quantized_library(p) for n, p in model.named_parameters() if n in before
    } == {"bitsandbytes"}
    for policy in ("fp16-true", "bf16"):
        report = enforce_policy(model, policy)
        assert all(c.name not in before for c in report.changes)
        _same(model, before)
    lm = dtype_map(model).groups["language_model"]
    label = "bitsandbytes:nf4->bfloat16"  # library, format and the dtype it computes in
    weights = sum(
        p.quant_state.shape.numel()
        for n, p in model.named_parameters()
        if n in before and ".language_model." in n
    )
    assert lm.numel[label] == lm.quantized == weights  # weights, not packed bytes
    assert lm.bytes[label] == weights // 2  # two 4-bit weights per byte
    assert "uint8" not in lm.numel


def test_a_new_library_is_one_line() -> None:
    class PackedTensor(torch.Tensor):  # stands for a library's tensor class
        pass

    t = torch.zeros(2).as_subclass(PackedTensor)
    assert not is_quantized(t)
    from hf_precision.rules.dtypes import QUANTIZED_CLASSES

    register_quantized("PackedTensor", "mylib")
    try:
        assert quantized_library(t) == "mylib" and is_quantized(t)
    finally:
        del QUANTIZED_CLASSES["PackedTensor"]


def _wide_llava() -> torch.nn.Module:
    """The tiny LLaVA with 64-wide layers: bitsandbytes' CPU 4-bit inference path repacks each
    weight by blocks of 64 input features (``in_features // 64`` rows of absmax) and fails on
    narrower layers ("shape '[32, 0]' is invalid"), with or without the guard."""
    from transformers import LlavaForConditionalGeneration

    from hf_precision.tiny import tiny_config

    config: Any = tiny_config("llava")
    for sub in (config.vision_config, config.text_config):
        sub.hidden_size, sub.intermediate_size = 64, 128
    config.text_config.head_dim = 16  # k/v projections 32 wide: the repacking's block of rows
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).eval().to(torch.bfloat16)


@pytest.mark.parametrize(("bits", "run"), [(4, "bf16"), (4, "fp16-true"), (8, "bf16")])
def test_qlora_with_bitsandbytes_trains_evaluates_and_generates(
    bits: int, run: str, tmp_path: Any, make_trainer: Any
) -> None:
    """The QLoRA path: bitsandbytes via from_pretrained(quantization_config=...),
    prepare_model_for_kbit_training, LoRA, the callback with bf16=True or a pure fp16 policy
    (CPU backend)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlavaForConditionalGeneration

    source = _wide_llava() if bits == 4 else tiny_llava(torch.bfloat16)
    source.save_pretrained(tmp_path / "ckpt")
    config = (
        BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
        if bits == 4
        else BitsAndBytesConfig(load_in_8bit=True)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = LlavaForConditionalGeneration.from_pretrained(
            tmp_path / "ckpt", quantization_config=config, dtype=torch.bfloat16
        )
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
        model = get_peft_model(
            base, LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)")
        )
    before = _snapshot(model)
    assert before
    policy, flags, _ = _RUNS[run]
    _train_and_evaluate(make_trainer, model, tiny_batch(source), policy, flags)
    # bitsandbytes' CPU inference path repacks 4-bit weights in place at eval (its own tensor,
    # its own layout) and unpacks them when saving: compare in the layout it saves
    model.state_dict()
    _same(model, before)  # the packed weights: same objects, same bytes
    lora = torch.float16 if run == "fp16-true" else torch.float32  # the user named fp16
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {lora}
    # prepare_model_for_kbit_training put the norms in fp32 beside layers computing in half:
    # chosen, kept (rule deliberate_fp32); the other fp32 weights follow the quantized layers
    norms = [n for n, p in model.named_parameters() if "language_model" in n and "norm" in n]
    named = dict(model.named_parameters())
    assert norms and {named[n].dtype for n in norms} == {torch.float32}
    if bits == 4:  # the 4-bit layers compute in bf16 (bnb_4bit_compute_dtype)
        assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    with torch.no_grad():
        ids = model.generate(
            **{k: v for k, v in tiny_batch(source).items() if k != "labels"}, max_new_tokens=2
        )
    assert ids.shape[1] == tiny_batch(source)["input_ids"].shape[1] + 2


@pytest.mark.parametrize("quantize", [_torchao, _quanto], ids=["torchao", "quanto"])
def test_accelerate_plugin_leaves_quantized_weights_alone(quantize: Any, tmp_path: Any) -> None:
    """PrecisionGuardPlugin in a plain accelerate loop over a quantized language model: the
    trainable projector trains, generate works, the quantized tensors are untouched."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from hf_precision import PrecisionGuardPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_llava(torch.bfloat16)
        model.model.vision_tower.float()  # a split the plugin repairs
        quantize(model)
    for name, p in model.named_parameters():
        p.requires_grad = "multi_modal_projector" in name
    before = _snapshot(model)
    batch = tiny_batch(model)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(2)]
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    accelerator = Accelerator(cpu=True, mixed_precision="no", project_dir=str(tmp_path))
    guard = PrecisionGuardPlugin("fp16-true", report=False)
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)
    for b in loader:
        loss = model(**b).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(loss)
    with guard.evaluating(model), torch.no_grad():
        ids = model.generate(**{k: v for k, v in b.items() if k != "labels"}, max_new_tokens=2)
    assert ids.shape[1] == b["input_ids"].shape[1] + 2
    assert (
        tower_body(model.model.vision_tower).embeddings.patch_embedding.weight.dtype
        == torch.float16
    )
    _same(model, before)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_checkpoints_quanto_saves_torchao_quantize_does_not(tmp_path: Any) -> None:
    """Saving: a quanto-quantized model saves after the guard ran. A model quantized in place
    with torchao's ``quantize_`` cannot be saved by ``save_pretrained`` in transformers 5.23 /
    torchao 0.18, with or without the guard ("invalid python storage"): save the trained parts
    (``save_strategy="no"`` and ``trainer.save_model`` of the adapter or projector), or quantize
    at load with ``from_pretrained(quantization_config=TorchAoConfig(...))``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quanto, torchao, plain = (tiny_llava(torch.bfloat16) for _ in range(3))
        _quanto(quanto)
        _torchao(torchao)
        _torchao(plain)
    enforce_policy(quanto, "fp16-true")
    enforce_policy(torchao, "fp16-true")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quanto.save_pretrained(tmp_path / "quanto")
        assert (tmp_path / "quanto" / "model.safetensors").is_file()
        for model, where in ((plain, "plain"), (torchao, "guarded")):  # the same either way
            with pytest.raises(RuntimeError, match="invalid python storage"):
                model.save_pretrained(tmp_path / where)
