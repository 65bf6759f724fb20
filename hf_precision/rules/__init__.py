"""The precision policy and the rules that fill it: dtypes, flags, module groups,
group/keep/diffusion rules, metadata keys.

The registries here (group rules and group names in :mod:`~hf_precision.rules.groups`, presets
in :mod:`~hf_precision.rules.policy.presets`, the leaf-guarded groups) get built-in entries from two
modules: :mod:`~hf_precision.rules.groups.registry` (``group_rules.toml``) and
:mod:`~hf_precision.rules.groups.diffusion` (diffusion groups, rules and presets). Importing any
module of this package loads both first, in this order, so every registry holds the same
entries in the same order whatever a process imports first (``import hf_precision`` imports
none of them: its names load on first use)."""

# isort: off
from .groups import registry as _registry  # noqa: F401  (the built-in group rules, first)
from .groups import diffusion as _diffusion  # noqa: F401  (then the diffusion entries)

# isort: on
