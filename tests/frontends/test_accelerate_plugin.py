"""PrecisionGuardPlugin in a plain accelerate loop (one process; two processes are in
tests/engine/wrappers/test_ranks.py)."""

from __future__ import annotations

import doctest
import json
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import PrecisionError, PrecisionGuardPlugin, PrecisionPolicy, PrecisionWarning
from hf_precision.engine.hooks import installed_guards
from hf_precision.frontends.accelerate_plugin import (
    POLICY_FILE,
    STATE_VERSION,
    policy_from_checkpoint,
)
from hf_precision.frontends.frontend import GuardFrontEnd
from hf_precision.frontends.steps import StepWatch
from hf_precision.tiny import tiny_batch, tiny_llava

#: AcceleratorState is a process-wide singleton: each test gets its own (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def _split_llava() -> torch.nn.Module:
    """The planted split: a vision tower loaded in fp16 and frozen, the rest fp32 and trained."""
    model = tiny_llava()
    model.model.vision_tower.to(torch.float16).requires_grad_(False)
    return model


def _parts(model: torch.nn.Module, rows: int = 4) -> tuple[Any, Any]:
    batch = tiny_batch(model)
    data = [{k: v[i % 2] for k, v in batch.items()} for i in range(rows)]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return optimizer, loader


def _accelerator(tmp_path: Path, mixed_precision: str = "bf16", **kw: Any) -> Any:
    from accelerate import Accelerator

    return Accelerator(cpu=True, mixed_precision=mixed_precision, project_dir=str(tmp_path), **kw)


def _train(accelerator: Any, model: Any, optimizer: Any, loader: Any) -> float:
    loss = torch.tensor(float("nan"))
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return float(loss)


def _generate(accelerator: Any, model: Any, loader: Any) -> torch.Tensor:
    batch = next(iter(loader))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        return accelerator.unwrap_model(model).generate(**inputs, max_new_tokens=2)


# ----------------------------------------------------------------------------- without the guard
def test_plain_loop_fails_without_the_guard(tmp_path):
    accelerator = _accelerator(tmp_path, "no")
    model = _split_llava()
    optimizer, loader = _parts(model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with pytest.raises(RuntimeError, match=r"expected m1 and m2 to have the same dtype.*Half"):
        _train(accelerator, model, optimizer, loader)


def test_bf16_autocast_trains_but_generate_fails_without_the_guard(tmp_path):
    accelerator = _accelerator(tmp_path, "bf16")
    model = tiny_llava()
    model.model.vision_tower.to(torch.bfloat16).requires_grad_(False)  # what autocast hides
    optimizer, loader = _parts(model)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert torch.isfinite(torch.tensor(_train(accelerator, model, optimizer, loader)))
    # generate() runs outside the autocast-patched forward (root-cause class D)
    with pytest.raises(RuntimeError, match=r"expected m1 and m2 to have the same dtype"):
        _generate(accelerator, model, loader)


# ----------------------------------------------------------------------------- with the guard
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_guard_trains_evaluates_saves_and_loads(tmp_path, mixed_precision):
    accelerator = _accelerator(tmp_path, mixed_precision)
    model = _split_llava()
    optimizer, loader = _parts(model)
    guard = PrecisionGuardPlugin()
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)

    want = {"no": "fp32", "bf16": "bf16"}[mixed_precision]
    assert guard.policy is not None and guard.policy.name == want
    frozen = {p.dtype for p in model.model.vision_tower.parameters()}
    assert frozen == {torch.float32 if want == "fp32" else torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    # batch fixing at the source: the loader's collate_fn follows the vision encoder's dtype
    assert next(iter(loader))["pixel_values"].dtype == next(iter(frozen))
    assert installed_guards(model) > 0

    loss = _train(accelerator, model, optimizer, loader)
    assert torch.isfinite(torch.tensor(loss))
    assert guard.steps == 2  # the optimizer step pre-hook ran
    with guard.evaluating(model):
        ids = _generate(accelerator, model, loader)
    assert ids.shape[1] == next(iter(loader))["input_ids"].shape[1] + 2
    events = [e for e, _ in guard.events]
    assert events == ["setup", "after_prepare", "before_evaluate", "after_evaluate"]
    assert guard.events[0][1] > 0 and all(n == 0 for _, n in guard.events[1:])

    ckpt = tmp_path / "ckpt"
    accelerator.save_state(str(ckpt))
    assert (ckpt / "custom_checkpoint_0.pkl").is_file()
    assert policy_from_checkpoint(ckpt) == guard.policy
    reports = sorted(p.name for p in (tmp_path / "precision").glob("*.json"))
    # generate() outside accelerate's autocast runs the trained fp32 projector in float32:
    # the compute finding says what ran where the bf16 policy means bfloat16
    ran = ["000002-compute.json"] if want == "bf16" else []
    assert reports == [
        "000000-after_prepare.json",
        "000000-setup.json",
        "000002-after_evaluate.json",
        "000002-before_evaluate.json",
        *ran,
    ]
    setup = json.loads((tmp_path / "precision" / "000000-setup.json").read_text())
    assert setup["policy"]["name"] == want and setup["mismatches"]["found"] > 0

    accelerator.load_state(str(ckpt))
    assert [*events, "load_state"] == [e for e, _ in guard.events]


def _frozen_encoder_llava() -> torch.nn.Module:
    model = tiny_llava()
    model.model.vision_tower.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(False)
    return model


def test_policy_survives_the_checkpoint_round_trip(tmp_path):
    custom = PrecisionPolicy.from_preset("bf16", group_dtypes={"projector": "fp32"})
    accelerator = _accelerator(tmp_path)
    model = _frozen_encoder_llava()
    optimizer, loader = _parts(model)
    guard = PrecisionGuardPlugin(custom, report=False)
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)
    _train(accelerator, model, optimizer, loader)
    accelerator.save_state(str(tmp_path / "ckpt"))
    saved = json.loads((tmp_path / "ckpt" / POLICY_FILE).read_text())
    assert saved["group_dtypes"] == {"projector": "float32"} and saved["name"] == "bf16"

    # a new script: the default guard infers "bf16"; load_state brings the saved policy back
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    accelerator2 = _accelerator(tmp_path)
    model2 = _frozen_encoder_llava()
    optimizer2, loader2 = _parts(model2)
    guard2 = PrecisionGuardPlugin(report=False)
    model2, optimizer2, loader2 = guard2.prepare(accelerator2, model2, optimizer2, loader2)
    assert guard2.policy is not None and guard2.policy.group_dtypes == {}
    assert model2.model.multi_modal_projector.linear_1.weight.dtype == torch.bfloat16
    with pytest.warns(PrecisionWarning, match="the checkpoint's policy"):
        accelerator2.load_state(str(tmp_path / "ckpt"))
    assert guard2.policy == custom
    assert guard2.steps == guard.steps == 2
    # enforced under the loaded policy, with the checkpoint's values
    assert model2.model.multi_modal_projector.linear_1.weight.dtype == torch.float32
    assert torch.equal(model2.lm_head.weight, model.lm_head.weight)
    assert {p.dtype for p in model2.model.vision_tower.parameters()} == {torch.bfloat16}
    _train(accelerator2, model2, optimizer2, loader2)


def test_step_hook_repairs_drift_before_the_optimizer_step(tmp_path):
    accelerator = _accelerator(tmp_path)
    model = _split_llava()
    optimizer, loader = _parts(model)
    guard = PrecisionGuardPlugin(report=False)
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)
    batch = next(iter(loader))
    accelerator.backward(model(**batch).loss)
    model.model.multi_modal_projector.to(torch.float16)  # e.g. a callback's stray .half()
    with pytest.warns(PrecisionWarning, match=r"before_optimizer_step: dtype drift repaired"):
        optimizer.step()
    assert {p.dtype for p in model.model.multi_modal_projector.parameters()} == {torch.float32}
    assert ("before_optimizer_step", 4) in guard.events
    state = optimizer.optimizer.state[model.model.multi_modal_projector.linear_1.weight]
    assert state["exp_avg"].dtype == torch.float32


def test_step_check_is_cheap(tmp_path):
    accelerator = _accelerator(tmp_path)
    model = tiny_llava()
    optimizer, loader = _parts(model)
    guard = PrecisionGuardPlugin(report=False)
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)
    inner = optimizer.optimizer
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        guard._step_pre_hook(inner, (), {})
    per_call = (time.perf_counter() - start) / n
    params = len(guard._guarded[0].params)
    # one dtype read per parameter tensor (~0.3 µs each); generous bound for a shared CI core
    assert per_call < 2e-6 * params + 1e-4, (per_call, params)
    assert [e for e, _ in guard.events] == ["setup", "after_prepare"]  # nothing drifted


def test_check_every_skips_steps(tmp_path):
    accelerator = _accelerator(tmp_path)
    model = tiny_llava()
    optimizer, loader = _parts(model)
    guard = PrecisionGuardPlugin(report=False, check_every=2)
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)
    model.model.multi_modal_projector.to(torch.float16)
    guard._step_pre_hook(optimizer.optimizer, (), {})  # step 1: not checked
    assert model.model.multi_modal_projector.linear_1.weight.dtype == torch.float16
    with pytest.warns(PrecisionWarning, match="drift repaired"):
        guard._step_pre_hook(optimizer.optimizer, (), {})  # step 2: checked
    assert model.model.multi_modal_projector.linear_1.weight.dtype == torch.float32


def test_evaluating_repairs_what_the_block_changed(tmp_path):
    accelerator = _accelerator(tmp_path)
    model = _split_llava()
    optimizer, loader = _parts(model)
    guard = PrecisionGuardPlugin(report=False)
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)
    with (
        pytest.warns(PrecisionWarning, match="after_evaluate: dtype drift repaired"),
        guard.evaluating(model) as m,
    ):
        _generate(accelerator, m, loader)
        m.to(torch.bfloat16)  # e.g. an export step that casts in place and never casts back
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}


def test_evaluating_repairs_even_when_the_block_fails(tmp_path):
    accelerator = _accelerator(tmp_path)
    model = tiny_llava()
    guard = PrecisionGuardPlugin(report=False)
    model = guard.prepare(accelerator, model)
    with pytest.raises(KeyError), pytest.warns(PrecisionWarning), guard.evaluating(model):
        model.half()
        raise KeyError("eval failed")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_audit_mode_changes_nothing(tmp_path):
    accelerator = _accelerator(tmp_path)
    model = _split_llava()
    optimizer, loader = _parts(model)
    guard = PrecisionGuardPlugin(mode="audit", report=False)
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)
    assert {p.dtype for p in model.model.vision_tower.parameters()} == {torch.float16}
    assert guard.events[0] == ("setup", 39)
    assert guard.last_report is not None and not guard.last_report.applied
    assert next(iter(loader))["pixel_values"].dtype == torch.float32  # loader left alone


def test_raise_mode_names_the_module(tmp_path):
    accelerator = _accelerator(tmp_path)
    model = _split_llava()
    guard = PrecisionGuardPlugin(mode="raise", report=False)
    with pytest.raises(PrecisionError, match=r"model\.vision_tower\..*float16 -> bfloat16"):
        guard.prepare(accelerator, model)


def test_policy_that_contradicts_the_accelerator_is_refused_before_casting(tmp_path):
    accelerator = _accelerator(tmp_path, "bf16")
    model = tiny_llava()
    before = {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()}
    with pytest.raises(
        PrecisionError,
        match=r"(?s)^PrecisionGuardPlugin\('fp16'\) with Accelerator\(mixed_precision='bf16'\): "
        r"accelerate autocasts to bfloat16, but the policy holds weights in float16.*"
        r"Nothing was cast\..*Fix: PrecisionGuardPlugin\(\) .*"
        r"Accelerator\(mixed_precision='fp16'\) instead of Accelerator\(mixed_precision='bf16'\)",
    ):
        PrecisionGuardPlugin("fp16", report=False).prepare(accelerator, model)
    assert {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()} == before
    assert installed_guards(model) == 0


def test_fp32_policy_under_the_accelerator_warns(tmp_path):
    accelerator = _accelerator(tmp_path, "bf16")
    with pytest.warns(PrecisionWarning, match=r"accelerate autocasts to bfloat16.*it runs"):
        PrecisionGuardPlugin("fp32", report=False).prepare(accelerator, tiny_llava())


def test_bad_arguments_fail_early(tmp_path):
    with pytest.raises(PrecisionError, match="unknown mode 'fixx'"):
        PrecisionGuardPlugin(mode="fixx")
    with pytest.raises(PrecisionError, match="check_every"):
        PrecisionGuardPlugin(check_every=-1)
    accelerator = _accelerator(tmp_path)
    with pytest.raises(PrecisionError, match="no nn.Module among the objects"):
        PrecisionGuardPlugin().prepare(accelerator, torch.optim.SGD([torch.zeros(1)], lr=0.1))
    with pytest.raises(PrecisionError, match="no precision_policy.json"):
        policy_from_checkpoint(tmp_path)
    guard = PrecisionGuardPlugin(report=False)
    with pytest.raises(PrecisionError, match="no model is guarded yet"), guard.evaluating():
        pass
    with pytest.raises(PrecisionError, match="unknown state"):
        guard.load_state_dict({"version": 99})


def test_save_state_registers_once_and_remove_unhooks(tmp_path):
    accelerator = _accelerator(tmp_path)
    model = tiny_llava()
    optimizer, loader = _parts(model)
    guard = PrecisionGuardPlugin(report=False)
    model, optimizer = guard.prepare(accelerator, model, optimizer)
    loader = guard.prepare(accelerator, loader)  # a second call: same accelerator
    assert accelerator._custom_objects == [guard]
    assert next(iter(loader))["pixel_values"].dtype == torch.float32  # fp32 policy: unchanged
    guard.remove()
    assert installed_guards(model) == 0 and not optimizer.optimizer._optimizer_step_pre_hooks


def test_wandb_tracker_receives_the_dtype_maps(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from hf_precision import dtype_map

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    accelerator = _accelerator(tmp_path, log_with="wandb")
    accelerator.init_trackers("hf-precision-test")
    model = _split_llava()
    optimizer, loader = _parts(model)
    guard = PrecisionGuardPlugin()
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)
    _train(accelerator, model, optimizer, loader)
    with guard.evaluating(model):
        pass
    run = accelerator.get_tracker("wandb", unwrap=True)
    run_dir = Path(run.dir)
    assert guard._reporter.wandb.logged == [
        ("setup", 0),
        ("after_prepare", 0),
        ("before_evaluate", 2),
        ("after_evaluate", 2),
    ]
    accelerator.end_training()
    assert wandb.run is None
    files = list(
        (run_dir / "media" / "table" / "precision" / "after_evaluate").glob("modules_*.table.json")
    )
    assert len(files) == 1
    table = json.loads(files[0].read_text())
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    want = dtype_map(model, policy=guard.policy).module_rows()
    assert rows == [{**r, "modules": 1} for r in want]


def test_module_doctests():
    from accelerate.state import AcceleratorState

    import hf_precision.frontends.accelerate_plugin as mod

    AcceleratorState._reset_state(True)
    cwd = os.getcwd()
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert os.getcwd() == cwd
    assert result.failed == 0 and result.attempted >= 3


def _doc_blocks() -> list[str]:
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "scaling_out.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("index", range(len(_doc_blocks())))
def test_scaling_out_doc_blocks_run(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(_doc_blocks()[index], f"docs/scaling_out.md block {index}", "exec"), {})
    if "save_state" in _doc_blocks()[index]:
        assert (tmp_path / "ckpt" / POLICY_FILE).is_file()
        assert sorted(p.name for p in (tmp_path / "precision").glob("*.json"))


def test_the_console_line_says_where_the_policy_came_from_and_where_the_report_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    accelerator = _accelerator(tmp_path, "bf16")
    model = _split_llava()
    with caplog.at_level("WARNING", logger="hf_precision"):
        PrecisionGuardPlugin().prepare(accelerator, model)
    lines = [r.getMessage() for r in caplog.records if " tensors → " in r.getMessage()]
    assert len(lines) == 1
    assert " tensors → bfloat16 (frozen) in vision_encoder (e.g. model.vision_tower." in lines[0]
    assert lines[0].endswith(
        f", inferred from Accelerator(mixed_precision='bf16'); report: {tmp_path}/precision/"
    ), lines[0]


def test_the_plugin_is_one_class_over_the_shared_base():
    """No mixin halves: the optimizer step and the checkpoint are the plugin's own methods;
    the per-step work is the StepWatch it holds."""
    ours = [c for c in PrecisionGuardPlugin.__mro__ if c.__module__.startswith("hf_precision")]
    assert ours == [PrecisionGuardPlugin, GuardFrontEnd]
    for name in ("observe", "blame_next_step", "state_dict", "load_state_dict"):
        assert name in vars(PrecisionGuardPlugin), name
    assert isinstance(PrecisionGuardPlugin(report=False).step_watch, StepWatch)


# ---------------------------------------------------------------- the policy in a checkpoint
# the save/load round trip through a real accelerator.save_state is above


def test_policy_from_checkpoint_reads_the_file_or_names_the_fix(tmp_path):
    assert POLICY_FILE == "precision_policy.json"
    with pytest.raises(PrecisionError, match="no precision_policy.json there. Fix:"):
        policy_from_checkpoint(tmp_path)
    policy = PrecisionPolicy.from_preset("bf16", keep_fp32=("lm_head",))
    (tmp_path / POLICY_FILE).write_text(policy.to_json())
    assert policy_from_checkpoint(tmp_path) == policy
    assert policy_from_checkpoint(tmp_path / POLICY_FILE) == policy


def test_state_dict_round_trip_and_an_unknown_state_refused():
    plugin = PrecisionGuardPlugin("bf16", report=False)
    plugin.steps = 7
    state = plugin.state_dict()
    assert state == {"version": STATE_VERSION, "policy": plugin.policy.to_dict(), "steps": 7}
    other = PrecisionGuardPlugin("fp32", report=False)
    with pytest.warns(PrecisionWarning, match="the checkpoint's policy .* replaces"):
        other.load_state_dict(state)
    assert other.policy == plugin.policy and other.steps == 7
    with pytest.raises(PrecisionError, match=r"unknown state \['policy'\] \(version None\)"):
        other.load_state_dict({"policy": state["policy"]})


# ---------------------------------------------------------------- the optimizer step
# the lost-update check on a real Accelerator loop, as the Trainer path runs it (#30 item 3:
# trainable half weights under bf16 mixed precision become fp32, or are warned about with the
# measured share)


class Lora(nn.Module):
    """A frozen base and a trainable adapter, all loaded in bf16 (diffusers' LoRA script under
    ``--mixed_precision bf16`` upcasts its LoRA weights only under fp16)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
        self.lora_A = nn.Linear(8, 2, bias=False).to(torch.bfloat16)
        self.lora_B = nn.Linear(2, 8, bias=False).to(torch.bfloat16)
        nn.init.normal_(self.lora_B.weight, std=0.1)  # peft starts it at zero: no lora_A grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


def _lora_loop(
    said: Any, tmp_path: Path, plugin: PrecisionGuardPlugin, *models: nn.Module, trained: int = 0
):
    """Three real steps of AdamW at lr 1e-5 on ``models[trained]`` under bf16 mixed precision;
    returns the warnings the loop raised."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(tmp_path))
    model = models[trained]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")  # the finding goes through logging all the same
        *prepared, optimizer = plugin.prepare(accelerator, *models, optimizer)
        for _ in range(3):
            with accelerator.autocast():
                loss = prepared[trained](torch.randn(4, 8)).float().pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return said.about("updates lost")


def _lost_section(tmp_path: Path) -> dict[str, Any]:
    [path] = sorted((tmp_path / "precision").glob("*-lost_updates.json"))
    return json.loads(path.read_text())["lost_updates"]


def test_trainable_bf16_weights_become_fp32_and_lose_no_update(said, tmp_path):
    model = Lora()
    lost = _lora_loop(said, tmp_path, PrecisionGuardPlugin(), model)
    assert model.lora_A.weight.dtype == model.lora_B.weight.dtype == torch.float32
    assert model.base.weight.dtype == torch.bfloat16  # frozen: as loaded
    section = _lost_section(tmp_path)
    assert section["steps"] == 3 and section["counted"] > 0
    assert {w["name"]: w["dtype"] for w in section["weights"]} == {
        "lora_A.weight": "float32",
        "lora_B.weight": "float32",
    }
    assert section["half_share"] == 0.0 and lost == []


@pytest.mark.parametrize("policy, mode", [("bf16-true", None), (None, "audit")])
def test_trainable_bf16_weights_kept_are_warned_with_the_measured_share(
    said, tmp_path, policy, mode
):
    """The user's policy keeps them bf16 (or audit casts nothing): the plugin measures the first
    three steps, as the Trainer path does, and says the fix in its own words."""
    model = Lora()
    plugin = PrecisionGuardPlugin(policy, mode=mode)
    [line] = _lora_loop(said, tmp_path, plugin, model)
    assert model.lora_A.weight.dtype == torch.bfloat16
    section = _lost_section(tmp_path)
    assert plugin.guards[0].sections["lost_updates"] == section
    assert section["half_share"] > 0.5 and section["unchanged"] <= section["counted"]
    share = re.search(r"(\d+)% of the sampled bfloat16 elements", line)
    assert share and int(share.group(1)) == round(100 * section["half_share"])
    assert "lora_A.weight" in line and "lora_B.weight" in line
    assert "PrecisionGuardPlugin('bf16') in mode 'fix'" in line
    assert "PrecisionGuardCallback" not in line  # not the Trainer's front end
    lost = plugin.step_watch.lost
    assert lost is not None and not lost.active  # hooks off after step 3


def test_the_model_the_optimizer_trains_is_the_one_watched(said, tmp_path):
    frozen, trained = nn.Linear(8, 8).requires_grad_(False), Lora()
    plugin = PrecisionGuardPlugin("bf16-true")
    _lora_loop(said, tmp_path, plugin, frozen, trained, trained=1)
    assert "lost_updates" not in plugin.guards[0].sections
    names = [w["name"] for w in plugin.guards[1].sections["lost_updates"]["weights"]]
    assert names == ["lora_A.weight", "lora_B.weight"]


def test_lost_updates_off_watches_nothing(said, tmp_path):
    plugin = PrecisionGuardPlugin("bf16-true", lost_updates="off")
    assert _lora_loop(said, tmp_path, plugin, Lora()) == []
    assert plugin.step_watch.lost is None
    assert not list((tmp_path / "precision").glob("*lost_updates*"))


def test_under_fp16_trainable_half_weights_become_fp32_or_are_refused_before_casting():
    """#30 item 3, fp16 as for the Trainer: the inferred policy holds the LoRA weights in fp32;
    a policy that trains them in fp16 is refused before anything is cast (the GradScaler
    would raise 'Attempting to unscale FP16 gradients')."""
    from accelerate import Accelerator

    model = Lora().to(torch.float16)
    optimizer = torch.optim.AdamW([model.lora_A.weight, model.lora_B.weight], lr=1e-5)
    plugin = PrecisionGuardPlugin(report=False)
    plugin.prepare(Accelerator(cpu=True, mixed_precision="fp16"), model, optimizer)
    assert model.lora_A.weight.dtype == model.lora_B.weight.dtype == torch.float32
    assert model.base.weight.dtype == torch.float16
    assert optimizer.param_groups[0]["params"][0] is model.lora_A.weight
    kept = Lora().to(torch.float16)
    with pytest.raises(PrecisionError, match="Attempting to unscale FP16 gradients"):
        PrecisionGuardPlugin("fp16-true", report=False).prepare(
            Accelerator(cpu=True, mixed_precision="fp16"), kept
        )
    assert kept.lora_A.weight.dtype == torch.float16  # nothing cast
