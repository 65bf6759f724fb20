"""ms-swift: the guard through swift's own plugin options (tested with ms-swift 4.6.0).

    swift sft ... --external_plugins "$(python -m hf_precision.integrations.ms_swift)" \\
        --callbacks precision_guard

``python -m hf_precision.integrations.ms_swift`` prints the path of this file. swift imports
``--external_plugins`` files by path while it parses its arguments (before it settles the
mixed-precision flags); importing this one registers :class:`SwiftPrecisionGuardCallback` in
``swift.callbacks.callbacks_map`` as ``precision_guard`` (swift builds each ``--callbacks`` entry
as ``cls(args, trainer)`` and passes them to ``Trainer.__init__``, so ``on_init_end`` fires) and
records which of ``fp16``/``bf16`` swift set by itself: with ``--fp16``/``--bf16`` left unset,
swift turns on ``fp16=True`` for a float32 or float16 ``torch_dtype`` (``bf16=True`` for
bfloat16). The guard's policy follows those flags like any others; the callback says in one line
that the flag came from swift, not from the command line, and how to choose otherwise.

The policy: ``auto`` (inferred from the Trainer's arguments and model), or the value of
``HF_PRECISION_GUARD`` when it is set (a preset name or a policy JSON). The same flags reach the
guard with ``hf-precision run -- swift sft ...`` (no plugin options), but only the plugin sees
swift settle its flags: without it the guard cannot tell whose flag ``fp16=True`` was.

This module imports without ms-swift; :func:`install` does nothing then.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from hf_precision.frontends.callback import PrecisionGuardCallback

logger = logging.getLogger("hf_precision")

#: the name to give ``--callbacks``
CALLBACK_NAME = "precision_guard"
_FLAGS = ("fp16", "bf16")
#: what swift chose by itself in this process: {"fp16": True, "bf16": False, ...} and the
#: ``torch_dtype`` it chose from (one swift argument parse per process)
_SET_BY_SWIFT: dict[str, Any] = {}


def flags_set_by_swift(args: Any = None) -> dict[str, bool]:
    """The mixed-precision flags ms-swift turned on by itself in this process (the user left them
    unset), as they still stand on ``args`` (a ``TrainingArguments``): e.g. ``{"fp16": True}``.

    Empty when the user set the flags, when no flag was turned on, or when swift parsed its
    arguments before :func:`install` ran (the ``--external_plugins`` route installs it in time).

    >>> flags_set_by_swift(None)
    {}
    """
    flags = {k: v for k, v in _SET_BY_SWIFT.items() if k in _FLAGS and v}
    if args is not None:
        flags = {k: v for k, v in flags.items() if getattr(args, k, None) == v}
    return flags


def swift_flag_note(args: Any = None) -> str | None:
    """One line naming the flags swift set by itself, the dtype it chose them from and the fix
    on swift's command line; ``None`` when there is none. For the guard's console line.

    >>> swift_flag_note(None) is None
    True
    """
    flags = flags_set_by_swift(args)
    if not flags:
        return None
    dtype = str(_SET_BY_SWIFT.get("torch_dtype", "the checkpoint's dtype")).replace("torch.", "")
    named = ", ".join(f"{k}=True" for k in flags)
    other = "--fp16 false" if "fp16" in flags else "--bf16 false"
    return (
        f"{named} was set by ms-swift (from torch_dtype {dtype}), not on your command line; the "
        f"guard follows it. Fix: pass {other} to keep the loaded dtypes, or --torch_dtype "
        "bfloat16 for bf16 mixed precision"
    )


def _record_provenance() -> None:
    """Tell the provenance record (the event JSON's ``provenance``) what swift set by itself."""
    from hf_precision.watch import provenance

    dtype = str(_SET_BY_SWIFT.get("torch_dtype")).replace("torch.", "")
    provenance.record(
        "ms-swift",
        {k: v for k, v in _SET_BY_SWIFT.items() if k in _FLAGS and v},
        f"from torch_dtype {dtype}; --fp16/--bf16 were left unset",
    )


def _recording(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap swift's ``ModelArguments._init_mixed_precision``: note which flags it filled in."""

    @functools.wraps(original)
    def _init_mixed_precision(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = {k: getattr(self, k, None) for k in _FLAGS}
        result = original(self, *args, **kwargs)
        _SET_BY_SWIFT.clear()
        _SET_BY_SWIFT.update(
            {k: bool(getattr(self, k, False)) for k, v in before.items() if v is None}
        )
        _SET_BY_SWIFT["torch_dtype"] = getattr(self, "torch_dtype", None)
        _record_provenance()
        return result

    _init_mixed_precision.__hf_precision__ = True  # type: ignore[attr-defined]
    return _init_mixed_precision


def install() -> bool:
    """Register :class:`SwiftPrecisionGuardCallback` as ``precision_guard`` in swift's
    ``callbacks_map`` and record the flags swift sets by itself from now on. Idempotent;
    ``False`` when ms-swift is not installed."""
    try:
        from swift.arguments.base_args.model_args import ModelArguments
        from swift.callbacks import callbacks_map
    except ImportError:
        return False
    callbacks_map[CALLBACK_NAME] = SwiftPrecisionGuardCallback
    method = ModelArguments._init_mixed_precision
    if not getattr(method, "__hf_precision__", False):
        ModelArguments._init_mixed_precision = _recording(method)  # type: ignore[method-assign]
    return True


def launch_options() -> dict[str, Any]:
    """``policy``, ``mode`` and ``report_dir`` for the callback, read from ``HF_PRECISION_GUARD``
    and its companions as ``hf-precision run`` reads them; ``{"policy": None}`` (inferred) when
    the variable is unset or off."""
    from hf_precision.integrations import autostart
    from hf_precision.integrations.launch_config import ENV_GUARD, LaunchConfig

    if not autostart.enabled():
        return {"policy": None}
    config = LaunchConfig.from_env()
    return {
        "policy": config.resolved_policy(call=f"{ENV_GUARD}={config.policy!r}"),
        "mode": config.mode,
        "report_dir": config.report_dir,
    }


class SwiftPrecisionGuardCallback(PrecisionGuardCallback):
    """:class:`~hf_precision.PrecisionGuardCallback` built the way swift builds ``--callbacks``
    entries (``cls(args, trainer)``); it says when swift, not the user, set the precision flag.
    """

    def __init__(self, args: Any = None, trainer: Any = None, **kwargs: Any) -> None:
        for key, value in launch_options().items():
            kwargs.setdefault(key, value)
        super().__init__(**kwargs)
        #: the flags swift turned on by itself, as seen at ``on_init_end``
        self.set_by_swift: dict[str, bool] = {}

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.set_by_swift = flags_set_by_swift(args)
        note = swift_flag_note(args)
        if note and getattr(state, "is_world_process_zero", True):
            logger.warning("hf-precision: %s", note)
        super().on_init_end(args, state, control, **kwargs)


if __name__ == "__main__":  # the path to give --external_plugins
    print(os.path.abspath(__file__))
elif __name__ != "hf_precision.integrations.ms_swift":
    # imported by path (swift's --external_plugins, under a name of its own): the package's module
    # registers its callback and keeps the record, so flags_set_by_swift() sees it from anywhere
    import importlib

    importlib.import_module("hf_precision.integrations.ms_swift")
else:
    install()
