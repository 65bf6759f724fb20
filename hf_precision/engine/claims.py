"""Model claiming: one guard owns a model at a time. A second guard with another policy is
refused (the two would "repair" each other's casts at every event); the claim is a weak
reference, released with the guard's hooks."""

from __future__ import annotations

import dataclasses
import weakref

from torch import nn

from ..errors import PrecisionError
from ..rules.policy.precision_policy import PrecisionPolicy

_OWNER_ATTR = "_hf_precision_owner"


def claim_model(root: nn.Module, owner: object, policy: PrecisionPolicy, call: str) -> None:
    """Mark ``root`` as guarded by ``owner``. A second guard with another policy raises: the two
    would "repair" each other's casts at every event and the last one would silently win."""
    held = root.__dict__.get(_OWNER_ATTR)
    if held is not None:
        other, other_policy, other_call = held
        alive = other() if callable(other) else None
        if alive is not None and alive is not owner and other_policy != policy:
            differ = ", ".join(
                f"{f.name}={getattr(other_policy, f.name)!r} vs {getattr(policy, f.name)!r}"
                for f in dataclasses.fields(policy)
                if getattr(other_policy, f.name) != getattr(policy, f.name)
            )
            raise PrecisionError(
                f"{call}: {type(root).__name__} is already guarded by {other_call} with "
                f"policy {other_policy.describe()}; this guard's policy is "
                f"{policy.describe()} (they differ in {differ}). Two guards with different "
                "policies repair each other's "
                "casts at every event and the last one wins.\nFix: keep one guard (one "
                "PrecisionGuardCallback in Trainer(callbacks=[...]), or one "
                "PrecisionGuardPlugin), or give both the same policy."
            )
    root.__dict__[_OWNER_ATTR] = (weakref.ref(owner), policy, call)


def release_model(root: nn.Module, owner: object) -> None:
    """Undo :func:`claim_model` when ``owner`` holds the claim (its guards were removed)."""
    held = root.__dict__.get(_OWNER_ATTR)
    if held is not None and held[0]() is owner:
        del root.__dict__[_OWNER_ATTR]


def claimed_by(root: nn.Module) -> object | None:
    """The live guard that claimed ``root`` (:func:`claim_model`), or ``None``."""
    held = root.__dict__.get(_OWNER_ATTR)
    return held[0]() if held is not None and callable(held[0]) else None
