"""``hf-precision run -- COMMAND`` and ``hf-precision install-hook``: the subcommands, the
environment a command runs in (:func:`command_env`: the variables checked, the ``sitecustomize``
folder first on ``PYTHONPATH``), the ``exec`` of the command, and the start-up line a wheel
install ships (:func:`install_hook`). How the guard then reaches each Trainer and Accelerator is
in :mod:`hf_precision.integrations.launcher` and :mod:`hf_precision.integrations.accelerate_hook`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import PrecisionError
from .launch_config import (
    BLAME_MODES,
    ENV_BLAME,
    ENV_GUARD,
    ENV_TRACE,
    ENV_VARS,
    LaunchConfig,
    parse_keep_fp32,
    tool_name,
)

#: the ``sitecustomize`` folder ``hf-precision run`` puts first on ``PYTHONPATH``
BOOT_DIR = Path(__file__).resolve().parent / "_boot"
#: the start-up line a wheel install puts in site-packages (``hf-precision install-hook``)
PTH_NAME = "hf_precision_guard.pth"
PTH_SOURCE = Path(__file__).resolve().parent / PTH_NAME

_RUN_EXAMPLES = f"""examples:
  hf-precision run -- llamafactory-cli train cfg.yaml
  hf-precision run --policy bf16 -- trl sft --model_name_or_path ./tiny ...
  hf-precision run --mode audit --report-dir ./precision -- torchrun --nproc_per_node 2 train.py
  hf-precision run -- accelerate launch train_text_to_image_lora.py --mixed_precision bf16 ...
  {ENV_GUARD}=auto llamafactory-cli train cfg.yaml      # without the wrapper (see below)

Every transformers Trainer (and subclass) built in any Python process COMMAND starts gets a
PrecisionGuardCallback; every other accelerate Accelerator (diffusers' training scripts, custom
loops) prepares its models through a PrecisionGuardPlugin, and the pipelines and models such a
script loads with from_pretrained are guarded as loaded; torchrun / accelerate launch /
deepspeed workers too. The variable form
needs the start-up line a wheel install ships (an editable install: run
'hf-precision install-hook' once). Off: unset {ENV_GUARD} (or set it to 0)."""


def add_cli(sub: Any) -> None:
    """The ``run`` and ``install-hook`` subcommands of ``hf-precision``."""
    s = sub.add_parser(
        "run",
        help="run a command with the guard on every Trainer it builds",
        description="Run COMMAND so that every transformers Trainer built in any of its Python "
        "processes gets a PrecisionGuardCallback.",
        epilog=_RUN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "--policy",
        default="auto",
        help="auto (inferred from each Trainer's arguments, the default), a preset name, a "
        "policy JSON string or a policy JSON file",
    )
    s.add_argument("--mode", default=None, help="fix / audit / raise (default: the policy's)")
    s.add_argument(
        "--keep-fp32",
        action="append",
        default=[],
        metavar="PATTERN",
        help="a weight kept in float32: exact name, path prefix, path component or "
        "re:<regex>, as in PrecisionPolicy(keep_fp32=...) (repeatable)",
    )
    s.add_argument(
        "--report-dir", default=None, help="where reports go (default <output_dir>/precision)"
    )
    s.add_argument(
        "--blame",
        default="auto",
        choices=BLAME_MODES,
        help="name the first module whose output turns inf/NaN: auto (default: armed by a "
        f"non-finite logged loss or gradient norm), always, off ({ENV_BLAME})",
    )
    s.add_argument(
        "--trace",
        action="store_true",
        help=f"record the first training step's activation dtypes, module by module ({ENV_TRACE})",
    )
    s.add_argument("cmd", nargs="...", metavar="-- COMMAND [ARGS...]")
    h = sub.add_parser(
        "install-hook",
        help=f"install the start-up line that makes {ENV_GUARD} work (where no install put it)",
        description=f"Write {PTH_NAME} into site-packages (a wheel or editable install ships "
        "it): Python "
        f"then runs its one line at every start, which does nothing unless {ENV_GUARD} is set.",
    )
    h.add_argument("--target", default=None, help="site-packages folder (default: this Python's)")
    h.add_argument("--remove", action="store_true", help="remove it instead")


def run_cli(args: Any) -> int:
    """``hf-precision run`` / ``install-hook``: dispatched here from
    :mod:`hf_precision.tools.cli`."""
    if args.command == "install-hook":
        path = install_hook(args.target, remove=args.remove)
        print(f"{'removed' if args.remove else 'installed'}: {path}")
        return 0
    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    return run_command(
        cmd,
        policy=args.policy,
        mode=args.mode,
        keep_fp32=args.keep_fp32,
        report_dir=args.report_dir,
        blame=args.blame,
        trace=args.trace,
    )


def command_env(
    cmd: Sequence[str],
    *,
    policy: str = "auto",
    mode: str | None = None,
    keep_fp32: Sequence[str] = (),
    report_dir: str | None = None,
    environ: Mapping[str, str] | None = None,
    blame: str = "auto",
    trace: bool = False,
) -> dict[str, str]:
    """The environment ``hf-precision run`` gives ``cmd``: the variables, checked, and the boot
    folder first on ``PYTHONPATH``."""
    call = "hf-precision run"
    if not cmd:
        raise PrecisionError(
            f"{call}: no command to run. Fix: hf-precision run [--policy auto] -- "
            "llamafactory-cli train cfg.yaml"
        )
    if policy and policy.lower() not in ("auto",) and Path(policy).expanduser().is_file():
        policy = str(Path(policy).expanduser().resolve())  # the workers may change directory
    keep: list[str] = []
    for value in keep_fp32:
        keep.extend(parse_keep_fp32(value, where="--keep-fp32"))
    config = LaunchConfig(
        policy=policy or "auto",
        mode=mode.lower() if mode else None,
        keep_fp32=tuple(keep),
        report_dir=str(Path(report_dir).expanduser().resolve()) if report_dir else None,
        tool=tool_name(cmd),
        via=call,
        blame=blame,
        trace=trace,
    )
    config.check(call=f"{call} --policy {config.policy!r}" + (f" --mode {mode}" if mode else ""))
    env = dict(os.environ if environ is None else environ)
    for var in ENV_VARS:
        env.pop(var, None)
    env.update(config.to_env())
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOT_DIR), *(p for p in paths if p != str(BOOT_DIR))])
    return env


def run_command(cmd: Sequence[str], **options: Any) -> int:
    """Replace this process with ``cmd`` under the guard's environment (``os.execvpe``: signals,
    exit code and terminal go straight to the command)."""
    env = command_env(cmd, **options)
    program = shutil.which(cmd[0], path=env.get("PATH"))
    if program is None:
        raise PrecisionError(
            f"hf-precision run: command {cmd[0]!r} not found on PATH. Fix: install it or give "
            "its full path, e.g. hf-precision run -- python train.py"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(program, list(cmd), env)
    return 0  # pragma: no cover


# ----------------------------------------------------------------------- install-hook
def install_hook(target: str | os.PathLike[str] | None = None, *, remove: bool = False) -> Path:
    """Write (or ``remove``) ``hf_precision_guard.pth`` in ``target`` (default: this Python's
    site-packages), the start-up line that makes ``HF_PRECISION_GUARD`` work without
    ``hf-precision run``; a wheel and an editable install (``pip install -e``) ship it, a
    checkout on ``PYTHONPATH`` has none. Returns the file's path."""
    folder = Path(target) if target is not None else Path(sysconfig.get_paths()["purelib"])
    path = folder / PTH_NAME
    if remove:
        path.unlink(missing_ok=True)
        return path
    if not folder.is_dir():
        raise PrecisionError(
            f"hf-precision install-hook --target {folder}: no such folder. Fix: give a "
            "site-packages folder, or no --target for this Python's."
        )
    path.write_text(PTH_SOURCE.read_text())
    return path


__all__ = [
    "BOOT_DIR",
    "PTH_NAME",
    "PTH_SOURCE",
    "add_cli",
    "command_env",
    "install_hook",
    "run_cli",
    "run_command",
]
