"""``hf-precision run`` / ``install-hook`` (:mod:`hf_precision.integrations.launch_cli`); the
commands run under it are in test_launcher.py and test_diffusers_scripts.py."""

from __future__ import annotations

import os

import pytest

from hf_precision import PrecisionError
from hf_precision.integrations import launch_cli
from hf_precision.integrations.launch_cli import BOOT_DIR, PTH_NAME, command_env, install_hook


def test_the_commands_environment_boot_folder_first_and_old_variables_gone():
    env = command_env(
        ["accelerate", "launch", "train.py"],
        policy="bf16",
        environ={"PYTHONPATH": f"/a{os.pathsep}{BOOT_DIR}", "HF_PRECISION_MODE": "audit"},
    )
    assert env["PYTHONPATH"].split(os.pathsep) == [str(BOOT_DIR), "/a"]
    assert env["HF_PRECISION_GUARD"] == "bf16" and "HF_PRECISION_MODE" not in env
    assert env["HF_PRECISION_TOOL"] == "train.py"
    assert (BOOT_DIR / "sitecustomize.py").is_file()
    with pytest.raises(PrecisionError, match="no command to run. Fix: hf-precision run"):
        command_env([])


def test_install_hook_writes_and_removes_the_start_up_line(tmp_path):
    path = install_hook(tmp_path)
    assert path == tmp_path / PTH_NAME and path.read_text() == launch_cli.PTH_SOURCE.read_text()
    install_hook(tmp_path, remove=True)
    assert not path.exists()
    with pytest.raises(PrecisionError, match="no such folder"):
        install_hook(tmp_path / "missing")
