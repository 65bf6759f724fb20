"""What ``hf-precision run`` and ``HF_PRECISION_GUARD`` ask for: the environment variables that
carry the launcher's flags to every process of the tree, read back as one :class:`LaunchConfig`
(checked before any process starts, with the fix in the launcher's flags), and the user's tool
named from a command line (:func:`tool_name`) for messages. Standard library only until a
policy is resolved (``--help`` and a bad flag load no torch). The variables are listed in
:mod:`hf_precision.integrations.launcher`.

>>> LaunchConfig.from_env({"HF_PRECISION_GUARD": "bf16", "HF_PRECISION_MODE": "audit"}).mode
'audit'
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.names import PRESET_NAMES
from ..errors import PrecisionError, did_you_mean
from . import autostart

ENV_GUARD = autostart.ENV_GUARD
ENV_MODE = "HF_PRECISION_MODE"
ENV_KEEP_FP32 = "HF_PRECISION_KEEP_FP32"
ENV_REPORT_DIR = "HF_PRECISION_REPORT_DIR"
ENV_TOOL = "HF_PRECISION_TOOL"  # = flags.ENV (flags imports torch; --help must not)
ENV_BLAME = "HF_PRECISION_BLAME"  # = blame.ENV_BLAME (blame imports torch)
ENV_TRACE = "HF_PRECISION_TRACE"
BLAME_MODES = ("off", "auto", "always")  # = blame.BLAME_MODES
#: how the guard was switched on, for the log line (``hf-precision run`` sets it)
ENV_VIA = "HF_PRECISION_VIA"
ENV_VARS = (
    ENV_GUARD,
    ENV_MODE,
    ENV_KEEP_FP32,
    ENV_REPORT_DIR,
    ENV_TOOL,
    ENV_VIA,
    ENV_BLAME,
    ENV_TRACE,
)
MODES = ("fix", "audit", "raise")

#: marks the callback this module added (``trainer.add_callback`` of the user's own replaces it)
LAUNCHED_ATTR = "_hf_precision_launched"

# launchers whose own arguments come before the user's script
_LAUNCHERS = ("torchrun", "accelerate", "deepspeed", "python", "python3", "uv", "uvx")
_LAUNCHER_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "accelerate.commands.launch",
    "deepspeed.launcher.runner",
)


@dataclass(frozen=True)
class LaunchConfig:
    """What the environment asks for: the policy (``"auto"``, a preset, a JSON string or path),
    the mode override, extra keep-fp32 patterns, the report folder and the user's tool."""

    policy: str = "auto"
    mode: str | None = None
    keep_fp32: tuple[str, ...] = ()
    report_dir: str | None = None
    tool: str | None = None
    via: str = ENV_GUARD
    blame: str = "auto"
    trace: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchConfig:
        env = os.environ if environ is None else environ
        keep = env.get(ENV_KEEP_FP32, "").strip()
        return cls(
            policy=env.get(ENV_GUARD, "auto").strip() or "auto",
            mode=(env.get(ENV_MODE) or "").strip().lower() or None,
            keep_fp32=parse_keep_fp32(keep, where=ENV_KEEP_FP32) if keep else (),
            report_dir=env.get(ENV_REPORT_DIR) or None,
            tool=env.get(ENV_TOOL) or None,
            via=env.get(ENV_VIA) or f"{ENV_GUARD}={env.get(ENV_GUARD, 'auto')}",
            blame=(env.get(ENV_BLAME) or "auto").strip().lower(),
            trace=(env.get(ENV_TRACE) or "").strip().lower() in ("1", "true", "yes", "on"),
        )

    def to_env(self) -> dict[str, str]:
        """The variables that carry this configuration to the process tree."""
        env = {ENV_GUARD: self.policy, ENV_VIA: self.via}
        if self.mode:
            env[ENV_MODE] = self.mode
        if self.keep_fp32:
            env[ENV_KEEP_FP32] = json.dumps(list(self.keep_fp32))
        if self.report_dir:
            env[ENV_REPORT_DIR] = self.report_dir
        if self.tool:
            env[ENV_TOOL] = self.tool
        if self.blame != "auto":
            env[ENV_BLAME] = self.blame
        if self.trace:
            env[ENV_TRACE] = "1"
        return env

    def resolved_policy(self, *, call: str) -> Any:
        """``None`` for ``auto``, else the :class:`PrecisionPolicy` (preset, JSON text, or JSON
        file), with the extra keep-fp32 patterns; a bad value raises a :class:`PrecisionError`
        that names ``call`` and the fix."""
        if self.policy.lower() == "auto":
            return None
        self._check_names(call=call)  # the message a preset/JSON/file typo gets, torch-free
        from ..rules.policy.parse import parse_policy

        policy = parse_policy(self.policy, call=call)  # the one parser every front end uses
        if self.keep_fp32:
            policy = policy.replace(keep_fp32=(*policy.keep_fp32, *self.keep_fp32))
        return policy

    def _check_names(self, *, call: str) -> None:
        """What needs no engine (torch): a policy that is no preset name, no JSON text and no
        file, JSON text that does not parse, a bad ``re:`` pattern; said before torch loads."""
        text = self.policy
        if text.lower() == "auto":
            pass
        elif text.lstrip().startswith("{"):
            try:
                json.loads(text)
            except json.JSONDecodeError as err:
                raise PrecisionError(f"{call}: the policy is not valid JSON ({err})") from None
        elif text not in PRESET_NAMES and not Path(text).expanduser().is_file():
            hint = did_you_mean(text, ["auto", *PRESET_NAMES])
            raise PrecisionError(
                f"{call}: {text!r} is neither 'auto', a preset ({', '.join(PRESET_NAMES)}), a "
                f"policy JSON string nor an existing policy JSON file.{hint} Fix: "
                f"--policy auto, --policy bf16, or --policy path/to/policy.json "
                f"(PrecisionPolicy.to_json() writes one)."
            )
        for pat in self.keep_fp32:
            try:
                re.compile(pat[3:]) if pat.startswith("re:") else None
            except re.error as err:
                raise PrecisionError(
                    f"{call}: --keep-fp32 {pat!r}: bad regex: {err}. Fix: escape it or drop the "
                    "'re:' prefix for a plain path."
                ) from None

    def check(self, *, call: str) -> None:
        """Validate everything before any process starts (``hf-precision run``)."""
        if self.mode is not None and self.mode not in MODES:
            raise PrecisionError(
                f"{call}: unknown mode {self.mode!r}.{did_you_mean(self.mode, MODES)} Fix: "
                f"--mode {' / --mode '.join(MODES)} ({ENV_MODE})."
            )
        self._check_names(call=call)
        self.check_blame(call=call)
        self.resolved_policy(call=call)
        if self.keep_fp32:
            from ..rules.policy.precision_policy import PrecisionPolicy

            try:
                PrecisionPolicy.from_preset("fp32", keep_fp32=self.keep_fp32)
            except PrecisionError as err:
                raise PrecisionError(f"{call}: {str(err).splitlines()[0]}") from None

    def check_blame(self, *, call: str) -> None:
        if self.blame not in BLAME_MODES:
            raise PrecisionError(
                f"{call}: {ENV_BLAME}={self.blame!r} is not a blame mode."
                f"{did_you_mean(self.blame, BLAME_MODES)} Fix: {ENV_BLAME}=auto (default), "
                "always or off (hf-precision run --blame ...)."
            )

    def make_callback(self) -> Any:
        """The :class:`PrecisionGuardCallback` for one Trainer (a new one each time: a callback
        infers its ``auto`` policy from its own Trainer)."""
        from ..frontends.callback import PrecisionGuardCallback

        call = f"{ENV_GUARD}={self.policy!r}"
        self.check_blame(call=call)
        policy = self.resolved_policy(call=call)
        mode: Any = self.mode
        # an inferred policy gets the --keep-fp32 patterns at each Trainer (a given one has them)
        keep = self.keep_fp32 if policy is None else ()
        cb = PrecisionGuardCallback(
            policy,
            mode=mode,
            report_dir=self.report_dir,
            blame=self.blame,  # type: ignore[arg-type]  # checked by check_blame
            trace=self.trace,
            keep_fp32=keep,
        )
        setattr(cb, LAUNCHED_ATTR, True)
        return cb


def parse_keep_fp32(value: str, *, where: str) -> tuple[str, ...]:
    """``HF_PRECISION_KEEP_FP32``: a JSON list of regexes, or regexes separated by commas."""
    if value.startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as err:
            raise PrecisionError(
                f"{where}={value!r}: not a JSON list ({err}). Fix: "
                f"{where}='[\"vision_tower\\\\..*norm\"]' or comma-separated patterns."
            ) from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise PrecisionError(f"{where}={value!r}: expected a JSON list of strings.")
        return tuple(items)
    return tuple(p.strip() for p in value.split(",") if p.strip())


# ----------------------------------------------------------------------- the user's tool
def tool_name(argv: Sequence[str]) -> str:
    """The user's tool in ``argv`` for messages: the program's name, or for a launcher
    (``torchrun``, ``accelerate launch``, ``deepspeed``, ``python``) the script or module it runs.

    >>> tool_name(["/venv/bin/llamafactory-cli", "train", "cfg.yaml"])
    'llamafactory-cli'
    >>> tool_name(["python", "-m", "trl.cli", "sft"]), tool_name(["accelerate", "launch", "t.py"])
    ('trl.cli', 't.py')
    """
    if not argv:
        return "python"
    prog = os.path.basename(argv[0])
    launcher = prog.startswith("python") or prog in _LAUNCHERS
    if not launcher:
        return prog
    rest = list(argv[1:])
    for i, arg in enumerate(rest):
        module = rest[i + 1] if arg in ("-m", "--module") and i + 1 < len(rest) else "-"
        if not module.startswith("-") and module not in _LAUNCHER_MODULES:
            return module
        if arg == "-c" and prog.startswith("python"):
            return f"{prog} -c"
        if arg.endswith(".py") and not arg.startswith("-"):
            return os.path.basename(arg)
    positional = [a for a in rest if not a.startswith("-")]
    if prog.startswith("python") and positional:
        return os.path.basename(positional[0])
    return prog


__all__ = [
    "BLAME_MODES",
    "ENV_BLAME",
    "ENV_GUARD",
    "ENV_KEEP_FP32",
    "ENV_MODE",
    "ENV_REPORT_DIR",
    "ENV_TOOL",
    "ENV_TRACE",
    "ENV_VARS",
    "ENV_VIA",
    "LAUNCHED_ATTR",
    "MODES",
    "LaunchConfig",
    "parse_keep_fp32",
    "tool_name",
]
