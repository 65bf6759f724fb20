"""``hf-precision run -- COMMAND`` and ``HF_PRECISION_GUARD``: the guard on every ``Trainer``.

Every ``transformers.Trainer`` (and subclass: TRL's, LLaMA-Factory's, ms-swift's, axolotl's)
built in any Python process of a process tree gets a :class:`PrecisionGuardCallback`, without
editing the script that builds it::

    hf-precision run -- llamafactory-cli train cfg.yaml
    hf-precision run --policy bf16 --mode audit -- torchrun --nproc_per_node 2 train.py
    HF_PRECISION_GUARD=auto llamafactory-cli train cfg.yaml     # launchers that cannot be wrapped

The mechanism is the one coverage (subprocess measurement) and OpenTelemetry
(``opentelemetry-instrument``) use. ``hf-precision run`` sets the environment variables below,
puts a ``sitecustomize`` folder first on ``PYTHONPATH`` and ``exec``s the command; a wheel install
also ships ``hf_precision_guard.pth``, one line that Python runs at every start and that does
nothing unless ``HF_PRECISION_GUARD`` is set. Either loads :mod:`.autostart` (standard library
only), whose import hook waits for ``transformers.trainer`` and then calls
:func:`patch_trainer_module`: ``Trainer.__init__`` is wrapped (signature kept) to add the
callback before the original ``__init__`` runs, so ``on_init_end`` fires. Workers started by
torchrun, ``accelerate launch`` and ``deepspeed`` inherit the environment and are guarded too.

Environment variables (``hf-precision run`` sets them from its flags):

* ``HF_PRECISION_GUARD``: ``auto`` (the policy inferred from the Trainer's arguments), a preset
  name, a policy JSON string or the path of a policy JSON file; unset, empty, ``0``, ``off``,
  ``false``, ``no`` or ``none``: off.
* ``HF_PRECISION_MODE``: ``fix`` / ``audit`` / ``raise`` (default: the policy's, ``fix``).
* ``HF_PRECISION_KEEP_FP32``: regexes of weights kept fp32, comma-separated or a JSON list.
* ``HF_PRECISION_REPORT_DIR``: where the reports go (default ``<output_dir>/precision``).
* ``HF_PRECISION_BLAME``: ``auto`` (default: the callback arms its non-finite blame when a
  logged loss or gradient norm turns inf/NaN), ``always`` or ``off``
  (:mod:`hf_precision.engine.blame`).
* ``HF_PRECISION_TRACE``: ``1`` records the first training step's forward, module by module,
  and reports where the activation dtype changed (:mod:`hf_precision.engine.trace`).
* ``HF_PRECISION_TOOL``: the user's tool (``llamafactory-cli``, ``swift``, ``trl``, ...), so
  messages can name its flags; set from the command's program by ``hf-precision run``, else
  from ``sys.argv[0]`` of the process that builds the Trainer.

>>> config = LaunchConfig.from_env({"HF_PRECISION_GUARD": "bf16", "HF_PRECISION_MODE": "audit"})
>>> config.policy, config.mode
('bf16', 'audit')
>>> tool_name(["torchrun", "--nproc_per_node", "2", "train.py", "--lr", "1e-4"])
'train.py'
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import re
import shutil
import sys
import sysconfig
import threading
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

#: the ``sitecustomize`` folder ``hf-precision run`` puts first on ``PYTHONPATH``
BOOT_DIR = Path(__file__).resolve().parent / "_boot"
#: the start-up line a wheel install puts in site-packages (``hf-precision install-hook``)
PTH_NAME = "hf_precision_guard.pth"
PTH_SOURCE = Path(__file__).resolve().parent / PTH_NAME
#: marks the callback this module added (``trainer.add_callback`` of the user's own replaces it)
LAUNCHED_ATTR = "_hf_precision_launched"
_WRAPPED_ATTR = "_hf_precision_wrapped"

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
        text = self.policy
        self._check_names(call=call)
        from ..rules.policy import PRESETS
        from ..rules.policy_spec import parse_policy

        try:
            if text in PRESETS or text.lstrip()[:1] == "{" or Path(text).expanduser().is_file():
                policy = parse_policy(text)
            else:
                hint = did_you_mean(text, ["auto", *PRESETS])
                raise PrecisionError(
                    f"{call}: {text!r} is neither 'auto', a preset ({', '.join(PRESETS)}), a "
                    f"policy JSON string nor an existing policy JSON file.{hint} Fix: "
                    f"--policy auto, --policy bf16, or --policy path/to/policy.json "
                    f"(PrecisionPolicy.to_json() writes one)."
                )
        except PrecisionError as err:  # from_json names what does not parse
            if str(err).startswith(call):
                raise
            raise PrecisionError(f"{call}: {err}") from None
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
            from ..rules.policy import PrecisionPolicy

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


# ----------------------------------------------------------------------- the Trainer patch
_state = threading.local()


def _has_guard(callbacks: Any) -> bool:
    from ..frontends.callback import PrecisionGuardCallback

    for cb in callbacks or ():
        if isinstance(cb, PrecisionGuardCallback):
            return True
        if isinstance(cb, type) and issubclass(cb, PrecisionGuardCallback):
            return True
    return False


def _rank0(trainer: Any) -> bool:
    index = getattr(getattr(trainer, "args", None), "process_index", None)
    if isinstance(index, int):
        return index == 0
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var]) == 0
    return True


def _announce(trainer: Any, cb: Any, config: LaunchConfig) -> None:
    """The one line the main process prints per guarded Trainer."""
    if not _rank0(trainer):
        return
    args = getattr(trainer, "args", None)
    where = config.report_dir or os.path.join(getattr(args, "output_dir", None) or ".", "precision")
    policy = cb.policy.describe() if cb.policy is not None else "inferred at train begin"
    tool = config.tool or tool_name(sys.argv)
    chosen = getattr(getattr(cb, "guard", None), "sections", {}).get("provenance") or {}
    said = f"; {chosen['line']}" if chosen.get("notable") else ""
    print(
        f"hf-precision: precision guard on for {type(trainer).__name__} (launched by {tool}, "
        f"via {config.via}): policy {policy}; reports in {os.path.abspath(where)}{os.sep}; off: "
        f"unset {ENV_GUARD}{said}",
        file=sys.stderr,
        flush=True,
    )


def _wrap_init(init: Any) -> Any:
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        depth = getattr(_state, "depth", 0)
        if depth or not autostart.enabled():  # a nested Trainer.__init__, or switched off
            return init(self, *args, **kwargs)
        config = LaunchConfig.from_env()
        if config.tool is None:
            os.environ.setdefault(ENV_TOOL, tool_name(sys.argv))
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # the original raises its own, clearer error
            return init(self, *args, **kwargs)
        callbacks = bound.arguments.get("callbacks")
        cb = None
        if "callbacks" in signature.parameters and not _has_guard(callbacks):
            cb = config.make_callback()
            cb.bind_trainer(self)  # the callback needs no frame walk to find its Trainer
            bound.arguments["callbacks"] = [*(callbacks or ()), cb]
        _state.depth = depth + 1
        try:
            init(*bound.args, **bound.kwargs)
        finally:
            _state.depth = depth
        if cb is not None:
            _announce(self, cb, config)

    setattr(__init__, _WRAPPED_ATTR, True)
    return __init__


def _wrap_add_callback(add: Any) -> Any:
    @functools.wraps(add)
    def add_callback(self: Any, callback: Any) -> None:
        from ..frontends.callback import PrecisionGuardCallback

        new = isinstance(callback, PrecisionGuardCallback) or (
            isinstance(callback, type) and issubclass(callback, PrecisionGuardCallback)
        )
        if new and not getattr(callback, LAUNCHED_ATTR, False):
            # the user's (or the framework's) own guard replaces the launcher's
            for cb in list(self.callbacks):
                if getattr(cb, LAUNCHED_ATTR, False):
                    self.callbacks.remove(cb)
                    if cb.handle is not None:
                        cb.handle.remove()
        return add(self, callback)

    setattr(add_callback, _WRAPPED_ATTR, True)
    return add_callback


def patch_trainer(trainer_cls: Any) -> bool:
    """Wrap ``trainer_cls.__init__`` (``transformers.Trainer``) so that every Trainer built
    while ``HF_PRECISION_GUARD`` is on gets the guard; idempotent. Returns whether it patched."""
    init = trainer_cls.__dict__.get("__init__")
    if init is None or getattr(init, _WRAPPED_ATTR, False):
        return False
    trainer_cls.__init__ = _wrap_init(init)
    from transformers.trainer_callback import CallbackHandler

    add = CallbackHandler.__dict__["add_callback"]
    if not getattr(add, _WRAPPED_ATTR, False):
        setattr(CallbackHandler, "add_callback", _wrap_add_callback(add))  # noqa: B010
    return True


def unpatch_trainer(trainer_cls: Any) -> bool:
    """Undo :func:`patch_trainer` (the original ``__init__`` and ``add_callback`` back)."""
    from transformers.trainer_callback import CallbackHandler

    undone = False
    for cls, name in ((trainer_cls, "__init__"), (CallbackHandler, "add_callback")):
        fn = cls.__dict__.get(name)
        if fn is not None and getattr(fn, _WRAPPED_ATTR, False):
            setattr(cls, name, fn.__wrapped__)
            undone = True
    return undone


def patch_trainer_module(module: Any) -> None:
    """What the import hook calls once ``transformers.trainer`` is executed."""
    trainer = getattr(module, "Trainer", None)
    if trainer is not None:
        patch_trainer(trainer)


def install(policy: str | None = None, **env: str) -> None:
    """Turn the launcher's guard on inside a running interpreter (a notebook): sets
    ``HF_PRECISION_GUARD`` (``policy``, default ``auto``) and the other variables given as
    keywords (``mode=``, ``report_dir=``, ``keep_fp32=``, ``tool=``), and patches ``Trainer``
    now or when transformers imports it."""
    config = LaunchConfig(
        policy=policy or os.environ.get(ENV_GUARD, "auto"),
        mode=env.get("mode"),
        keep_fp32=parse_keep_fp32(env["keep_fp32"], where="keep_fp32")
        if env.get("keep_fp32")
        else (),
        report_dir=env.get("report_dir"),
        tool=env.get("tool"),
        via="hf_precision.integrations.launcher.install()",
    )
    config.check(call=f"install({config.policy!r})")
    os.environ.update(config.to_env())
    autostart.activate()


# ----------------------------------------------------------------------- hf-precision run
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
        help=f"install the start-up line that makes {ENV_GUARD} work (editable installs)",
        description=f"Write {PTH_NAME} into site-packages (a wheel install ships it): Python "
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
    ``hf-precision run``; a wheel install ships it, an editable install (``pip install -e``) does
    not. Returns the file's path."""
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
    "ENV_GUARD",
    "ENV_KEEP_FP32",
    "ENV_MODE",
    "ENV_REPORT_DIR",
    "ENV_TOOL",
    "LaunchConfig",
    "add_cli",
    "command_env",
    "install",
    "install_hook",
    "patch_trainer",
    "patch_trainer_module",
    "run_cli",
    "run_command",
    "tool_name",
    "unpatch_trainer",
]
