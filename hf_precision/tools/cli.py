"""``hf-precision``: audit a checkpoint against a precision policy, or run a doctor pass.

Exit codes: 0 the model matches the policy / the doctor pass ran clean; 1 it violates the policy
/ a dtype or device error was diagnosed; 2 bad arguments, or a source that does not exist or whose
config cannot be read; 3 weight files that cannot be read (empty, truncated, corrupt, not
safetensors). 1 is never an input error.

>>> from hf_precision.tools.cli import main
>>> main(["audit", "llava", "--dtype", "bf16", "--json"])  # doctest: +SKIP
0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from ..base.names import GROUP_NAMES, PRESET_NAMES, preset_hint, unknown_groups
from ..errors import PrecisionError
from .checkpoint import DEFAULT_TRAINABLE
from .exits import fail

# What --help says and the argument checks need no engine (torch, the registries): the names
# live in hf_precision.base.names, checked against the registries by tests/tools/test_cli.py.
_DTYPES = ("auto", "fp32", "bf16", "fp16", "float32", "bfloat16", "float16")
_SOURCES = """PATH_OR_MODEL_TYPE is a checkpoint folder (config.json inside, sharded or not), a
config.json file, a Hub id (org/name: its config and safetensors headers, no weights; offline,
HF_HUB_OFFLINE=1, from the local Hugging Face cache only), a PEFT adapter folder
(adapter_config.json: the adapter's dtypes and its base model), a diffusers folder
(model_index.json: the dtypes of each component) or a transformers model type."""
_EXIT_CODES = """exit codes:
  0  the model matches the policy (doctor: the guarded step ran clean)
  1  it violates the policy (doctor: a dtype/device error was diagnosed); nothing else exits 1
  2  bad arguments, or a source that does not exist or whose config cannot be read
  3  weight files that cannot be read: empty, truncated, corrupt, not safetensors (one line
     names the file and what is wrong)"""
_EXAMPLES_AUDIT = f"""examples:
  hf-precision audit ./my-llava-checkpoint --policy bf16
  hf-precision audit Qwen/Qwen2-VL-7B-Instruct --policy bf16-true
  hf-precision audit ./my-llava-checkpoint/config.json --dtype bf16 --json
  hf-precision audit llava --policy fp16 --trainable projector,language_model
  hf-precision audit ./lora-adapter --policy bf16
  hf-precision audit ./sd-pipeline --policy fp16-vae32 --trainable none
  hf-precision audit ./sd-pipeline/unet --policy fp16      # one diffusers component
  hf-precision audit ./ckpt --weights          # read the real weights instead of the meta build

{_SOURCES}
Without --weights the model is built on the meta device from its config: nothing is read but
the config and the safetensors headers (each tensor in the dtype it is stored in), or without
weight files the dtype from_pretrained would load (config dtype, or --dtype). A relative path
that does not exist is a missing folder, never looked up on the Hub (owner/name is a Hub id only
where no folder owner/ is).

{_EXIT_CODES}"""
_EXAMPLES_DOCTOR = f"""examples:
  hf-precision doctor llava --policy bf16
  hf-precision doctor ./my-tiny-checkpoint --policy bf16-true --json
  hf-precision doctor ./my-tiny-bert --policy bf16 --text-len 8
  hf-precision doctor minicpmv --policy bf16-true --batch raw

PATH_OR_MODEL_TYPE is a local checkpoint folder (loaded with its weights, each tensor in the
dtype it is stored in), a config.json (built with random weights, small configs only) or a
model type, built tiny. Vision-language models get a synthetic image+text batch; text-only
models (causal LM, seq2seq, classifiers) a text batch. The doctor enforces the policy (as
PrecisionGuardCallback does at on_init_end), installs the guard in --mode fix (as the
callback runs it; --mode raise: every input it would cast is an error), runs one training
forward+backward (under autocast for mixed presets, as Trainer does; there the guard fixes
instead of raising, and what autocast handled is counted as information, not as a problem)
and a generate() (generative models), and prints the diagnosis.

{_EXIT_CODES}"""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``hf-precision: error: ... (choose from ...)``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _common_options(s: argparse.ArgumentParser) -> None:
    """The options every model command takes, with one set of defaults."""
    s.add_argument("source", metavar="PATH_OR_MODEL_TYPE")
    s.add_argument(
        "--policy",
        default="bf16",
        metavar="POLICY",
        help=f"policy preset ({', '.join(PRESET_NAMES)}), a policy JSON file "
        "(PrecisionPolicy.to_json() writes one) or JSON text (default: bf16)",
    )
    s.add_argument("--json", action="store_true", help="print JSON instead of tables")
    s.add_argument("--plain", action="store_true", help="plain text tables even with rich")
    s.add_argument(
        "--trainable",
        default=DEFAULT_TRAINABLE,
        help=f"comma-separated groups that are trained ({', '.join(GROUP_NAMES)}, or a "
        "registered one), 'other', 'all' or "
        f"'none' (default: {DEFAULT_TRAINABLE}: the checkpoint frozen, as under LoRA)",
    )


def _audit_options(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--dtype",
        default="auto",
        choices=_DTYPES,
        help="dtype the model is loaded in (default: auto = as stored, else the config dtype)",
    )
    s.add_argument(
        "--weights",
        action="store_true",
        help="load the real weights (local checkpoint folders only)",
    )


def _doctor_options(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--batch",
        default="fixed",
        choices=("fixed", "raw"),
        help="fixed: synthetic batch cast per policy (as PrecisionCollator); "
        "raw: fp32 as collators build it",
    )
    s.add_argument(
        "--mode",
        default="fix",
        choices=("fix", "raise"),
        help="guard mode outside autocast (default fix: the guard casts at the boundaries, as "
        "PrecisionGuardCallback does; raise: every input the guard would have to cast is an "
        "error)",
    )
    s.add_argument("--no-generate", action="store_true", help="skip generate()")
    s.add_argument(
        "--blame",
        default="auto",
        choices=("off", "auto", "always"),
        help="name the first module whose output turns inf/NaN: auto (default) re-runs the "
        "batch with hooks when the loss or a gradient is non-finite; always: with hooks at once",
    )
    s.add_argument(
        "--trace",
        action="store_true",
        help="record one forward's per-module input/output dtypes and name where the "
        "activation dtype changes first, and what did it",
    )
    s.add_argument(
        "--headroom",
        action="store_true",
        help="one float32 forward: each module's largest |activation| against the float16 "
        "(65504) and fp8 e4m3 (448) / e5m2 (57344) ranges, the fp8 layers' error against bf16, "
        "the worst modules named (a float16 policy fails when one leaves float16)",
    )
    s.add_argument(
        "--report-dir",
        default=None,
        help="write the trace's picture and JSON there (doctor-trace.png/.json)",
    )
    for flag, what in (
        ("--image-size", "image side in pixels (vision models; default: the config's)"),
        ("--text-len", "text tokens per row of the synthetic batch (default: 6)"),
        ("--image-token-id", "image placeholder id (vision models; default: the config's)"),
    ):
        s.add_argument(flag, type=int, default=None, help=what)
    s.add_argument(
        "--max-params",
        type=int,
        default=50_000_000,
        help="refuse to build larger models from a config (default 50M)",
    )


def _architectures(args: argparse.Namespace) -> int:
    from ..rules.groups.registry import architecture_table

    print(architecture_table(), end="")
    return 0


def _audit(args: argparse.Namespace) -> int:
    from .audit import audit

    return audit(args)


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import doctor

    return doctor(args)


@dataclass(frozen=True)
class Command:
    """One subcommand: its help, its examples, its own options, what runs it, and whether it
    takes the model options (source, --policy, --trainable, --json, --plain)."""

    help: str
    run: Callable[[argparse.Namespace], int]
    options: Callable[[argparse.ArgumentParser], None] | None = None
    epilog: str | None = None
    description: str | None = None
    model: bool = True


def _commands() -> dict[str, Command]:
    return {
        "architectures": Command(
            "print the supported-architecture table (Markdown, as in docs/api.md)",
            _architectures,
            description="The group rules find_module_groups tries, in order, generated from "
            "the rule registry (registered rules included).",
            model=False,
        ),
        "audit": Command(
            "check a checkpoint/Hub id/adapter/diffusers folder/config/model type against a policy",
            _audit,
            _audit_options,
            _EXAMPLES_AUDIT,
        ),
        "doctor": Command(
            "run one guarded training step and generate()",
            _doctor,
            _doctor_options,
            _EXAMPLES_DOCTOR,
        ),
    }


def _parser() -> argparse.ArgumentParser:
    """The whole command line; building it and --help import no engine (no torch)."""
    commands = _commands()
    p = _Parser(
        prog="hf-precision",
        description="Audit and diagnose the precision (dtypes, "
        "devices) of transformers models against an hf-precision policy.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="run 'hf-precision audit --help' or 'hf-precision doctor --help' for examples\n\n"
        + _EXIT_CODES,
    )
    from .. import __version__  # the package's, read from the installed metadata

    p.add_argument("--version", action="version", version=f"hf-precision {__version__}")
    sub = p.add_subparsers(
        dest="command", parser_class=_Parser, metavar="{" + ",".join(commands) + "}"
    )
    sub.required = True
    for name, cmd in commands.items():
        s = sub.add_parser(
            name,
            help=cmd.help,
            description=cmd.description or cmd.help,
            epilog=cmd.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if cmd.model:
            _common_options(s)
        if cmd.options is not None:
            cmd.options(s)
        s.set_defaults(run=cmd.run)
    # `hf-precision run -- COMMAND` / `install-hook`: the launcher (hf_precision.integrations)
    from ..integrations.launch_cli import add_cli as add_launcher_cli

    add_launcher_cli(sub)
    sub.metavar = "{" + ",".join([*commands, "run", "install-hook"]) + "}"
    return p


def _policy_spelling(value: str) -> bool:
    """``--policy`` spells a policy the one parser reads (``parse_policy``): a preset name, JSON
    text or a JSON file; what it holds is checked once the engine loads."""
    if value in PRESET_NAMES or value.lstrip().startswith("{"):
        return True
    try:
        return Path(value).expanduser().is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte
        return False


def _check_values(args: argparse.Namespace) -> None:
    """The values argparse cannot check alone: the policy and the groups, before anything is
    read or built, from the names alone (no torch: an argument error answers at once)."""
    if hasattr(args, "policy") and not _policy_spelling(args.policy):
        fail(
            f"argument --policy: unknown preset {args.policy!r}."
            f"{preset_hint(args.policy, PRESET_NAMES)} Allowed: {', '.join(PRESET_NAMES)}, "
            "a policy JSON file or JSON text"
        )
    error = unknown_groups(args.trainable) if hasattr(args, "trainable") else None
    if error:
        fail(error)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-precision`` command; returns the exit code."""

    try:
        parser = _parser()
        args = parser.parse_args(argv)
        if args.command in ("run", "install-hook"):  # its own options: auto, a policy file
            from ..integrations.launch_cli import run_cli

            return run_cli(args)
        _check_values(args)
        code: int = args.run(args)
        return code
    except SystemExit as exc:
        return int(exc.code or 0)
    except PrecisionError as err:
        print(f"hf-precision: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
