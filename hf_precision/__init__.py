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
from typing import TYPE_CHECKING, Any

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
    "guard_diffusion",
    "install_guards",
    "register_group",
    "register_group_rule",
    "register_metadata_key",
    "remove_guards",
]

#: public name -> the module that defines it, imported when the name is first read
_PUBLIC: dict[str, str] = {
    "DtypeMap": ".model.dtype_maps",
    "EnforceReport": ".engine.records",
    "GroupRule": ".rules.groups.group_rule",
    "ModuleGroups": ".rules.groups.module_groups",
    "PrecisionCollator": ".engine.batch",
    "PrecisionError": ".errors",
    "PrecisionGuardCallback": ".frontends.callback",  # transformers, when used
    "PrecisionGuardPlugin": ".frontends.accelerate_plugin",  # accelerate, when used
    "PrecisionPolicy": ".rules.policy.precision_policy",
    "PrecisionWarning": ".errors",
    "cast_batch": ".engine.batch",
    "check_policy": ".engine.enforce",
    "diagnose": ".tools.diagnostics",
    "dtype_map": ".model.dtype_maps",
    "enforce_policy": ".engine.enforce",
    "find_module_groups": ".rules.groups.module_groups",
    "guard_diffusion": ".frontends.diffusion",  # diffusers pipelines, OneTrainer, kohya
    "install_guards": ".engine.hooks",
    "register_group": ".rules.groups.group_rule",
    "register_group_rule": ".rules.groups.registry",
    "register_metadata_key": ".rules.batch_keys",
    "remove_guards": ".engine.hooks",
}

if TYPE_CHECKING:  # what mypy and IDEs see; at run time __getattr__ loads each on first use
    from .engine.batch import PrecisionCollator, cast_batch
    from .engine.enforce import check_policy, enforce_policy
    from .engine.hooks import install_guards, remove_guards
    from .engine.records import EnforceReport
    from .errors import PrecisionError, PrecisionWarning
    from .frontends.accelerate_plugin import PrecisionGuardPlugin
    from .frontends.callback import PrecisionGuardCallback
    from .frontends.diffusion import guard_diffusion
    from .model.dtype_maps import DtypeMap, dtype_map
    from .rules.batch_keys import register_metadata_key
    from .rules.groups.group_rule import GroupRule, register_group
    from .rules.groups.module_groups import ModuleGroups, find_module_groups
    from .rules.groups.registry import register_group_rule
    from .rules.policy.precision_policy import PrecisionPolicy
    from .tools.diagnostics import diagnose

    __version__: str


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf-precision")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "0.0.0+unknown"


def __getattr__(name: str) -> Any:
    """A public name or the version, loaded on first use and kept."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    elif name == "__version__":  # the installed metadata: read only when asked
        value = _version()
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
