"""hf-precision: one precision policy for a whole (multimodal) model, enforced across training,
evaluation, prediction and generation.

>>> from hf_precision import PrecisionGuardCallback
>>> callbacks = [PrecisionGuardCallback()]

Importing this package imports no torch, no tracker (wandb) and touches no GPU: each public
name loads its module on first use (PEP 562), in every process alike; the registries of
:mod:`hf_precision.rules` fill with their built-in entries when that package is first imported
(:mod:`hf_precision.rules`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from importlib.machinery import ModuleSpec
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

    def get_code(self, fullname: str) -> Any:
        """What ``python -m <old path>`` runs (``runpy`` asks the loader for code): the moved
        module as ``__main__``, under its own package, so its relative imports resolve."""
        run = f"runpy.run_module({self.target!r}, run_name='__main__', alter_sys=True)"
        source = f"import runpy\n{run}\n"
        return compile(source, f"<{fullname}: python -m {self.target}>", "exec")


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

#: public name -> the module that defines it, imported when the name is first read
_PUBLIC: dict[str, str] = {
    "DtypeMap": ".model.dtype_maps",
    "EnforceReport": ".engine.enforce",
    "GroupRule": ".rules.groups",
    "ModuleGroups": ".rules.groups",
    "PrecisionCollator": ".engine.batch",
    "PrecisionError": ".errors",
    "PrecisionGuardCallback": ".frontends.callback",  # transformers, when used
    "PrecisionGuardPlugin": ".frontends.accelerate_plugin",  # accelerate, when used
    "PrecisionPolicy": ".rules.policy",
    "PrecisionWarning": ".errors",
    "cast_batch": ".engine.batch",
    "check_policy": ".engine.enforce",
    "diagnose": ".tools.diagnostics",
    "dtype_map": ".model.dtype_maps",
    "enforce_policy": ".engine.enforce",
    "find_module_groups": ".rules.groups",
    "install_guards": ".engine.hooks",
    "register_group": ".rules.groups",
    "register_group_rule": ".rules.groups",
    "register_metadata_key": ".rules.batch_keys",
    "remove_guards": ".engine.hooks",
}

if TYPE_CHECKING:  # what mypy and IDEs see; at run time __getattr__ loads each on first use
    from .engine.batch import PrecisionCollator, cast_batch
    from .engine.enforce import EnforceReport, check_policy, enforce_policy
    from .engine.hooks import install_guards, remove_guards
    from .errors import PrecisionError, PrecisionWarning
    from .frontends.accelerate_plugin import PrecisionGuardPlugin
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

    __version__: str


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf-precision")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "0.0.0+unknown"


def __getattr__(name: str) -> Any:
    """A public name, the version or an old module path, loaded on first use and kept."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    elif name == "__version__":  # the installed metadata: read only when asked
        value = _version()
    elif f"{__name__}.{name}" in ALIASES:  # a path from before the folders, not yet imported
        return importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})


def _warn_if_hook_missing() -> None:
    """``HF_PRECISION_GUARD`` set where no start-up hook runs: said once on stderr, never a
    silent no-op (:mod:`hf_precision.integrations.autostart`, the standard library only)."""
    from .integrations.autostart import warn_if_hook_missing

    warn_if_hook_missing()


_warn_if_hook_missing()
