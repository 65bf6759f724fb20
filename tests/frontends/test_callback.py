import importlib
import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_precision import PrecisionError, PrecisionGuardCallback, PrecisionWarning
from hf_precision.engine.hooks import installed_guards
from hf_precision.frontends.callback import TRAINER_ADAPTERS, find_trainer, trainer_models
from hf_precision.frontends.frontend import GuardFrontEnd
from hf_precision.frontends.steps import StepWatch
from hf_precision.tiny import tiny_batch, tiny_llava, tower_body

LM_ATTN = r".*language_model.*\.(q_proj|v_proj)"


def _split_lora_llava():
    """A realistic load: vision tower fp16, the rest fp32, LoRA on the LM attention."""
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)
    return get_peft_model(model, LoraConfig(r=4, target_modules=LM_ATTN))


def _dtypes(params):
    return {p.dtype for p in params}


def test_bf16_flag_infers_mixed_policy_and_trains(make_trainer):
    model = _split_lora_llava()
    cb = PrecisionGuardCallback()
    trainer = make_trainer(
        model,
        tiny_batch(model.base_model.model),
        callbacks=[cb],
        bf16=True,
        eval_strategy="steps",
        eval_steps=1,
    )
    # cast at on_init_end, before the optimizer exists
    assert cb.policy is not None and cb.policy.name == "bf16"
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert _dtypes(frozen) == {torch.bfloat16}
    assert _dtypes(trainable) == {torch.float32}
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    events = [e for e, _ in cb.events]
    assert events[:2] == ["on_init_end", "on_train_begin"]
    assert "before_evaluate" in events and "on_evaluate" in events
    assert all(n == 0 for e, n in cb.events[1:])  # no drift after the first cast
    assert _dtypes(p for p in model.parameters() if p.requires_grad) == {torch.float32}
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    files = sorted(Path(trainer.args.output_dir, "precision").glob("*.json"))
    assert files, "a JSON dtype map per event"
    data = json.loads(files[0].read_text())
    assert data["event"] == "on_init_end"
    assert data["policy"]["name"] == "bf16"
    assert cb.trainer_guards == {}  # a plain Trainer runs no other model (TRL's: integrations)


def test_no_flag_uses_loaded_dtype_coherently(make_trainer):
    model = tiny_llava(dtype=torch.bfloat16)
    model.model.multi_modal_projector.to(torch.float32).requires_grad_(False)  # the odd one out
    cb = PrecisionGuardCallback(report=False)
    make_trainer(model, tiny_batch(model), callbacks=[cb])
    assert cb.policy is not None and cb.policy.name == "bf16-true"
    assert _dtypes(model.parameters()) == {torch.bfloat16}


def test_no_flag_keeps_a_trainable_fp32_projector(make_trainer):
    model = tiny_llava(dtype=torch.bfloat16)
    model.model.multi_modal_projector.to(torch.float32)  # trained, in fp32 on purpose
    cb = PrecisionGuardCallback(report=False)
    make_trainer(model, tiny_batch(model), callbacks=[cb])
    assert cb.policy is not None and cb.policy.keep_trainable_fp32
    assert _dtypes(model.model.multi_modal_projector.parameters()) == {torch.float32}
    assert _dtypes(model.model.language_model.parameters()) == {torch.bfloat16}


def test_add_callback_after_construction_enforces_at_train_begin(make_trainer):
    model = _split_lora_llava()
    trainer = make_trainer(model, tiny_batch(model.base_model.model), bf16=True)
    cb = PrecisionGuardCallback(report=False)
    trainer.add_callback(cb)
    assert torch.float16 in _dtypes(model.parameters())  # nothing happened yet
    trainer.train()
    assert cb.events[0][0] == "on_train_begin" and cb.events[0][1] > 0
    assert _dtypes(p for p in model.parameters() if not p.requires_grad) == {torch.bfloat16}
    # the optimizer still holds the model's parameters (identity kept by the repair)
    opt_params = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert {id(p) for p in model.parameters() if p.requires_grad} <= opt_params


def test_full_eval_cast_is_undone_bit_exactly(make_trainer):
    model = _split_lora_llava()
    cb = PrecisionGuardCallback(report=False)
    trainer = make_trainer(
        model, tiny_batch(model.base_model.model), callbacks=[cb], bf16=True, bf16_full_eval=True
    )
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(v, v.bfloat16().float()) for v in lora.values())
    trainer.evaluate()  # transformers casts the whole model to bf16 in place, never back
    assert cb.events[-1][0] == "on_evaluate" and cb.restored > 0
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32
            assert torch.equal(p.detach(), lora[n]), f"{n} lost precision"
    rot = model.base_model.model.model.language_model.rotary_emb
    assert rot.inv_freq.dtype == torch.float32
    trainer.train()
    assert _dtypes(p for p in model.parameters() if p.requires_grad) == {torch.float32}


def test_audit_mode_changes_nothing_but_reports(make_trainer):
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)
    cb = PrecisionGuardCallback("bf16-true", mode="audit", report=False)
    make_trainer(model, tiny_batch(model), callbacks=[cb])
    assert cb.last_report is not None and cb.last_report.changes
    assert not cb.last_report.applied
    assert torch.float32 in _dtypes(model.parameters())


def test_audit_mode_says_what_it_found_on_the_console(make_trainer, caplog):
    """Mode audit casts nothing, and says so on the console with counts, dtypes, first names and
    the report's path (issue 28: the findings sat only in precision.log)."""
    model = _fp32_rotary(tiny_llava(torch.bfloat16))
    model.model.vision_tower.to(torch.float16)
    cb = PrecisionGuardCallback("bf16-true", mode="audit")
    with caplog.at_level("WARNING", logger="hf_precision"):
        trainer = make_trainer(model, tiny_batch(model), callbacks=[cb])
    n_tower = len(cb.last_report.changes)
    assert n_tower and {c.group for c in cb.last_report.changes} == {"vision_encoder"}
    lines = [line for line in _said(caplog) if "audit found" in line]
    assert len(lines) == 1, _said(caplog)
    line = lines[0]
    assert line.startswith("hf-precision: audit found ") and "nothing cast (mode 'audit')" in line
    assert line.startswith(f"hf-precision: audit found {n_tower} tensor(s) off the policy")
    assert "float16 → bfloat16" in line and "in vision_encoder (e.g." in line
    first = next(n for n, _ in model.named_parameters() if "vision_tower" in n)
    assert f"(e.g. {first} " in line
    assert line.endswith(f"report: {trainer.args.output_dir}/precision/"), line
    assert {p.dtype for p in model.model.vision_tower.parameters()} == {torch.float16}  # not cast


def test_raise_mode_stops_at_construction(make_trainer):
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)
    with pytest.raises(PrecisionError, match="(?s)violates policy.*model.vision_tower"):
        make_trainer(
            model,
            tiny_batch(model),
            callbacks=[PrecisionGuardCallback("fp32", mode="raise", report=False)],
        )


def test_bad_arguments_fail_early():
    with pytest.raises(PrecisionError, match="unknown preset"):
        PrecisionGuardCallback("bf61")
    with pytest.raises(PrecisionError, match="unknown mode"):
        PrecisionGuardCallback(mode="loud")


def test_hooks_do_not_accumulate_over_evaluations(make_trainer):
    model = _split_lora_llava()
    cb = PrecisionGuardCallback(report=False)
    trainer = make_trainer(
        model,
        tiny_batch(model.base_model.model),
        callbacks=[cb],
        bf16=True,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
    )
    n = installed_guards(model)
    trainer.train()
    assert installed_guards(model) == n
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    trainer.evaluate()
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks


def test_full_eval_on_fp32_policy_evaluates_and_generates(make_trainer):
    """bf16_full_eval without bf16: Trainer casts the fp32 model to bf16 for evaluate(); the
    guards follow the cast weights instead of casting inputs back to fp32."""
    model = tiny_llava()
    cb = PrecisionGuardCallback(report=False)
    batch = tiny_batch(model)
    trainer = make_trainer(model, batch, callbacks=[cb], bf16_full_eval=True)
    assert cb.policy is not None and cb.policy.name == "fp32"
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    # after evaluation the fp32 policy is repaired (frozen weights were rounded by transformers:
    # that is its in-place cast; trainable values come back exactly from the stash)
    assert _dtypes(model.parameters()) == {torch.float32}
    out = model.generate(**{k: v for k, v in batch.items() if k != "labels"}, max_new_tokens=2)
    assert out.shape[1] == batch["input_ids"].shape[1] + 2


def _state(model):
    return {
        **{n: p.detach().clone() for n, p in model.named_parameters()},
        **{n: b.clone() for n, b in model.named_buffers()},
    }


def test_full_eval_gives_frozen_fp32_tensors_back_bit_for_bit(make_trainer):
    """bf16_full_eval on an fp32 model whose towers are frozen: every tensor, frozen ones
    included, is bit for bit what it was before the standalone evaluate()."""
    model = tiny_llava()
    model.model.vision_tower.requires_grad_(False)
    model.model.language_model.requires_grad_(False)
    cb = PrecisionGuardCallback(report=False)
    trainer = make_trainer(model, tiny_batch(model), callbacks=[cb], bf16_full_eval=True)
    assert cb.policy is not None and cb.policy.frozen_dtype == torch.float32
    before = _state(model)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    rounded = [n for n in frozen if not torch.equal(before[n], before[n].bfloat16().float())]
    assert len(rounded) > len(frozen) // 2  # what a bf16 round trip would change
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.evaluate()  # transformers casts the whole model to bf16 in place
    assert not [w for w in seen if "_full_eval" in str(w.message)]  # all fitted the stash
    after = _state(model)
    assert cb.restored >= len(before) - 1  # every floating tensor (not the int position ids)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name


def test_full_eval_says_in_words_what_the_stash_cannot_hold(make_trainer, monkeypatch):
    """Above the stash's memory limit the most precious tensors are kept (trainable first);
    the warning names what comes back rounded, and those are the only ones that do."""
    from hf_precision.frontends import callback

    model = tiny_llava()
    model.model.vision_tower.requires_grad_(False)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    monkeypatch.setattr(callback, "STASH_LIMIT_BYTES", trainable + 1024)
    cb = PrecisionGuardCallback(report=False)
    with pytest.warns(PrecisionWarning) as seen:
        trainer = make_trainer(model, tiny_batch(model), callbacks=[cb], bf16_full_eval=True)
    msg = next(str(w.message) for w in seen if "_full_eval" in str(w.message))
    assert msg.startswith("bfloat16_full_eval casts the model to bfloat16 in place.")
    assert "come back in their dtype with bfloat16-rounded values" in msg
    assert "frozen tensor(s)" in msg and "trainable weight(s)" not in msg
    assert "Fix: drop bfloat16_full_eval" in msg
    before = _state(model)
    trainer.evaluate()
    after = _state(model)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32
        if p.requires_grad:
            assert torch.equal(after[n], before[n]), n
    tower = [n for n, p in model.named_parameters() if n.startswith("model.vision_tower")]
    assert any(not torch.equal(after[n], before[n]) for n in tower)  # as the warning said


def test_raise_mode_lets_autocast_handle_its_ops(make_trainer):
    """Under bf16=True, frozen bf16 weights feeding an fp32 trainable projector are autocast's
    job: raise mode must not stop normal mixed-precision training."""
    model = tiny_llava()
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.model.multi_modal_projector.parameters():
        p.requires_grad_(True)
    for p in model.parameters():  # as from_pretrained(dtype=bf16): inv_freq stays fp32
        p.data = p.data.to(torch.float32 if p.requires_grad else torch.bfloat16)
    cb = PrecisionGuardCallback(mode="raise", report=False)
    trainer = make_trainer(model, tiny_batch(model), callbacks=[cb], bf16=True)
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))


# ----------------------------------------------------------------------------- misuse, said once
def test_a_keep_fp32_pattern_that_matches_nothing_warns_once(make_trainer):
    import warnings as w

    from hf_precision import PrecisionPolicy, PrecisionWarning

    model = tiny_llava()
    policy = PrecisionPolicy.from_preset(
        "bf16", keep_fp32=["model.vison_tower"], group_dtypes={"resampler": "fp32"}
    )
    with w.catch_warnings(record=True) as seen:
        w.simplefilter("always", PrecisionWarning)
        trainer = make_trainer(
            model,
            tiny_batch(model),
            bf16=True,
            callbacks=[PrecisionGuardCallback(policy, report=False)],
        )
        trainer.train()
    msgs = [str(x.message) for x in seen if issubclass(x.category, PrecisionWarning)]
    typo = [m for m in msgs if "'model.vison_tower' selects no parameter" in m]
    assert len(typo) == 1 and "Did you mean 'model.vision_tower'?" in typo[0]
    absent = [m for m in msgs if "group_dtypes['resampler'] names a group" in m]
    assert len(absent) == 1 and "LlavaForConditionalGeneration does not have" in absent[0]


def test_a_callback_reused_with_another_trainer_infers_again(make_trainer):
    cb = PrecisionGuardCallback(report=False)
    first = tiny_llava()
    make_trainer(first, tiny_batch(first), callbacks=[cb], bf16=True)
    assert cb.policy is not None and cb.policy.name == "bf16"
    second = tiny_llava()
    with pytest.warns(UserWarning, match=r"used with another Trainer before.*fp32"):
        make_trainer(second, tiny_batch(second), callbacks=[cb])  # no flag, fp32 model
    assert cb.policy.name == "fp32"
    assert {p.dtype for p in second.parameters()} == {torch.float32}  # not cast with bf16


def test_two_guards_with_different_policies_on_one_model_raise(make_trainer):
    from hf_precision import PrecisionGuardPlugin

    model = tiny_llava()
    with pytest.raises(
        PrecisionError,
        match=r"(?s)PrecisionGuardCallback\('bf16-true'\): LlavaForConditionalGeneration is "
        r"already guarded by PrecisionGuardCallback\('bf16'\).*Fix: keep one guard",
    ):
        make_trainer(
            model,
            tiny_batch(model),
            bf16=True,
            callbacks=[
                PrecisionGuardCallback("bf16", report=False),
                PrecisionGuardCallback("bf16-true", report=False),
            ],
        )
    # the same policy twice is harmless; a plugin with another policy is refused too
    kept = make_trainer(
        model,
        tiny_batch(model),
        bf16=True,
        callbacks=[
            PrecisionGuardCallback("bf16", report=False),
            PrecisionGuardCallback("bf16", report=False),
        ],
    )
    with pytest.raises(PrecisionError, match="already guarded"):
        PrecisionGuardPlugin("fp16", report=False).setup(model)
    assert kept.callback_handler is not None


def test_fp32_weights_under_the_flag_warn_in_the_users_words(make_trainer, monkeypatch):
    monkeypatch.setenv("HF_PRECISION_TOOL", "python")
    model = tiny_llava()
    with pytest.warns(
        UserWarning,
        match=r"PrecisionGuardCallback\('fp32'\) with TrainingArguments\(bf16=True\): the "
        r"Trainer autocasts to bfloat16, but the policy keeps weights in float32 .*it runs.*"
        r"Fix: PrecisionGuardCallback\(\) \(it follows TrainingArguments\(bf16=True\)\)",
    ):
        make_trainer(
            model,
            tiny_batch(model),
            bf16=True,
            callbacks=[PrecisionGuardCallback("fp32", report=False)],
        )


def _snapshot(model):
    return {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()} | {
        n: (b.dtype, b.data_ptr()) for n, b in model.named_buffers()
    }


@pytest.mark.parametrize(
    ("preset", "flag", "tool", "said", "fix"),
    [
        # the case: 60 tensors cast to fp16, then autocast::prioritize crashed
        (
            "fp16",
            "bf16",
            "python",
            r"TrainingArguments\(bf16=True\)",
            r"TrainingArguments\(fp16=True\)",
        ),
        ("fp16-true", "bf16", "llamafactory", "bf16: true", "fp16: true instead of bf16: true"),
        ("bf16", "fp16", "trl", "--fp16", "--bf16 instead of --fp16"),
        ("bf16-true", "fp16", "swift", "--fp16 true", "--bf16 true instead of --fp16 true"),
    ],
)
def test_a_policy_the_flags_cannot_run_is_refused_before_anything_is_cast(
    make_trainer, monkeypatch, preset, flag, tool, said, fix
):
    monkeypatch.setenv("HF_PRECISION_TOOL", tool)
    model = tiny_llava()
    before = _snapshot(model)
    with pytest.raises(PrecisionError) as err:
        make_trainer(
            model, tiny_batch(model), callbacks=[PrecisionGuardCallback(preset)], **{flag: True}
        )
    assert _snapshot(model) == before  # nothing cast, no tensor replaced
    assert installed_guards(model) == 0
    text = str(err.value)
    half = {"bf16": "bfloat16", "fp16": "float16"}
    other = half["fp16" if flag == "bf16" else "bf16"]
    assert text.startswith(f"PrecisionGuardCallback({preset!r}) with ")
    assert re.search(said, text.splitlines()[0]), text
    assert f"autocasts to {half[flag]}, but the policy holds weights in {other}" in text
    assert "Nothing was cast." in text
    assert re.search(r"Fix: PrecisionGuardCallback\(\) .*" + fix, text), text


def test_fp16_trainables_under_the_grad_scaler_are_refused_before_casting(
    make_trainer, monkeypatch
):
    monkeypatch.setenv("HF_PRECISION_TOOL", "axolotl")
    model = tiny_llava()
    before = _snapshot(model)
    with pytest.raises(PrecisionError, match=r"(?s)Attempting to unscale FP16.*bf16: true"):
        make_trainer(
            model, tiny_batch(model), callbacks=[PrecisionGuardCallback("fp16-true")], fp16=True
        )
    assert _snapshot(model) == before


def test_train_end_repairs_what_load_best_model_at_end_brought_back(make_trainer, tmp_path):
    base = tiny_llava(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=LM_ATTN))
    cb = PrecisionGuardCallback("bf16-true")  # adapters in bf16, by name
    trainer = make_trainer(
        model,
        tiny_batch(base),
        callbacks=[cb],
        max_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
    )
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    trainer.train()
    ends = [(e, n) for e, n in cb.events if e == "on_train_end"]
    assert ends and ends[-1][1] > 0  # the reload brought adapters back in PEFT's fp32
    assert {p.dtype for p in lora} == {torch.bfloat16}  # ... and the guard repaired them
    assert list(Path(trainer.args.output_dir, "precision").glob("*-on_train_end.json"))


def test_wrappers_are_unwrapped_or_refused():
    from hf_precision import enforce_policy, find_module_groups

    class MyWrapper(torch.nn.Module):  # any DDP-like wrapper: one child called `module`
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = tiny_llava()
    assert find_module_groups(MyWrapper(model)).rule == "llava"
    model.model.vision_tower.to(torch.float16)
    with pytest.raises(
        PrecisionError,
        match=r"(?s)enforce_policy\(DataParallel\(\.\.\.\)\): "
        r"\d+ tensor\(s\) violate.*before DataParallel wraps it",
    ):
        enforce_policy(torch.nn.DataParallel(model), "bf16")
    assert (
        tower_body(model.model.vision_tower).embeddings.patch_embedding.weight.dtype
        == torch.float16
    )
    report = enforce_policy(torch.nn.DataParallel(model), "bf16", mode="audit")
    assert report.changes and not report.applied


def test_the_init_repair_is_said_on_the_console(make_trainer, caplog):
    import logging

    model = tiny_llava()
    model.model.vision_tower.to(torch.float16)
    with caplog.at_level(logging.WARNING, logger="hf_precision"):
        make_trainer(
            model, tiny_batch(model), bf16=True, callbacks=[PrecisionGuardCallback(report=False)]
        )
    lines = [r.getMessage() for r in caplog.records if " tensors → " in r.getMessage()]
    assert len(lines) == 1 and " tensors → float32 (trainable) in " in lines[0]
    assert "vision_encoder" in lines[0] and lines[0].endswith("report: off (report=False)")


# ---------------------------------------------------------------------- in the user's words


def _fp32_rotary(model):
    """Rotary tables back in fp32 after a whole-model ``.to(half)`` (so the only casts are the
    ones a test is about)."""
    for mod in model.modules():
        for name in ("inv_freq", "original_inv_freq"):
            if isinstance(mod._buffers.get(name), torch.Tensor):
                mod._buffers[name] = mod._buffers[name].float()
    return model


def _said(caplog, level="WARNING"):
    return [
        r.getMessage() for r in caplog.records if r.name == "hf_precision" and r.levelname == level
    ]


def test_the_console_line_names_dtypes_counts_names_rule_and_report(
    make_trainer, caplog, monkeypatch
):
    from hf_precision.base.tables import fmt_bytes

    monkeypatch.setenv("HF_PRECISION_TOOL", "python")
    model = _fp32_rotary(tiny_llava(torch.bfloat16))
    tower = model.model.vision_tower.to(torch.float16)
    model.requires_grad_(False)
    proj = model.model.multi_modal_projector.requires_grad_(True)
    n_tower = sum(1 for _ in tower.parameters()) + sum(
        1 for b in tower.buffers() if b.is_floating_point()
    )
    n_proj = sum(1 for _ in proj.parameters())
    with caplog.at_level("WARNING", logger="hf_precision"):
        trainer = make_trainer(
            model, tiny_batch(model), callbacks=[PrecisionGuardCallback()], bf16=True
        )
    out = trainer.args.output_dir
    line, memory = _said(caplog)[:2]
    first = next(n for n, _ in model.named_parameters() if n.startswith("model.vision_tower"))
    assert line.startswith(
        f"hf-precision: {n_tower} tensors → bfloat16 (frozen), {n_proj} → float32 (trainable) "
        f"in vision_encoder, projector (e.g. {first} float16 → bfloat16; "
    ), line
    assert f"; and {n_tower + n_proj - 3} more); policy bf16 (frozen bfloat16" in line
    assert line.endswith(
        f", inferred from TrainingArguments(bf16=True); report: {out}/precision/"
    ), line
    numel = sum(p.numel() for p in proj.parameters())
    assert memory == (
        f"hf-precision: upcast weights take more memory: projector {fmt_bytes(2 * numel)} → "
        f"{fmt_bytes(4 * numel)} ({n_proj} weights; rule: trainable {n_proj})"
    )
    assert {p.dtype for p in proj.parameters()} == {torch.float32}


@pytest.mark.parametrize(
    ("argv", "origin"),
    [
        # a script that takes other options but builds TrainingArguments(bf16=True) in Python
        (["train.py", "--epochs", "3"], "inferred from TrainingArguments(bf16=True)"),
        # an HfArgumentParser script given --bf16 on its command line
        (["train.py", "--output_dir", "out", "--bf16"], "inferred from --bf16"),
    ],
)
def test_the_console_line_names_the_flag_as_the_user_set_it(
    make_trainer, caplog, monkeypatch, argv, origin
):
    monkeypatch.delenv("HF_PRECISION_TOOL", raising=False)
    monkeypatch.setattr(sys, "argv", argv)
    model = tiny_llava(torch.bfloat16)
    model.model.vision_tower.to(torch.float32)
    model.requires_grad_(False)
    with caplog.at_level("WARNING", logger="hf_precision"):
        make_trainer(model, tiny_batch(model), callbacks=[PrecisionGuardCallback()], bf16=True)
    line = _said(caplog)[0]
    assert "policy bf16 (frozen bfloat16" in line and f", {origin}; report: " in line, line


def test_a_run_whose_inputs_only_the_hooks_cast_says_so_once_per_kind(make_trainer, caplog):
    model = _fp32_rotary(tiny_llava(torch.bfloat16))
    model.requires_grad_(False)
    model.model.multi_modal_projector.float().requires_grad_(True)  # trained in fp32, no flag
    cb = PrecisionGuardCallback()
    with caplog.at_level("WARNING", logger="hf_precision"):
        trainer = make_trainer(model, tiny_batch(model), callbacks=[cb], max_steps=2)
        assert cb.events == [("on_init_end", 0)] and not _said(caplog)  # nothing cast
        trainer.train()
    said = _said(caplog)
    kinds = [re.match(r"hf-precision: the (\w+) guard", s) for s in said]
    assert all(kinds), said
    assert len({k.group(1) for k in kinds if k}) == len(said)  # once per kind
    out = trainer.args.output_dir
    assert (
        "hf-precision: the boundary guard at model.multi_modal_projector casts input 0 "
        "bfloat16 → float32 (said once per guard kind); nothing in the model was cast: its "
        f"hooks cast inputs at the boundary; report: {out}/precision/"
    ) in said, said
    assert any(
        s.startswith("hf-precision: the batch guard casts pixel_values float32") for s in said
    )


def _vision_heavy_llava():
    """A tiny LLaVA whose vision tower (fp32, frozen) outweighs its language model (bf16,
    trained in full)."""
    from transformers import LlavaForConditionalGeneration

    from hf_precision.tiny import tiny_config

    config = tiny_config("llava")
    config.vision_config.num_hidden_layers *= 4
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.to(torch.bfloat16)
    _fp32_rotary(model.lm_head.to(torch.bfloat16))
    _fp32_rotary(model)
    model.model.vision_tower.requires_grad_(False)
    return model


def test_vision_heavy_model_without_flag_keeps_its_trainable_language_model_bf16(
    make_trainer, caplog
):
    model = _vision_heavy_llava()
    lm = model.model.language_model
    by = {torch.float32: 0, torch.bfloat16: 0}
    for p in model.parameters():
        by[p.dtype] += p.numel()
    assert by[torch.float32] > by[torch.bfloat16]  # a parameter count would say fp32
    lm_params = {n: p for n, p in lm.named_parameters()}
    cb = PrecisionGuardCallback()
    with caplog.at_level("WARNING", logger="hf_precision"):
        trainer = make_trainer(model, tiny_batch(model), callbacks=[cb], max_steps=1)
    assert cb.policy is not None and cb.policy.name == "bf16-true"
    assert {p.dtype for p in lm.parameters()} == {torch.bfloat16}  # not upcast to fp32
    assert {n: p for n, p in lm.named_parameters()} == lm_params  # same Parameter objects
    assert {p.dtype for p in model.model.vision_tower.parameters()} == {torch.bfloat16}
    line, account = _said(caplog)  # no upcast memory line: nothing was upcast
    assert account.startswith("hf-precision: memory: frozen cast down ")  # what it saves
    assert " tensors → bfloat16 (frozen) in vision_encoder (e.g. " in line
    proj = model.model.multi_modal_projector  # trainable, loaded fp32: kept fp32
    assert {p.dtype for p in proj.parameters()} == {torch.float32}
    assert (
        "no precision flag: frozen weights follow the language model's bfloat16, trainable "
        "weights keep the dtype they were loaded in" in line
    )
    assert trainer.train().global_step == 1


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    return BertForSequenceClassification(config)


class _MockModel(torch.nn.Module):
    """transformers' own Trainer tests use models like this one (RegressionModel)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.5))
        self.b = torch.nn.Parameter(torch.tensor(0.1))

    def forward(self, input_x, labels=None):
        y = input_x * self.a + self.b
        return (torch.nn.functional.mse_loss(y, labels), y) if labels is not None else (y,)


@pytest.mark.parametrize("arch", ["llama", "bert", "mock"])
def test_a_plain_model_with_nothing_to_fix_is_guarded_quietly(make_trainer, caplog, arch):
    import warnings

    from hf_precision.tiny import tiny_text_llama

    ids = torch.randint(0, 60, (4, 8))
    if arch == "llama":
        model, batch = tiny_text_llama(), {"input_ids": ids, "labels": ids}
    elif arch == "bert":
        model, batch = _bert(), {"input_ids": ids, "labels": torch.tensor([0, 1, 0, 1])}
    else:
        x = torch.randn(4)
        model, batch = _MockModel(), {"input_x": x, "labels": 2 * x + 1}
    with warnings.catch_warnings(record=True) as seen, caplog.at_level("INFO", "hf_precision"):
        warnings.simplefilter("always")
        trainer = make_trainer(model, batch, callbacks=[PrecisionGuardCallback()], max_steps=1)
        trainer.train()
    ours = [w for w in seen if "hf_precision" in w.filename or "hf-precision" in str(w.message)]
    ours += [w for w in seen if w.category.__name__ == "PrecisionWarning"]
    assert not ours, [str(w.message) for w in ours]
    assert not _said(caplog, "WARNING")
    assert not any("register_group_rule" in r.getMessage() for r in caplog.records)
    # the guard's own info line is one: the policy and the rule (reports log their tables)
    assert len([m for m in _said(caplog, "INFO") if m.startswith("hf-precision: policy ")]) == 1


# ---------------------------------------------------------------- the step events
# the first step's dtype trace, the lost-update check on the Trainer's own optimizer, and the
# verify before an in-training evaluation, on a real Trainer


def test_trace_lost_updates_and_the_evaluation_verify_on_a_real_trainer(make_trainer):
    model = tiny_llava(seed=0)
    callback = PrecisionGuardCallback("fp32", trace=True)
    assert isinstance(callback.step_watch, StepWatch)
    trainer = make_trainer(
        model,
        tiny_batch(model, 2),
        callbacks=[callback],
        max_steps=3,
        eval_strategy="steps",
        eval_steps=2,
    )
    trainer.train()
    watch = callback.step_watch
    assert callback.trace_result is not None and watch.tracer is None  # first step only
    assert watch.lost is not None and not watch.lost.active  # three steps watched
    assert watch.lost.root is model
    events = [event for event, _ in callback.events]
    # each in-training evaluation (step 2, and transformers' last step) verified before it
    assert events.count("before_evaluate") == events.count("on_evaluate") >= 1
    assert events.index("before_evaluate") == events.index("on_evaluate") - 1
    folder = Path(trainer.args.output_dir) / "precision"
    [lost] = folder.glob("*-lost_updates.json")
    section = json.loads(lost.read_text())["lost_updates"]
    assert section["steps"] == 3 and section["half_share"] == 0.0  # fp32: nothing to lose
    assert callback.guard is not None and callback.guard.sections["lost_updates"] == section


def test_off_watches_no_optimizer(make_trainer):
    model = tiny_llava(seed=0)
    callback = PrecisionGuardCallback("fp32", lost_updates="off")
    make_trainer(model, tiny_batch(model, 2), callbacks=[callback], max_steps=1).train()
    assert callback.step_watch.lost is None


# ---------------------------------------------------------------- the Trainer's other models
# the Trainer adapters table; TRL's models on a real DPO/GRPO Trainer are in
# tests/integrations/test_trl_models.py and tests/test_trl.py


def test_every_adapter_names_a_module_with_trainer_models():
    for library, name in TRAINER_ADAPTERS.items():
        assert name.startswith("hf_precision.integrations."), (library, name)
        assert callable(importlib.import_module(name).trainer_models)


def test_the_callback_is_one_class_over_the_shared_base():
    """No mixin halves: the Trainer, its other models and the step events are the callback's
    own methods; the per-step work is the StepWatch it holds."""
    ours = [c for c in PrecisionGuardCallback.__mro__ if c.__module__.startswith("hf_precision")]
    assert ours == [PrecisionGuardCallback, GuardFrontEnd]
    for name in ("bind_trainer", "on_step_begin", "on_step_end", "on_log", "_attach_rl"):
        assert name in vars(PrecisionGuardCallback), name


def test_a_transformers_trainer_has_no_other_models_and_is_found_bound_or_in_frames(
    make_trainer,
):
    model = tiny_llava()
    callback = PrecisionGuardCallback("fp32", report=False)
    trainer = make_trainer(model, tiny_batch(model), callbacks=[callback])
    assert trainer_models(trainer, {}) == {}  # no adapter for transformers' own Trainer
    assert find_trainer(callback, trainer)[0] is trainer  # bound (the launcher binds it)
    assert find_trainer(callback, None)[0] is None  # no Trainer event running: no frame has it
    callback.bind_trainer(trainer)
    assert callback._trainer() is trainer  # a weak reference: no cycle keeps it alive
    assert callback.trainer_guards == {}
