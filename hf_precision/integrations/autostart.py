"""Interpreter-start half of the launcher: a post-import hook on ``transformers.trainer``.

Standard library only, and loaded *by file path* (not as ``hf_precision.integrations.autostart``)
from the ``hf_precision_guard.pth`` line or the ``sitecustomize`` that ``hf-precision run``
puts on ``PYTHONPATH``: importing the ``hf_precision`` package would import torch in every Python
process of the tree, even those that never train. Nothing here runs unless ``HF_PRECISION_GUARD``
is set to something else than ``0``/``off``/``false``/``no``.

:func:`activate` puts a finder at the front of ``sys.meta_path`` that waits for the modules of
:data:`HOOKS`: when (and only when) ``transformers.trainer`` is imported, it lets the normal
loader execute it, then hands the module to
:func:`hf_precision.integrations.launcher.patch_trainer_module`, which wraps ``Trainer.__init__``;
``accelerate.accelerator`` goes to
:func:`hf_precision.integrations.accelerate_hook.patch_accelerator_module` (plain accelerate
loops: diffusers' training scripts, kohya-style scripts).
"""

from __future__ import annotations

import os
import sys

# no `typing` at run time: this module is loaded at interpreter start (annotations are strings)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ENV_GUARD = "HF_PRECISION_GUARD"
#: values of ``HF_PRECISION_GUARD`` that mean "off" (as does an unset or empty variable)
OFF_VALUES = ("", "0", "off", "false", "no", "none")
TARGET = "transformers.trainer"
_MARK = "_hf_precision_guard_finder"
#: what runs on the executed ``transformers.trainer`` module, named as an entry point is: this
#: file is loaded on its own at interpreter start and imports the package only then
ON_IMPORT = "hf_precision.integrations.launcher:patch_trainer_module"
#: the other modules the hook waits for, and what runs on each once executed
HOOKS = {
    "accelerate.accelerator": "hf_precision.integrations.accelerate_hook:patch_accelerator_module"
}


def enabled(environ: Any = None) -> bool:
    """Whether ``HF_PRECISION_GUARD`` asks for the guard."""
    value = (os.environ if environ is None else environ).get(ENV_GUARD, "")
    return value.strip().lower() not in OFF_VALUES


class _PatchingLoader:
    """The real loader of ``transformers.trainer``, then the patch on the executed module."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


class _TrainerFinder:
    """A ``sys.meta_path`` finder that answers only for ``transformers.trainer``: it asks the
    finders behind it for the real spec and wraps its loader."""

    _hf_precision_guard_finder = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != TARGET and fullname not in HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or getattr(finder, _MARK, False):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None

    def invalidate_caches(self) -> None:
        pass


_SAID: list[bool] = []  # the "cannot be imported" line is printed once per process


def _patch(module: Any) -> None:
    import importlib

    entry = HOOKS.get(getattr(module, "__name__", ""), ON_IMPORT)
    target, _, name = entry.partition(":")
    try:
        patch_trainer_module = getattr(importlib.import_module(target), name)
    except ImportError as err:
        if _SAID:
            return
        _SAID.append(True)
        print(
            f"hf-precision: {ENV_GUARD} is set but hf-precision cannot be imported in this "
            f"Python ({sys.executable}: {err}): this process trains WITHOUT the precision "
            f"guard. Fix: pip install hf-precision into this environment, or unset {ENV_GUARD}.",
            file=sys.stderr,
            flush=True,
        )
        return
    patch_trainer_module(module)  # (or the HOOKS entry's function)


def activate() -> bool:
    """Install the hook when ``HF_PRECISION_GUARD`` asks for it (idempotent: the ``.pth`` line
    and ``sitecustomize`` may both run); patch at once if ``transformers.trainer`` is already
    imported. Returns whether the guard is on."""
    if not enabled():
        return False
    waiting = False
    for target, cls in ((TARGET, "Trainer"), *((t, "Accelerator") for t in HOOKS)):
        module = sys.modules.get(target)
        if module is not None and hasattr(module, cls):
            _patch(module)
        else:
            waiting = True
    if waiting and not any(getattr(f, _MARK, False) for f in sys.meta_path):
        sys.meta_path.insert(0, _TrainerFinder())
    return True


#: the name the start-up line and ``hf-precision run``'s ``sitecustomize`` load this file under:
#: present in ``sys.modules`` when (and only when) one of them ran in this process
LOADED_AS = "_hf_precision_autostart"
MISSING_HOOK = (
    "hf-precision: {env} is set but the start-up hook is not installed in this Python "
    "({exe}): a Trainer built here gets no precision guard from the variable. Fix: run "
    "`hf-precision install-hook` once in this environment (`pip install`, also with -e, ships "
    "it; a checkout on PYTHONPATH or `python -S` has none), or launch with "
    "`hf-precision run -- COMMAND`."
)


_missing_said = False


def hook_missing(environ: Any = None) -> bool:
    """``HF_PRECISION_GUARD`` asks for the guard, but no start-up line loaded this file in this
    process (a checkout on ``PYTHONPATH`` with no install, ``python -S``): the variable alone
    would guard nothing."""
    if not enabled(environ) or LOADED_AS in sys.modules:
        return False
    return not any(getattr(f, _MARK, False) for f in sys.meta_path)


def warn_if_hook_missing() -> bool:
    """Say :data:`MISSING_HOOK` on stderr, once per process, when :func:`hook_missing`.
    ``import hf_precision`` calls it, so ``python -c "import hf_precision"`` is the one-line
    check; returns whether it was said now."""
    global _missing_said
    if not hook_missing() or _missing_said:
        return False
    _missing_said = True
    print(MISSING_HOOK.format(env=ENV_GUARD, exe=sys.executable), file=sys.stderr, flush=True)
    return True


def deactivate() -> None:
    """Remove the hook (a Trainer class already patched stays patched)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, _MARK, False)]
