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

The launcher is split by job: this module binds the guard to each ``Trainer``;
:mod:`.launch_config` reads the environment below into a :class:`LaunchConfig`;
:mod:`.launch_cli` is ``hf-precision run`` / ``install-hook`` (the command's environment, the
``exec``, the start-up line); :mod:`.accelerate_hook` reaches plain accelerate loops.

Environment variables (``hf-precision run`` sets them from its flags):

* ``HF_PRECISION_GUARD``: ``auto`` (the policy inferred from the Trainer's arguments), a preset
  name, a policy JSON string or the path of a policy JSON file; unset, empty, ``0``, ``off``,
  ``false``, ``no`` or ``none``: off.
* ``HF_PRECISION_MODE``: ``fix`` / ``audit`` / ``raise`` (default: the policy's, ``fix``).
* ``HF_PRECISION_KEEP_FP32``: regexes of weights kept fp32, comma-separated or a JSON list.
* ``HF_PRECISION_REPORT_DIR``: where the reports go (default ``<output_dir>/precision``).
* ``HF_PRECISION_BLAME``: ``auto`` (default: the callback arms its non-finite blame when a
  logged loss or gradient norm turns inf/NaN), ``always`` or ``off``
  (:mod:`hf_precision.watch.blame`).
* ``HF_PRECISION_TRACE``: ``1`` records the first training step's forward, module by module,
  and reports where the activation dtype changed (:mod:`hf_precision.watch.trace`).
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

import functools
import inspect
import os
import sys
import threading
from typing import Any

from . import autostart
from ._patching import patch_class_in, unwrap_methods, wrap_method
from .launch_config import (
    ENV_GUARD,
    ENV_TOOL,
    LAUNCHED_ATTR,
    LaunchConfig,
    parse_keep_fp32,
    tool_name,
)

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

    return add_callback


def patch_trainer(trainer_cls: Any) -> bool:
    """Wrap ``trainer_cls.__init__`` (``transformers.Trainer``) so that every Trainer built
    while ``HF_PRECISION_GUARD`` is on gets the guard; idempotent. Returns whether it patched."""
    if not wrap_method(trainer_cls, "__init__", _wrap_init):
        return False
    from transformers.trainer_callback import CallbackHandler

    wrap_method(CallbackHandler, "add_callback", _wrap_add_callback)
    return True


def unpatch_trainer(trainer_cls: Any) -> bool:
    """Undo :func:`patch_trainer` (the original ``__init__`` and ``add_callback`` back)."""
    from transformers.trainer_callback import CallbackHandler

    undone = unwrap_methods(trainer_cls, "__init__")
    return unwrap_methods(CallbackHandler, "add_callback") or undone


def patch_trainer_module(module: Any) -> None:
    """What the import hook calls once ``transformers.trainer`` is executed."""
    patch_class_in(module, "Trainer", patch_trainer)


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


__all__ = ["install", "patch_trainer", "patch_trainer_module", "unpatch_trainer"]
