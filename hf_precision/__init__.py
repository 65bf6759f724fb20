"""hf-precision: one precision policy for a whole (multimodal) model, enforced across training,
evaluation, prediction and generation.

>>> from hf_precision import PrecisionGuardCallback
>>> callbacks = [PrecisionGuardCallback()]

Importing this package imports no tracker (wandb) and touches no GPU.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ._aliases import ALIASES


class _AliasLoader(importlib.abc.Loader):
    """Gives the module an old path names: the moved module itself, not a copy."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: ModuleSpec | None = None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set the alias's spec on it


class _AliasFinder(importlib.abc.MetaPathFinder):
    """The module paths from before the folders (``import hf_precision.policy``) give the moved
    module object itself (``hf_precision.rules.policy``), which ``sys.modules`` and the package
    attribute name under both paths: :data:`hf_precision._aliases.ALIASES`, one minor release."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        new = ALIASES.get(name)
        return None if new is None else ModuleSpec(name, _AliasLoader(new))


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    # first: an editable install's finder maps module names to files by itself, and would give
    # an old path the file of another checkout
    sys.meta_path.insert(0, _AliasFinder())


def _cli_process() -> bool:
    """Whether this interpreter was started as the ``hf-precision`` command (the console script
    or ``python -m hf_precision``): then the package loads its engine (torch, the registries)
    only when a command needs it, so that ``--help``, ``--version`` and argument errors answer
    at once. Every other import loads it here, as below."""
    argv = list(getattr(sys, "orig_argv", ()))
    if sys.argv[:1] == ["-m"]:  # python [options] -m <module>, while runpy imports <module>
        return "-m" in argv and argv[argv.index("-m") + 1 :][:1] == ["hf_precision"]
    script = next((a for a in argv[1:] if not a.startswith("-")), "")
    return sys.argv[:1] == [script] and Path(script).stem in ("hf-precision", "hf-precision-script")


def _load() -> None:
    """The engine: the built-in group rules fill the registry of hf_precision.rules.groups; then
    diffusion_rules registers the diffusion groups (text_encoder, unet, transformer, vae), their
    rules and the fp16-vae32 / bf16-vae32 presets, so policies naming them load anywhere (no
    diffusers import); the public names below. Importing the package runs this (the CLI: before
    its first command)."""
    # isort: off
    from .rules import group_rules as _group_rules  # noqa: F401
    from .rules import diffusion_rules as _diffusion_rules  # noqa: F401

    # isort: on

    g = globals()
    for name, module in _EAGER.items():
        if name not in g:
            g[name] = getattr(__import__(f"{__name__}.{module}", fromlist=[name]), name)


#: public name -> module, loaded by :func:`_load` (the registries first: group_rules imports
#: groups, and diffusion_rules policy, in this order)
_EAGER = {
    "PrecisionCollator": "engine.batch",
    "cast_batch": "engine.batch",
    "register_metadata_key": "rules.batch_keys",
    "DtypeMap": "model.dtype_maps",
    "dtype_map": "model.dtype_maps",
    "EnforceReport": "engine.enforce",
    "check_policy": "engine.enforce",
    "enforce_policy": "engine.enforce",
    "PrecisionError": "errors",
    "PrecisionWarning": "errors",
    "GroupRule": "rules.groups",
    "ModuleGroups": "rules.groups",
    "find_module_groups": "rules.groups",
    "register_group": "rules.groups",
    "register_group_rule": "rules.groups",
    "install_guards": "engine.hooks",
    "remove_guards": "engine.hooks",
    "PrecisionPolicy": "rules.policy",
}

if not _cli_process():
    _load()
    # HF_PRECISION_GUARD set where no start-up hook runs: said once, never a silent no-op
    from .integrations.autostart import warn_if_hook_missing

    warn_if_hook_missing()

if TYPE_CHECKING:
    from .engine.batch import PrecisionCollator, cast_batch
    from .engine.enforce import EnforceReport, check_policy, enforce_policy
    from .engine.hooks import install_guards, remove_guards
    from .errors import PrecisionError, PrecisionWarning
    from .frontends.callback import PrecisionGuardCallback
    from .model.dtype_maps import DtypeMap, dtype_map
    from .rules.batch_keys import register_metadata_key
    from .rules.groups import (
        GroupRule,
        ModuleGroups,
        find_module_groups,
        register_group,
        register_group_rule,
    )
    from .rules.policy import PrecisionPolicy
    from .tools.diagnostics import diagnose


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf-precision")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "0.0.0+unknown"


__version__ = _version()

__all__ = [
    "DtypeMap",
    "EnforceReport",
    "GroupRule",
    "ModuleGroups",
    "PrecisionCollator",
    "PrecisionError",
    "PrecisionGuardCallback",
    "PrecisionGuardPlugin",
    "PrecisionPolicy",
    "PrecisionWarning",
    "cast_batch",
    "check_policy",
    "diagnose",
    "dtype_map",
    "enforce_policy",
    "find_module_groups",
    "install_guards",
    "register_group",
    "register_group_rule",
    "register_metadata_key",
    "remove_guards",
]

_LAZY = {
    # transformers/accelerate are imported only when these are used
    "PrecisionGuardCallback": ".frontends.callback",
    "PrecisionGuardPlugin": ".frontends.accelerate_plugin",
    "diagnose": ".tools.diagnostics",
}


def __getattr__(name: str) -> Any:
    if name in _EAGER:  # the CLI process, before its first command
        _load()
        return globals()[name]
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if f"{__name__}.{name}" in ALIASES:  # a path from before the folders, not yet imported
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'hf_precision' has no attribute {name!r}")
