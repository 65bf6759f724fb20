"""The LoRA recipes (recipes/lora_llava.py, recipes/lora_minicpmv.py) and their YAML configs.

Configs are validated in-process; each recipe then runs a few steps of its tiny config in a
subprocess, exactly as a user launches it, and the saved adapter is reloaded with peft.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"llava": "lora_llava", "minicpmv": "lora_minicpmv"}
CONFIGS = sorted(
    p for family in RECIPES for p in (ROOT / "recipes" / "configs" / family).glob("*.yaml")
)
# A handful of steps: enough for the loss to move, an evaluation with generate(), a report.
FEW_STEPS = [
    "--max_steps",
    "4",
    "--eval_steps",
    "4",
    "--logging_steps",
    "1",
    "--num_synthetic_train",
    "16",
    "--num_synthetic_eval",
    "4",
    "--num_generate",
    "2",
]
RESAMPLER_ERROR = "mat1 and mat2 must have the same dtype, but got Float and BFloat16"


def load_recipe(family: str) -> ModuleType:
    name = RECIPES[family]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


def cpu_flags() -> list[str]:
    # TrainingArguments rejects bf16 without a GPU unless use_cpu is set.
    return [] if torch.cuda.is_available() else ["--use_cpu", "true"]


def run_recipe(family: str, config: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / f"{RECIPES[family]}.py"),
        "--config",
        str(ROOT / config),
        "--output_dir",
        str(out),
        *FEW_STEPS,
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_validates(config: Path) -> None:
    family = config.parent.name
    recipe = load_recipe(family)
    text = config.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    rel = config.relative_to(ROOT).as_posix()
    launch = f"python recipes/{RECIPES[family]}.py --config {rel}"
    assert text.startswith("# "), "a config begins with a comment saying what it is"
    assert any(line == f"# Launch:   {launch}" for line in header), header
    assert any(line.startswith(f"# Override: {launch} --") for line in header), header

    raw = yaml.safe_load(text)
    model_args, data_args, lora_args, train_args = recipe.parse_args(
        ["--config", str(config), *cpu_flags()]
    )
    # Every YAML value arrived in a dataclass field, converted to the field's type.
    parsed = {**vars(model_args), **vars(data_args), **vars(lora_args)}
    for key, value in raw.items():
        got = parsed.get(key, getattr(train_args, key, None))
        if key in (
            "output_dir",
            "data_path",
            "eval_data_path",
            "image_folder",
            "model_name_or_path",
        ) and value not in (None, "tiny"):
            assert got == str((ROOT / value).resolve()) and Path(str(got)).is_absolute()
        elif key == "report_to":
            assert got == ([] if value == "none" else [value])
        elif isinstance(value, float):
            assert got == pytest.approx(value) and isinstance(got, float), key
        elif isinstance(value, (bool, int)) and not isinstance(got, str):
            assert got == value, key
    assert Path(train_args.output_dir).is_absolute()
    assert train_args.bf16 and model_args.dtype == "bfloat16"
    targets = recipe.LORA_TARGETS if family == "llava" else recipe.LORA_TARGETS["native"]
    assert set(lora_args.lora_targets.split(",")) <= set(targets)

    if model_args.model_name_or_path == "tiny":
        recipe.check_paths(model_args, data_args)
        assert train_args.use_cpu and train_args.save_strategy == "no"
    else:
        assert "lm_head" not in lora_args.lora_targets  # tiny-only crutch
        with pytest.raises(
            SystemExit,
            match=r"is not a folder\. Fix: download it once.*hf "
            r"download (llava-hf|openbmb)/",
        ):
            recipe.check_paths(model_args, data_args)
    # trust_remote_code only where the config says so explicitly.
    assert getattr(model_args, "trust_remote_code", False) == bool(raw.get("trust_remote_code"))
    assert ("remote" in config.name) == bool(raw.get("trust_remote_code"))


@pytest.mark.parametrize("family", sorted(RECIPES))
def test_unknown_config_field_is_rejected(family: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name_or_path: tiny\nlora_rank: 8\n")
    with pytest.raises(SystemExit, match=r"unknown field\(s\) \['lora_rank'\]"):
        load_recipe(family).parse_args(["--config", str(bad)])


def test_yaml_float_strings_and_cli_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("learning_rate: 1e-3\nlora_r: 4\nuse_cpu: true\n")  # YAML reads 1e-3 as str
    recipe = load_recipe("llava")
    _, _, lora_args, train_args = recipe.parse_args(["--config", str(cfg), "--lora_r", "2"])
    assert train_args.learning_rate == pytest.approx(1e-3) and lora_args.lora_r == 2
    model_args, *_ = recipe.parse_args(["--config", str(cfg), "--no_guard"])
    assert model_args.guard is False


# ----------------------------------------------------------------------------- pieces


def test_llava_lora_targets_only_the_language_model() -> None:
    recipe = load_recipe("llava")
    model, _ = recipe.load_model(recipe.ModelArguments())
    peft_model = recipe.apply_lora(model, recipe.LoraArguments())
    lora = {
        n.rsplit(".lora_A", 1)[0] for n, _ in peft_model.named_modules() if n.endswith(".lora_A")
    }
    assert lora and all(".language_model.layers." in n and ".self_attn." in n for n in lora)
    assert {n.rsplit(".", 1)[1] for n in lora} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    # The vision tower has q_proj/v_proj too; they only join when asked.
    model, _ = recipe.load_model(recipe.ModelArguments())
    args = recipe.LoraArguments(lora_targets="language_model,projector,vision_encoder")
    names = [n for n, _ in recipe.apply_lora(model, args).named_modules() if n.endswith(".lora_A")]
    assert any(".vision_tower." in n for n in names)
    assert any(".multi_modal_projector." in n for n in names)
    with pytest.raises(SystemExit, match=r"unknown \['vision'\]"):
        recipe.apply_lora(
            recipe.load_model(recipe.ModelArguments())[0],
            recipe.LoraArguments(lora_targets="vision"),
        )


def test_tiny_llava_loads_with_a_planted_split() -> None:
    recipe = load_recipe("llava")
    model, _ = recipe.load_model(recipe.ModelArguments())
    from hf_precision import dtype_map

    groups = dtype_map(model).groups
    assert groups["vision_encoder"].dtypes == ("float32",)
    assert groups["projector"].dtypes == ("float32",)
    assert groups["language_model"].dtypes == ("bfloat16",)
    assert groups["lm_head"].dtypes == ("bfloat16",)


def test_minicpmv_lora_targets_llm_not_vpm() -> None:
    recipe = load_recipe("minicpmv")
    model, _, layout = recipe.load_model(recipe.ModelArguments())
    assert layout == "remote"
    names = [
        n
        for n, _ in recipe.apply_lora(model, recipe.LoraArguments(), layout).named_modules()
        if n.endswith(".lora_A")
    ]
    assert names and all(".llm.model.layers." in n for n in names)


def test_llava_loads_a_local_checkpoint_folder(tmp_path: Path) -> None:
    """The real-checkpoint path (from_pretrained on a local folder), on a saved tiny LLaVA."""
    from hf_precision.tiny import tiny_llava, tiny_llava_processor

    tiny_llava().save_pretrained(tmp_path)
    tiny_llava_processor(str(tmp_path))
    recipe = load_recipe("llava")
    model_args, *_ = recipe.parse_args(["--model_name_or_path", str(tmp_path)])
    model, processor = recipe.load_model(model_args)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # dtype: bfloat16
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_id


def test_minicpmv_remote_code_needs_an_explicit_flag(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"model_type": "minicpmv", "auto_map": {"AutoModel": "modeling_minicpmv.MiniCPMV"}}
        )
    )
    (tmp_path / "modeling_minicpmv.py").write_text("raise SystemExit('remote code ran')\n")
    recipe = load_recipe("minicpmv")
    model_args, data_args, *_ = recipe.parse_args(["--model_name_or_path", str(tmp_path)])
    recipe.check_paths(model_args, data_args)
    with pytest.raises(SystemExit, match=r"remote-code checkpoint .*--trust_remote_code true"):
        recipe.load_model(model_args)


@pytest.mark.parametrize("family", sorted(RECIPES))
def test_collator_learns_only_the_answer(family: str, tmp_path: Path) -> None:
    from hf_precision.tiny.data import make_shapes_dataset

    recipe = load_recipe(family)
    files = make_shapes_dataset(tmp_path, n_train=3, n_eval=0)
    rows = [json.loads(line) for line in files["train"].read_text().splitlines()]
    loaded = recipe.load_model(recipe.ModelArguments())
    processor = loaded[1]
    batch = recipe.ConversationCollator(processor, str(tmp_path))(rows)
    tok = processor.tokenizer
    for i, row in enumerate(rows):
        learnt = batch["labels"][i][batch["labels"][i] != -100].tolist()
        answer = row["conversations"][-1]["value"]
        assert tok.convert_ids_to_tokens(learnt) == [*answer.split(), tok.eos_token]
    assert batch["pixel_values"].dtype == torch.float32  # the guard casts it, not the collator


# ----------------------------------------------------------------------------- end to end


def reload_and_compare(family: str, out: Path, report: dict[str, Any]) -> None:
    """Rebuild the base model, load the saved adapter with peft, apply the run's policy and
    guards: the logits on the saved check batch must equal those of the trained model."""
    from peft import PeftModel

    from hf_precision import PrecisionPolicy, enforce_policy, install_guards

    recipe = load_recipe(family)
    loaded = recipe.load_model(recipe.ModelArguments())
    model = PeftModel.from_pretrained(loaded[0], out / "adapter")
    policy = PrecisionPolicy.from_dict(report["policy"])
    install_guards(model, policy, enforce_policy(model, policy))
    from safetensors.torch import load_file

    check = load_file(out / "logits_check.safetensors")
    inputs = {
        k.removeprefix("batch."): v
        for k, v in check.items()
        if k.startswith("batch.") and k != "batch.labels"
    }
    model.eval()
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1].float()
    torch.testing.assert_close(logits, check["logits"], rtol=0, atol=1e-5)
    # ... and the adapter matters: the base model alone gives other logits.
    with torch.no_grad(), model.disable_adapter():
        assert not torch.allclose(model(**inputs).logits[:, -1].float(), check["logits"])


def test_llava_recipe_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_recipe("llava", "recipes/configs/llava/tiny.yaml", out, "--report_to", "wandb")
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "precision_report.json").read_text())
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 8
    assert sorted(p.name for p in (out / "precision").glob("*-on_init_end.json"))
    # As loaded: the planted split; after the guard: every frozen weight bf16, LoRA fp32.
    before, after = report["dtype_map_before"]["groups"], report["dtype_map_after"]["groups"]
    assert set(before["vision_encoder"]["numel"]) == {"float32"}
    assert set(after["vision_encoder"]["numel"]) == {"bfloat16"}
    # the projector is trained in full (peft's modules_to_save copy, fp32); its frozen original
    # follows the policy
    projector = after["projector"]
    assert projector["numel"]["float32"] == projector["trainable"] > 0
    assert projector["numel"]["bfloat16"] == projector["trainable"]
    lm = after["language_model"]
    assert lm["numel"]["float32"] == lm["trainable"] > 0
    loss = report["loss"]
    assert len(loss["curve"]) == 4 and loss["last"] < loss["first"]
    assert report["generations"][0]["step"] == 4 and len(report["generations"][0]["answers"]) == 2
    # The demo's printout: group table, loss summary, where things are.
    for text in (
        "as loaded",
        "after the guard",
        "Loss: first",
        "Precision report:",
        "Adapter:",
        "W&B run (offline",
    ):
        assert text in res.stdout, res.stdout[-2000:]
    run_dir = Path(report["wandb_dir"])
    assert run_dir.parent == out / "wandb" and list(run_dir.glob("run-*.wandb"))
    reload_and_compare("llava", out, report)


def test_report_to_wandb_without_a_login_runs_offline_without_a_traceback(tmp_path: Path) -> None:
    """The README's override line, copied by someone with no `wandb login`: one line saying
    the run logs offline and how to sync it, then the run; no UsageError traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        HOME=str(tmp_path),
        NETRC=str(tmp_path / "no-netrc"),
        HF_HUB_OFFLINE="1",
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "lora_llava.py"),
        "--config",
        str(ROOT / "recipes/configs/llava/tiny.yaml"),
        "--output_dir",
        str(out),
        *FEW_STEPS,
        "--report_to",
        "wandb",
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "UsageError" not in res.stderr
    assert res.stdout.count("hf-precision: W&B has no API key here") == 1
    assert "`wandb sync <run folder>`" in res.stdout
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))


def _demo_claims() -> tuple[int, float, int]:
    """What the README's "Try it" says the demo does: its steps, its held-out accuracy floor
    and how many pictures it is measured on."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Try it\n", 1)[1].split("\n## ", 1)[0]
    steps = re.search(r"for (\d+) steps", section)
    floor = re.search(r"at least (\d+)% exact on (\d+) held-out pictures", section)
    assert steps and floor, section
    return int(steps.group(1)), int(floor.group(1)) / 100, int(floor.group(2))


@pytest.mark.slow
@pytest.mark.parametrize(
    "rounding",
    [
        # the demo as `make demo` runs it: bf16 language model, bf16 autocast
        [],
        # other kernels' rounding, at the far end: the same learning in float32 throughout
        ["--dtype", "float32", "--bf16", "false"],
    ],
    ids=["bf16", "fp32-kernels"],
)
def test_llava_demo_config_learns_the_task(tmp_path: Path, rounding: list[str]) -> None:
    """`make demo`'s config, unshortened, with its fixed seed: the README's accuracy on
    held-out pictures, whatever the CPU's bf16 matmul rounds (the fp32 run stands in for a
    kernel that rounds otherwise, e.g. AMX against AVX-512)."""
    steps, floor, held_out = _demo_claims()
    config = yaml.safe_load((ROOT / "recipes/configs/llava/tiny.yaml").read_text())
    assert config["max_steps"] == steps and config["num_generate"] == held_out
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    out = tmp_path / "demo"
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "lora_llava.py"),
            "--config",
            str(ROOT / "recipes/configs/llava/tiny.yaml"),
            "--output_dir",
            str(out),
            *rounding,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "precision_report.json").read_text())
    final = report["generations"][-1]
    assert final["step"] == steps and len(final["answers"]) == held_out
    assert report["accuracy"] == final["accuracy"] >= floor, report["answers_table"]
    assert not any(a["prediction"] == a["answer"] for a in report["answers_before"])
    assert f"Held-out answers (exact match): before training 0/{held_out} = 0%, after {steps} " in (
        res.stdout
    )
    if not rounding:
        assert report["policy"]["name"] == "bf16"
        # the split the README describes, and the console line it quotes
        before = report["dtype_map_before"]["groups"]
        assert (
            set(before["vision_encoder"]["numel"])
            == set(before["projector"]["numel"])
            == {"float32"}
        )
        assert set(before["language_model"]["numel"]) >= {"bfloat16"}
        quoted = (ROOT / "README.md").read_text().split("```text\n", 1)[1].split(" (rotary", 1)[0]
        assert quoted in res.stderr, res.stderr[-3000:]
        assert "inferred from TrainingArguments(bf16=True); report: " in res.stderr


def test_minicpmv_bf16_fails_without_the_guard_and_trains_with_it(tmp_path: Path) -> None:
    config = "recipes/configs/minicpmv/tiny.yaml"
    bad = run_recipe("minicpmv", config, tmp_path / "bad", "--no_guard")
    assert bad.returncode != 0
    assert RESAMPLER_ERROR in bad.stderr, bad.stderr[-3000:]
    tail = bad.stderr[bad.stderr.index("Traceback") :]
    assert "generate_answers" in tail and "multi_head_attention_forward" in tail
    assert not (tmp_path / "bad" / "adapter").exists()

    out = tmp_path / "good"
    good = run_recipe("minicpmv", config, out)
    assert good.returncode == 0, good.stderr[-3000:]
    assert RESAMPLER_ERROR not in good.stderr
    report = json.loads((out / "precision_report.json").read_text())
    assert report["layout"] == "remote" and report["policy"]["name"] == "bf16"
    assert "leaf=" in report["guard_hooks"] and report["loss"]["last"] < report["loss"]["first"]
    assert report["generations"] and (out / "adapter" / "adapter_model.safetensors").is_file()
    reload_and_compare("minicpmv", out, report)
