"""``hf-precision run`` and ``HF_PRECISION_GUARD``: the guard on every Trainer of a process tree.

In-process tests patch the real ``transformers.Trainer`` as the import hook does (and undo it);
the subprocess tests run a script that knows nothing of hf-precision
(``tests/integrations/launched_trainer.py``) under the real launcher, torchrun and TRL's CLI.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Trainer

from hf_precision import PrecisionError, PrecisionGuardCallback
from hf_precision.integrations import launch_config, launcher
from hf_precision.integrations.launch_cli import BOOT_DIR, PTH_NAME, command_env, install_hook
from hf_precision.integrations.launch_config import LaunchConfig, tool_name
from hf_precision.tiny import tiny_batch, tiny_llava
from hf_precision.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "launched_trainer.py"
GUARD_LINE = "hf-precision: precision guard on for"
ORIGINAL_SIGNATURE = inspect.signature(Trainer.__init__)


def _guards(trainer: Any) -> list[Any]:
    return [c for c in trainer.callback_handler.callbacks if isinstance(c, PrecisionGuardCallback)]


def _split_llava() -> Any:
    model = tiny_llava(seed=0)
    model.model.vision_tower.to(torch.float16).requires_grad_(False)
    return model


# ----------------------------------------------------------------------------- in one process
def test_every_trainer_gets_one_guard_before_init_end(launched, make_trainer, capsys):
    model = _split_llava()
    mine: list[Any] = []
    trainer = make_trainer(model, tiny_batch(model), callbacks=mine)
    [cb] = _guards(trainer)
    assert getattr(cb, launch_config.LAUNCHED_ATTR) is True
    assert mine == []  # the caller's list is not mutated
    # added before the original __init__: on_init_end ran, the inferred policy cast the tower
    assert cb.events[0][0] == "on_init_end"
    assert cb.policy.name == "fp32"
    assert {p.dtype for p in model.model.vision_tower.parameters()} == {torch.float32}
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith(GUARD_LINE)]
    assert len(lines) == 1, lines
    assert "policy fp32 (frozen float32" in lines[0]
    assert str(Path(trainer.args.output_dir).resolve() / "precision") in lines[0]
    trainer.train()
    assert (Path(trainer.args.output_dir) / "precision" / "000000-on_init_end.json").is_file()


def test_the_launcher_binds_its_trainer_without_frames(launched, make_trainer, monkeypatch):
    """The wrapped ``Trainer.__init__`` hands the Trainer to its callback (``bind_trainer``):
    the callback finds it with no frame holding it (frames stay the fallback of hand-added
    callbacks)."""
    from hf_precision.frontends import callback as callback_module

    model = _split_llava()
    trainer = make_trainer(model, tiny_batch(model))
    [cb] = _guards(trainer)
    assert cb._trainer() is trainer
    monkeypatch.setattr(callback_module.sys, "_getframe", lambda depth=0: None)
    found, _ = callback_module.find_trainer(cb, cb._trainer())
    assert found is trainer
    assert callback_module.find_trainer(PrecisionGuardCallback(), None)[0] is None


def test_trainer_signature_is_kept(launched):
    assert inspect.signature(Trainer.__init__) == ORIGINAL_SIGNATURE
    assert "processing_class" in inspect.signature(Trainer.__init__).parameters
    assert Trainer.__init__.__wrapped__ is not Trainer.__init__  # functools.wraps


@pytest.mark.parametrize("given", ["instance", "class"])
def test_a_trainer_that_has_a_guard_is_not_guarded_twice(launched, make_trainer, given):
    model = _split_llava()
    mine = PrecisionGuardCallback("fp32", mode="audit") if given == "instance" else None
    trainer = make_trainer(
        model, tiny_batch(model), callbacks=[mine if mine is not None else PrecisionGuardCallback]
    )
    [cb] = _guards(trainer)
    assert not getattr(cb, launch_config.LAUNCHED_ATTR, False)
    if mine is not None:
        assert cb is mine


def test_a_subclass_calling_super_init_gets_one_guard(launched, tiny_args, list_dataset):
    seen: list[int] = []

    class Outer(Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen.append(len(kwargs.get("callbacks") or []))
            super().__init__(*args, **kwargs)

    class Inner(Outer):
        def __init__(self, model: Any, **kwargs: Any) -> None:
            super().__init__(model=model, **kwargs)

    model = _split_llava()
    trainer = Inner(model, args=tiny_args(), train_dataset=list_dataset(tiny_batch(model)))
    assert len(_guards(trainer)) == 1 and seen == [0]
    assert inspect.signature(Inner.__init__) != ORIGINAL_SIGNATURE  # theirs, untouched


def test_a_guard_added_after_init_replaces_the_launchers(launched, make_trainer):
    """A subclass (or the user) that calls ``add_callback(PrecisionGuardCallback(...))`` after
    ``__init__``: theirs stays, the launcher's goes with its hooks."""
    model = _split_llava()
    trainer = make_trainer(model, tiny_batch(model))
    [launched_cb] = _guards(trainer)
    assert launched_cb.handle is not None and launched_cb.handle.count > 0
    theirs = PrecisionGuardCallback("fp32", mode="audit")
    trainer.add_callback(theirs)
    assert _guards(trainer) == [theirs]
    from hf_precision.engine.hooks import guard_targets

    assert guard_targets(model) == {}


@pytest.mark.parametrize("value", ["0", "off", "False", ""])
def test_the_off_switch(launched, make_trainer, value):
    launched.setenv("HF_PRECISION_GUARD", value)
    model = _split_llava()
    trainer = make_trainer(model, tiny_batch(model))
    assert _guards(trainer) == []
    assert {p.dtype for p in model.model.vision_tower.parameters()} == {torch.float16}


def test_preset_mode_keep_fp32_and_report_dir_from_the_environment(
    launched, make_trainer, tmp_path
):
    launched.setenv("HF_PRECISION_GUARD", "fp32")
    launched.setenv("HF_PRECISION_MODE", "audit")
    launched.setenv("HF_PRECISION_KEEP_FP32", r'["re:.*vision_tower\\..*norm.*"]')
    launched.setenv("HF_PRECISION_REPORT_DIR", str(tmp_path / "reports"))
    model = _split_llava()
    trainer = make_trainer(model, tiny_batch(model))
    [cb] = _guards(trainer)
    assert cb.policy.name == "fp32" and cb.policy.mode == "audit"
    assert r"re:.*vision_tower\..*norm.*" in cb.policy.keep_fp32
    # audit: nothing cast
    assert {p.dtype for p in model.model.vision_tower.parameters()} == {torch.float16}
    assert (tmp_path / "reports" / "000000-on_init_end.json").is_file()
    assert not (Path(trainer.args.output_dir) / "precision").exists()


@pytest.mark.parametrize("form", ["json", "file"])
def test_a_policy_json_string_or_file(launched, make_trainer, tmp_path, form):
    from hf_precision import PrecisionPolicy

    policy = PrecisionPolicy.from_preset("fp32", group_dtypes={"vision_encoder": "fp16"})
    value = policy.to_json()
    if form == "file":
        (tmp_path / "policy.json").write_text(value)
        value = str(tmp_path / "policy.json")
    launched.setenv("HF_PRECISION_GUARD", value)
    model = _split_llava()
    [cb] = _guards(make_trainer(model, tiny_batch(model)))
    assert cb.policy == policy
    assert {p.dtype for p in model.model.vision_tower.parameters()} == {torch.float16}
    assert {p.dtype for p in model.model.language_model.parameters()} == {torch.float32}


def test_keep_fp32_with_the_inferred_policy(launched, make_trainer):
    """``auto`` + ``--keep-fp32``: the policy inferred from the Trainer, plus the patterns."""
    launched.setenv("HF_PRECISION_KEEP_FP32", "multi_modal_projector")
    model = tiny_llava(seed=0).to(torch.float16)
    model.requires_grad_(False)
    model.model.multi_modal_projector.float()
    trainer = make_trainer(model, tiny_batch(model))
    [cb] = _guards(trainer)
    assert isinstance(cb, PrecisionGuardCallback)
    assert cb.policy.name == "fp16-true" and "multi_modal_projector" in cb.policy.keep_fp32
    assert cb.extra_keep_fp32 == ("multi_modal_projector",)  # a constructor parameter
    assert {p.dtype for p in model.model.multi_modal_projector.parameters()} == {torch.float32}
    assert {p.dtype for p in model.model.language_model.parameters()} == {torch.float16}


def test_several_trainers_checkpoints_and_resume(launched, tiny_args, tmp_path, list_dataset):
    """Several Trainers in one process each get their own guard (each infers its own policy);
    checkpoints are written and a resumed Trainer is guarded again, its reports beside the
    first run's."""
    out = tmp_path / "run"
    model = _split_llava()
    data = list_dataset(tiny_batch(model), repeat=2)
    first = Trainer(
        model=model,
        args=tiny_args(output_dir=str(out), save_strategy="steps", save_steps=1, max_steps=2),
        train_dataset=data,
    )
    first.train()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "checkpoint-2", "precision"]
    assert not (out / "checkpoint-2" / "precision").exists()

    other = Trainer(
        model=tiny_llava(seed=1).to(torch.float16), args=tiny_args(), train_dataset=data
    )
    [a], [b] = _guards(first), _guards(other)
    assert a is not b and (a.policy.name, b.policy.name) == ("fp32", "fp16-true")

    resumed = Trainer(
        model=_split_llava(),
        args=tiny_args(output_dir=str(out), save_strategy="steps", save_steps=1, max_steps=3),
        train_dataset=data,
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    [c] = _guards(resumed)
    assert [e for e, _ in c.events][:2] == ["on_init_end", "on_train_begin"]
    assert {p.dtype for p in resumed.model.parameters()} == {torch.float32}
    written = sorted(p.name for p in (out / "precision").glob("*.json"))
    assert "000002-on_train_end.json" in written and "000003-on_train_end.json" in written


# ----------------------------------------------------------------------------- configuration
def test_config_round_trips_through_the_environment():
    config = LaunchConfig(
        policy="bf16", mode="audit", keep_fp32=("a,b", "c"), report_dir="/r", tool="trl"
    )
    assert LaunchConfig.from_env(config.to_env()) == config
    assert LaunchConfig.from_env({"HF_PRECISION_KEEP_FP32": "x, y"}).keep_fp32 == ("x", "y")
    assert LaunchConfig.from_env({}).policy == "auto"


@pytest.mark.parametrize(
    ("argv", "tool"),
    [
        (["/v/bin/llamafactory-cli", "train", "c.yaml"], "llamafactory-cli"),
        (["swift", "sft", "--model", "m"], "swift"),
        (["trl", "sft"], "trl"),
        (["axolotl", "train", "c.yml"], "axolotl"),
        (["torchrun", "--nproc_per_node", "2", "src/train.py", "--x"], "train.py"),
        (["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "t.py"], "t.py"),
        (
            ["accelerate", "launch", "--num_processes", "2", "-m", "axolotl.cli.train"],
            "axolotl.cli.train",
        ),
        (["deepspeed", "--num_gpus", "2", "train.py"], "train.py"),
        (["python3", "-c", "pass"], "python3 -c"),
    ],
)
def test_tool_name(argv, tool):
    assert tool_name(argv) == tool


def test_command_env(tmp_path):
    policy = tmp_path / "p.json"
    from hf_precision import PrecisionPolicy

    policy.write_text(PrecisionPolicy.from_preset("bf16").to_json())
    env = command_env(
        ["trl", "sft"],
        policy=str(policy),
        keep_fp32=["norm", "a,b"],
        report_dir="rel",
        environ={"PYTHONPATH": "/x", "HF_PRECISION_MODE": "raise"},
    )
    assert env["PYTHONPATH"] == f"{BOOT_DIR}{os.pathsep}/x"
    assert env["HF_PRECISION_GUARD"] == str(policy.resolve())
    assert "HF_PRECISION_MODE" not in env  # a stale variable of an outer run does not leak
    assert env["HF_PRECISION_TOOL"] == "trl" and env["HF_PRECISION_VIA"] == "hf-precision run"
    assert json.loads(env["HF_PRECISION_KEEP_FP32"]) == ["norm", "a", "b"]
    assert env["HF_PRECISION_REPORT_DIR"] == str(Path("rel").resolve())


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run"], "no command to run. Fix: hf-precision run"),
        (["run", "--policy", "bf61", "--", "nothing"], "Did you mean 'bf16'?"),
        (["run", "--policy", "{bad", "--", "nothing"], "not valid JSON"),
        (["run", "--mode", "fixx", "--", "nothing"], "unknown mode 'fixx'. Did you mean 'fix'?"),
        (["run", "--keep-fp32", "re:(", "--", "nothing"], "bad regex"),
        (["run", "--", "no-such-program-xyz"], "command 'no-such-program-xyz' not found"),
        (["install-hook", "--target", "/no/such/dir"], "no such folder"),
    ],
)
def test_argument_errors_say_what_to_do(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-precision: error: hf-precision") and says in err, err


def test_run_execs_the_command_with_the_environment(monkeypatch, tmp_path):
    """``hf-precision run`` replaces itself with COMMAND (``os.execve``, recorded here: the real
    one would replace pytest); its own flags end where COMMAND starts."""
    seen: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(launcher.os, "execve", lambda p, a, e: seen.append((p, a, e)))
    monkeypatch.setenv("HF_PRECISION_REPORT_DIR", "/stale")
    argv = ["run", "--mode", "audit", "--keep-fp32", "norm", "--keep-fp32", "re:.*bias"]
    argv += ["--", sys.executable, "-m", "trl", "sft", "--mode", "x", "--policy", "y"]
    assert main(argv) == 0
    [(program, args, env)] = seen
    assert program == sys.executable and args == [
        sys.executable,
        "-m",
        "trl",
        "sft",
        "--mode",
        "x",
        "--policy",
        "y",
    ]
    assert env["HF_PRECISION_GUARD"] == "auto" and env["HF_PRECISION_MODE"] == "audit"
    assert json.loads(env["HF_PRECISION_KEEP_FP32"]) == ["norm", "re:.*bias"]
    assert "HF_PRECISION_REPORT_DIR" not in env and env["HF_PRECISION_TOOL"] == "trl"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(BOOT_DIR)
    assert main(["run", "true"]) == 0 and seen[-1][1] == ["true"]  # no "--" needed


def test_a_bad_variable_fails_the_trainer_loudly(launched, make_trainer):
    launched.setenv("HF_PRECISION_GUARD", "bf61")
    model = _split_llava()
    with pytest.raises(PrecisionError, match=r"HF_PRECISION_GUARD='bf61'.*Did you mean 'bf16'"):
        make_trainer(model, tiny_batch(model))


def test_install_hook_writes_and_removes_the_line(tmp_path):
    path = install_hook(tmp_path)
    assert path == tmp_path / PTH_NAME
    line = path.read_text()
    assert line.startswith("import ") and line.count("\n") == 1  # one line, run by site.py
    # the start-up files cannot import autostart's OFF_VALUES: they spell the same tuple
    from hf_precision.integrations import autostart

    assert repr(autostart.OFF_VALUES) in line
    assert (
        repr(autostart.OFF_VALUES).replace("'", '"') in (BOOT_DIR / "sitecustomize.py").read_text()
    )
    assert main(["install-hook", "--target", str(tmp_path), "--remove"]) == 0
    assert not path.exists()


# ----------------------------------------------------------------------------- real processes
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in launch_config.ENV_VARS}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _guard_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [x for x in proc.stderr.splitlines() if x.startswith(GUARD_LINE)]


def _site_python(site_dir: Path, script: str) -> list[str]:
    """A Python that processes ``site_dir``'s ``.pth`` files at start, as site-packages'."""
    return [sys.executable, "-c", f"import site; site.addsitedir({str(site_dir)!r})\n{script}"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["hf-precision run", "HF_PRECISION_GUARD"])
def test_a_script_that_knows_nothing_is_guarded(how, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    if how == "hf-precision run":
        cmd = [sys.executable, "-m", "hf_precision.tools.cli", "run", "--"]
        proc = _run([*cmd, sys.executable, str(SCRIPT), str(out)], _env())
    else:  # the variable alone: the start-up line install-hook writes (a wheel ships it)
        install_hook(tmp_path)
        run = f"import runpy, sys; sys.argv = [{str(SCRIPT)!r}, {str(out)!r}]\n"
        run += f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
        proc = _run(_site_python(tmp_path, run), _env(HF_PRECISION_GUARD="auto"))
    [line] = _guard_lines(proc)
    assert f"reports in {out / 'precision'}" in line and "policy fp32" in line
    assert ("via hf-precision run" in line) == (how == "hf-precision run")
    result = json.loads((out / "rank0.json").read_text())
    assert result["callbacks"].count("PrecisionGuardCallback") == 1
    assert result["events"][0][0] == "on_init_end" and result["policy"] == ["fp32"]
    assert result["groups"]["vision_encoder"] == ["float32"]  # the fp16 tower cast by the guard
    assert result["tool"] == "launched_trainer.py"
    assert (out / "precision" / "000000-on_init_end.json").is_file()
    assert (out / "precision" / "000002-on_train_end.json").is_file()


@pytest.mark.slow
def test_run_in_audit_mode_says_its_findings_on_the_console(tmp_path):
    """``hf-precision run --mode audit``: nothing cast, and the findings (count, dtypes, first
    names, the report's path) on the console, not only in the report folder."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "hf_precision.tools.cli", "run", "--mode", "audit", "--"]
    proc = subprocess.run(
        [*cmd, sys.executable, str(SCRIPT), str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )  # the run itself may then fail on the dtypes it was not asked to fix: not checked here
    lines = [x for x in proc.stderr.splitlines() if "hf-precision: audit found" in x]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert "nothing cast (mode 'audit')" in lines[0] and "float16 → float32" in lines[0]
    assert lines[0].endswith(f"report: {out / 'precision'}/")


_OURS = ("hf_precision", "_hf_precision_autostart", "torch", "transformers")
_PROBE = f"import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {_OURS}))"


def test_nothing_is_imported_at_start_without_the_variable(tmp_path):
    install_hook(tmp_path)
    env = _env(PYTHONPATH=os.pathsep.join([str(BOOT_DIR), str(ROOT)]))
    proc = _run(_site_python(tmp_path, _PROBE), env)
    assert proc.stdout.strip() == "[]"
    # -X importtime: the start of an interpreter under `hf-precision run`'s PYTHONPATH
    proc = _run([sys.executable, "-X", "importtime", "-c", "pass"], env)
    imported = [x.split("|")[-1].strip() for x in proc.stderr.splitlines() if "|" in x]
    assert "sitecustomize" in imported  # the boot folder's
    assert not [m for m in imported if m.split(".")[0] in _OURS]
    # with the variable: only the standard-library hook, nothing of torch or the package
    proc = _run(_site_python(tmp_path, _PROBE), {**env, "HF_PRECISION_GUARD": "auto"})
    assert proc.stdout.strip() == "['_hf_precision_autostart']"
    proc = _run([sys.executable, "-c", _PROBE], {**env, "HF_PRECISION_GUARD": "auto"})
    assert proc.stdout.strip() == "['_hf_precision_autostart']"
    for off in ("0", "off"):  # the off switch costs as little as an unset variable
        assert (
            _run(_site_python(tmp_path, _PROBE), {**env, "HF_PRECISION_GUARD": off}).stdout.strip()
            == "[]"
        )
        assert (
            _run([sys.executable, "-c", _PROBE], {**env, "HF_PRECISION_GUARD": off}).stdout.strip()
            == "[]"
        )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_torchrun_rank_is_guarded_and_rank0_says_so(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [sys.executable, "-m", "hf_precision.tools.cli", "run", "--", *torchrun]
    proc = _run([*cmd, "--nproc_per_node=2", str(SCRIPT), str(out)], _env(), timeout=900)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["world_size"] == 2 and r["callbacks"].count("PrecisionGuardCallback") == 1
        assert r["events"][0][0] == "on_init_end" and r["groups"]["vision_encoder"] == ["float32"]
    [line] = _guard_lines(proc)  # rank 0 only
    assert "launched by launched_trainer.py" in line
    assert (out / "precision" / "000002-on_train_end.json").is_file()


@pytest.mark.slow
def test_trls_cli_is_guarded(tmp_path):
    """``hf-precision run -- trl sft ...``: TRL's own CLI (its SFTConfig defaults to bf16=True)
    on a tiny LLaVA saved with its processor and chat template, a local parquet dataset with
    generated images, LoRA, three steps. ``trl sft`` runs its script through ``accelerate
    launch`` (a child process): the guard reaches it through the environment."""
    from datasets import Dataset

    from hf_precision.tiny import tiny_llava_processor
    from hf_precision.tiny.data import shape_image

    trl_cli = Path(sys.executable).parent / "trl"
    if not trl_cli.is_file():
        pytest.skip("TRL's CLI is not installed in this environment")
    tiny_llava(seed=0).save_pretrained(tmp_path / "model")
    tiny_llava_processor(str(tmp_path / "model"))
    pairs = [("circle", "red"), ("square", "blue"), ("triangle", "green"), ("circle", "yellow")]
    question = [{"type": "image"}, {"type": "text", "text": "what is in the image ?"}]
    rows = [
        {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": [{"type": "text", "text": f"a {c} {s}"}]},
            ],
            "images": [shape_image(s, c)],
        }
        for s, c in pairs * 2
    ]
    (tmp_path / "data").mkdir()
    Dataset.from_list(rows).to_parquet(str(tmp_path / "data" / "train.parquet"))
    out = tmp_path / "out"
    args = [
        "--model_name_or_path",
        str(tmp_path / "model"),
        "--dataset_name",
        str(tmp_path / "data"),
    ]
    args += ["--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "2"]
    args += ["--use_cpu", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
    args += ["--use_peft", "--lora_target_modules", "q_proj", "v_proj"]
    env = _env(PATH=f"{trl_cli.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env["HF_DATASETS_OFFLINE"] = "1"
    cmd = [sys.executable, "-m", "hf_precision.tools.cli", "run", "--"]
    proc = _run([*cmd, str(trl_cli), "sft", *args], env, timeout=900)
    [line] = _guard_lines(proc)
    assert line.startswith(f"{GUARD_LINE} SFTTrainer (launched by trl, via hf-precision run)")
    assert "policy bf16 (frozen bfloat16, trainable float32" in line  # SFTConfig's bf16=True
    written = sorted(p.name for p in (out / "precision").iterdir())
    assert "000000-on_init_end.json" in written and "000003-on_train_end.json" in written
    end = json.loads((out / "precision" / "000003-on_train_end.json").read_text())
    assert end["policy"]["name"] == "bf16"
    assert (out / "adapter_model.safetensors").is_file()
