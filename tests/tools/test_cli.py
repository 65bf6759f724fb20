"""The ``hf-precision`` command: audit and doctor on checkpoints, config files and model types
(what doctor diagnoses: tests/tools/test_doctor.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_precision.tiny import tiny_llava
from hf_precision.tools.cli import main


def _command() -> list[str]:
    exe = Path(sys.executable).parent / "hf-precision"  # the installed entry point
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "hf_precision.tools.cli"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run(
        [*_command(), *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny LLaVA saved with save_pretrained in fp32 and one in bf16."""
    root = tmp_path_factory.mktemp("ckpt")
    tiny_llava().save_pretrained(root / "fp32")
    tiny_llava(torch.bfloat16).save_pretrained(root / "bf16")
    return {"fp32": root / "fp32", "bf16": root / "bf16"}


# ---------------------------------------------------------------------------- subprocess
def test_audit_checkpoint_folder_violates_bf16(checkpoints: dict[str, Path]) -> None:
    proc = _run(
        "audit", str(checkpoints["fp32"]), "--policy", "bf16", "--trainable", "none", "--json"
    )
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["built"] == "meta" and data["model_type"] == "llava" and not data["ok"]
    assert data["changes_by_group"]["vision_encoder"] == {"float32->bfloat16": 39}
    assert {g["group"] for g in data["groups"]} >= {"vision_encoder", "language_model"}
    assert data["violations"] == len(data["changes"]) > 0


def test_audit_config_json_alone(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    shutil.copy(checkpoints["bf16"] / "config.json", config)  # no weights next to it
    proc = _run("audit", str(config), "--policy", "bf16", "--trainable", "none", "--plain")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: the model matches policy bf16" in proc.stdout
    assert "language_model" in proc.stdout and "built on the meta device" in proc.stdout


def test_audit_model_type_full_size_on_meta() -> None:
    proc = _run("audit", "llava", "--dtype", "bf16", "--trainable", "none")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6,607,343,616" in proc.stdout  # the default LLaVA config: a 7B language model
    assert "OK: the model matches policy bf16" in proc.stdout


def test_audit_model_type_violation(capsys: pytest.CaptureFixture[str]) -> None:
    # an explicit fp32 load against the bf16 policy (a bare type with --dtype auto audits in
    # the policy's dtype when the config declares none: tests/tools/test_cli_checkpoints.py)
    argv = ["audit", "llava", "--policy", "bf16", "--dtype", "fp32", "--trainable", "none"]
    assert main([*argv, "--plain"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATES policy bf16" in out and "language_model float32->bfloat16" in out


def test_doctor_tiny_checkpoint(checkpoints: dict[str, Path]) -> None:
    proc = _run(
        "doctor", str(checkpoints["fp32"]), "--policy", "bf16-true", "--trainable", "all", "--json"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] and set(data["diagnosis"]) == {"train", "generate"}
    assert data["diagnosis"]["train"]["passes"] == {"forward": "ok", "backward": "ok"}
    assert data["diagnosis"]["generate"]["passes"] == {"generate": "ok"}


# ---------------------------------------------------------------------------- in process
@pytest.mark.parametrize("command", ["audit", "doctor"])
def test_help_has_examples(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"hf-precision {command} " in out and "exit codes:" in out
    assert "3  weight files that cannot be read" in out


@pytest.mark.parametrize(
    "argv, allowed",
    [
        (["audit", "llava", "--policy", "bf61"], "unknown preset 'bf61'. Did you mean 'bf16'?"),
        # the names PrecisionPolicy.from_preset refuses, refused alike
        # (tests/rules/policy/test_precision_policy.py)
        (["audit", "llava", "--policy", "bfloat16"], "Did you mean 'bf16' (frozen bf16, trainable"),
        (["doctor", "llava", "--policy", "BF16"], "Did you mean 'bf16'? (preset names are lower"),
        (["audit", "llava", "--policy", "bf16-mixed"], "Did you mean 'bf16' (Lightning's"),
        (["audit", "llava", "--dtype", "bf61"], "choose from 'auto'"),
        (["audit", "lava"], "Did you mean 'llava'"),
        (["audit", "llava", "--trainable", "projecter"], "Did you mean 'projector'"),
        (["audit", "./missing/config.json"], "no such file or folder"),
        (["doctor", "nosuchmodel"], "allowed: "),
        (["doctor", "llava", "--mode", "strict"], "choose from 'fix', 'raise'"),
        (["lint", "llava"], "choose from 'architectures', 'audit', 'doctor'"),
    ],
)
def test_bad_arguments_give_one_line(
    argv: list[str], allowed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hf-precision") and allowed in err, err


def test_audit_weights_and_trainable_groups(
    checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", str(checkpoints["fp32"]), "--weights", "--policy", "fp32"]) == 0
    assert "weights loaded" in capsys.readouterr().out
    code = main(
        [
            "audit",
            str(checkpoints["bf16"]),
            "--weights",
            "--policy",
            "bf16",
            "--trainable",
            "projector",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    # frozen groups are bf16 as the policy wants; the trainable projector must become fp32
    assert code == 1 and data["built"] == "weights"
    assert data["changes_by_group"] == {"projector": {"bfloat16->float32": 4}}
    # the memory line: the projector's bytes double when its bf16 weights go fp32
    memory = data["memory_by_group"]["projector"]
    assert set(data["memory_by_group"]) == {"projector"} and memory["after"] == 2 * memory["before"]


# ---------------------------------------------------------------------------- a fast CLI
def _imported(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``python -X importtime -m hf_precision ARGS``: the run, and every module it imported."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hf_precision", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    names = {
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return proc, names


@pytest.mark.parametrize(
    "args, code, says",
    [
        (["--help"], 0, "{architectures,audit,doctor,run,install-hook}"),
        (["--version"], 0, "hf-precision "),
        (["audit", "--help"], 0, "examples:"),
        (["doctor", "--help"], 0, "--text-len"),
        (["audit"], 2, "the following arguments are required: PATH_OR_MODEL_TYPE"),
        (["audit", "llava", "--dtype", "bf61"], 2, "choose from 'auto'"),
        (["lint"], 2, "invalid choice: 'lint'"),
        # every flag's error (issue 28: --policy/--trainable typos imported torch)
        (["audit", "llava", "--policy", "bf61"], 2, "Did you mean 'bf16'?"),
        (["audit", "llava", "--policy", "bfloat16"], 2, "Did you mean 'bf16' (frozen bf16"),
        (["doctor", "llava", "--policy", "BF16"], 2, "(preset names are lower case)"),
        (["audit", "llava", "--trainable", "projecter"], 2, "Did you mean 'projector'"),
        (["doctor", "llava", "--trainable", "all,visoin"], 2, "unknown group 'visoin'"),
        (["doctor", "llava", "--mode", "strict"], 2, "choose from 'fix', 'raise'"),
        (["doctor", "llava", "--batch", "cooked"], 2, "choose from 'fixed', 'raw'"),
        (["doctor", "llava", "--image-size", "x"], 2, "invalid int value: 'x'"),
        (["doctor", "llava", "--max-params", "1e9"], 2, "invalid int value: '1e9'"),
        (["run", "--policy", "bf61", "--", "python"], 2, "Did you mean 'bf16'?"),
        (["run", "--policy", "{bad", "--", "python"], 2, "the policy is not valid JSON"),
        (["run", "--mode", "strict", "--", "python"], 2, "unknown mode 'strict'"),
        (["run", "--keep-fp32", "re:[", "--", "python"], 2, "bad regex"),
        (["run"], 2, "no command to run"),
    ],
)
def test_help_version_and_argument_errors_import_neither_torch_nor_transformers(
    args: list[str], code: int, says: str
) -> None:
    proc, names = _imported(*args)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert says in proc.stdout + proc.stderr
    assert not {"torch", "transformers"} & names, sorted({"torch", "transformers"} & names)


def test_a_trainable_typo_is_reported_before_the_model_is_built() -> None:
    proc, names = _imported("audit", "llava", "--trainable", "projecter")
    assert proc.returncode == 2 and "Did you mean 'projector'" in proc.stderr
    assert "transformers" not in names  # no config read, no model class imported


def test_python_m_hf_precision_runs_the_command(checkpoints: dict[str, Path]) -> None:
    from hf_precision import __version__

    proc, _ = _imported("--version")
    assert proc.stdout.strip() == f"hf-precision {__version__}"
    proc, names = _imported("audit", str(checkpoints["bf16"]), "--trainable", "none", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["ok"] and "torch" in names


def test_help_lists_match_the_registries(capsys: pytest.CaptureFixture[str]) -> None:
    from hf_precision.base.names import GROUP_NAMES, PRESET_NAMES
    from hf_precision.rules.groups.group_rule import group_names
    from hf_precision.rules.policy.presets import PRESETS

    assert tuple(PRESETS) == PRESET_NAMES
    assert group_names() == GROUP_NAMES


def test_audit_and_doctor_share_their_defaults() -> None:
    from hf_precision.tools.cli import _parser

    audit = vars(_parser().parse_args(["audit", "llava"]))
    doctor = vars(_parser().parse_args(["doctor", "llava"]))
    shared = {"policy", "trainable", "json", "plain"}
    assert {k: audit[k] for k in shared} == {k: doctor[k] for k in shared}
    assert audit["trainable"] == "none"


def test_a_policy_typo_names_the_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "llava", "--policy", "bf61"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown preset 'bf61'. Did you mean 'bf16'?" in err
    assert "fp16-vae32" in err  # the allowed names, registered presets included
