"""hf-precision: one precision policy for a whole (multimodal) model, enforced across training,
evaluation, prediction and generation.

>>> from hf_precision import PrecisionGuardCallback
>>> callbacks = [PrecisionGuardCallback()]

Importing this package imports no tracker (wandb) and touches no GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# The built-in group rules fill the registry of hf_precision.groups (importing any submodule runs
# this first); then diffusion_rules registers the diffusion groups (text_encoder, unet,
# transformer, vae), their rules and the fp16-vae32 / bf16-vae32 presets, so policies naming them
# load anywhere (no diffusers import).
# isort: off
from . import group_rules as _group_rules  # noqa: F401
from . import diffusion_rules as _diffusion_rules  # noqa: F401

# isort: on
from .batch import PrecisionCollator, cast_batch
from .dtype_maps import DtypeMap, dtype_map
from .enforce import EnforceReport, check_policy, enforce_policy
from .errors import PrecisionError, PrecisionWarning
from .groups import (
    GroupRule,
    ModuleGroups,
    find_module_groups,
    register_group,
    register_group_rule,
)
from .hooks import install_guards, remove_guards
from .policy import PrecisionPolicy

if TYPE_CHECKING:
    from .callback import PrecisionGuardCallback
    from .diagnostics import diagnose


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
    "remove_guards",
]

_LAZY = {
    # transformers/accelerate are imported only when these are used
    "PrecisionGuardCallback": ".callback",
    "PrecisionGuardPlugin": ".accelerate_plugin",
    "diagnose": ".diagnostics",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'hf_precision' has no attribute {name!r}")
