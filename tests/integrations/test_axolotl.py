"""``hf_precision.integrations.axolotl``: the plugin's methods and config key here (no axolotl
needed: a real Trainer gets the callback the way axolotl passes it), and axolotl 0.21's real
``axolotl.cli.train`` in its own venv (``make test-axolotl``) on a tiny LLaMA LoRA job."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision import PrecisionGuardCallback
from hf_precision.errors import PrecisionError
from hf_precision.integrations import axolotl as plugin
from hf_precision.tiny import tiny_text_llama

# ------------------------------------------------------------------ the key and the methods


@pytest.mark.parametrize(
    ("value", "preset", "mode"),
    [
        ("auto", None, None),
        (True, None, None),
        ("bf16", "bf16", "fix"),
        ({"policy": "fp16", "mode": "audit"}, "fp16", "audit"),
        ({"mode": "raise"}, None, None),  # inferred later, mode kept for then
    ],
)
def test_config_values_give_the_callback(value: Any, preset: str | None, mode: Any) -> None:
    cb = plugin.callback_from_config(value)
    assert isinstance(cb, PrecisionGuardCallback)
    if preset is None:
        assert cb.policy is None  # inferred from the Trainer's arguments at on_init_end
    else:
        assert cb.policy is not None and cb.policy.name == preset and cb.policy.mode == mode


@pytest.mark.parametrize("value", [False, "off", "none", "false"])
def test_off(value: Any) -> None:
    assert plugin.callback_from_config(value) is None
    assert (
        plugin.PrecisionGuardPluginMethods().add_callbacks_pre_trainer(
            {"precision_guard": value}, None
        )
        == []
    )


def test_policy_json_path_and_mapping(tmp_path: Path) -> None:
    from hf_precision import PrecisionPolicy

    policy = PrecisionPolicy.from_preset("bf16", keep_fp32=["lm_head"])
    path = tmp_path / "policy.json"
    path.write_text(policy.to_json())
    for value in (str(path), {"policy": str(path)}, json.loads(policy.to_json())):
        cb = plugin.callback_from_config(value)
        assert cb is not None and cb.policy == policy


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"policy": "bf16", "colour": "red"}, ["unknown key(s) ['colour']", "policy, mode"]),
        ("/nowhere/policy.json", ["existing policy JSON file", "/nowhere/policy.json"]),
        ("bf17", ["bf17"]),
        (3, ["got int", "precision_guard: auto"]),
    ],
)
def test_bad_values_fail_at_register_naming_the_key(value: Any, words: list[str]) -> None:
    with pytest.raises(PrecisionError) as err:
        plugin.PrecisionGuardPluginMethods().register({"precision_guard": value})
    for word in words:
        assert word in str(err.value)


def test_input_args_model_validates_the_key() -> None:
    pytest.importorskip("pydantic")
    from pydantic import ValidationError

    assert plugin.PrecisionGuardPluginMethods().get_input_args() == plugin.ARGS
    module, name = plugin.ARGS.rsplit(".", 1)
    model = getattr(importlib.import_module(module), name)  # how axolotl imports it
    assert model().precision_guard is None
    assert model(precision_guard={"policy": "bf16"}).precision_guard == {"policy": "bf16"}
    with pytest.raises(ValidationError):
        model(precision_guard=["bf16"])


def test_pre_trainer_callback_fires_on_init_end(tiny_args: Any) -> None:
    """axolotl passes ``add_callbacks_pre_trainer``'s list to the Trainer's constructor: the
    guard casts at ``on_init_end``, before the optimizer exists."""
    from transformers import Trainer

    model = tiny_text_llama(torch.float32)
    model.requires_grad_(False)  # frozen (LoRA's base): the split is put back together
    model.model.layers[0].self_attn.to(torch.bfloat16)
    callbacks = plugin.PrecisionGuardPluginMethods().add_callbacks_pre_trainer(
        {"precision_guard": None},
        model,  # axolotl's DictDefault: None when left out
    )
    assert [type(c) for c in callbacks] == [PrecisionGuardCallback]
    trainer = Trainer(model=model, args=tiny_args(), callbacks=callbacks)
    assert trainer.optimizer is None
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert callbacks[0].events[0][0] == "on_init_end"


def test_flags_axolotl_set_itself_are_named(caplog: Any) -> None:
    methods = plugin.PrecisionGuardPluginMethods()
    methods.register({"precision_guard": "auto"})  # bf16/fp16 left out: axolotl's auto
    with caplog.at_level("WARNING", logger="hf_precision"):
        methods.add_callbacks_pre_trainer({"bf16": False, "fp16": True}, None)
    assert methods.set_by_axolotl == {"fp16": True}
    assert "fp16=True was set by axolotl" in caplog.text
    mine = plugin.PrecisionGuardPluginMethods()
    mine.register({"fp16": True})
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_precision"):
        mine.add_callbacks_pre_trainer({"bf16": False, "fp16": True}, None)
    assert mine.set_by_axolotl == {} and "set by axolotl" not in caplog.text


def test_plugin_class_without_axolotl_says_what_to_do() -> None:
    if importlib.util.find_spec("axolotl") is not None:
        pytest.skip("axolotl is installed here")
    with pytest.raises(ImportError, match=r"needs axolotl \(Python >= 3.12; tested against 0.21\)"):
        plugin.PrecisionGuardPlugin  # noqa: B018


# ------------------------------------------------------------------ axolotl, real

CFG = """
base_model: {root}/model
tokenizer_type: AutoTokenizer
plugins:
  - hf_precision.integrations.axolotl.PrecisionGuardPlugin
precision_guard: {value}
datasets:
  - path: {root}/data.jsonl
    type: alpaca
    ds_type: json
dataset_prepared_path: {root}/prepared
adapter: lora
lora_r: 4
lora_alpha: 8
lora_target_modules: [q_proj, v_proj]
sequence_len: 64
micro_batch_size: 2
max_steps: 3
num_epochs: 1
learning_rate: 0.0001
optimizer: adamw_torch
output_dir: {root}/out
val_set_size: 0
save_strategy: "no"
logging_steps: 1
"""
MAKE = """
import json, sys, torch
from hf_precision.tiny import tiny_text_llama, tiny_llava_processor
root = sys.argv[1]
tiny_text_llama(torch.bfloat16).save_pretrained(root + "/model")
tiny_llava_processor(root + "/processor").tokenizer.save_pretrained(root + "/model")
pairs = [("circle", "red"), ("square", "blue"), ("triangle", "green"), ("circle", "yellow")]
rows = [{"instruction": "what is in the image ?", "input": "", "output": f"a {c} {s}"}
        for s, c in pairs]
open(root + "/data.jsonl", "w").write("\\n".join(json.dumps(r) for r in rows))
"""


@pytest.fixture
def axolotl_job(axolotl_venv: Any, tmp_path: Path) -> Any:
    proc = axolotl_venv.run([axolotl_venv.python, "-c", MAKE, str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]

    def run(value: str) -> Any:
        (tmp_path / "cfg.yml").write_text(CFG.format(root=tmp_path, value=value))
        return axolotl_venv.run(
            [axolotl_venv.python, "-m", "axolotl.cli.train", "cfg.yml"],
            cwd=tmp_path,
            AXOLOTL_DO_NOT_TRACK="1",
            WANDB_MODE="disabled",
        )

    return run


@pytest.mark.frameworks
@pytest.mark.slow
def test_axolotl_train_with_the_plugin_key(axolotl_job: Any, tmp_path: Path, reports: Any) -> None:
    proc = axolotl_job("{policy: auto, mode: fix}")
    assert proc.returncode == 0, reports.tail(proc)
    assert "Plugin loaded successfully: hf_precision.integrations.axolotl" in proc.stdout
    losses = [
        float(line.split("'loss': '")[1].split("'")[0])
        for line in proc.stdout.replace("\r", "\n").splitlines()
        if "'loss': '" in line
    ]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    first = json.loads((tmp_path / "out" / "precision" / "000000-on_init_end.json").read_text())
    last = reports.last(tmp_path / "out" / "precision")
    assert last["event"] == "on_train_end" and last["step"] == 3
    # `bf16: auto` (axolotl's default) found no bf16 GPU: axolotl turned on fp16 itself and
    # loaded the bf16 checkpoint in float16; the guard follows it and says whose flag it was
    assert "fp16=True was set by axolotl" in proc.stdout
    assert first["policy"]["frozen_dtype"] == "float16"
    assert first["policy"]["trainable_dtype"] == "float32"
    assert last["dtype_map"]["groups"]["language_model"]["trainable"] > 0


@pytest.mark.frameworks
@pytest.mark.slow
def test_axolotl_bad_key_fails_before_loading_the_model(axolotl_job: Any, tmp_path: Path) -> None:
    proc = axolotl_job("{policy: bf16, colour: red}")
    assert proc.returncode != 0
    assert "unknown key(s) ['colour']" in proc.stdout
    assert not (tmp_path / "out" / "precision").exists()
