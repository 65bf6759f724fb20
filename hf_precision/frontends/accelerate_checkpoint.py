"""The policy in an accelerate checkpoint: ``accelerator.register_for_checkpointing(plugin)``
stores :meth:`PluginCheckpointing.state_dict` (the policy and the step) with ``save_state``, and
``load_state`` restores it and verifies the models against it; a ``precision_policy.json`` is
written beside each checkpoint (:func:`policy_from_checkpoint` reads it back)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from ..engine.guard import PrecisionGuard
from ..errors import PrecisionError, PrecisionWarning
from ..rules.policy.parse import parse_policy
from ..rules.policy.precision_policy import PrecisionPolicy

#: Written beside every ``accelerator.save_state`` checkpoint (``PrecisionPolicy.from_json``).
POLICY_FILE = "precision_policy.json"
STATE_VERSION = 1

__all__ = ["POLICY_FILE", "STATE_VERSION", "PluginCheckpointing", "policy_from_checkpoint"]


def policy_from_checkpoint(path: str | os.PathLike[str]) -> PrecisionPolicy:
    """The policy saved beside a checkpoint (``<path>/precision_policy.json``)."""
    file = Path(path) / POLICY_FILE if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise PrecisionError(
            f"policy_from_checkpoint({os.fspath(path)!r}): no {POLICY_FILE} "
            "there. Fix: pass a folder written by accelerator.save_state with "
            "a PrecisionGuardPlugin registered."
        )
    return parse_policy(file)


class PluginCheckpointing:
    """The checkpoint half of :class:`~hf_precision.PrecisionGuardPlugin` (a mixin: the plugin
    holds the fields below and :meth:`verify`)."""

    policy: PrecisionPolicy | None
    steps: int
    _guarded: list[PrecisionGuard]
    _accelerator: Any

    def verify(self, model: Any = None, event: str = "verify", *, check_ranks: bool = True) -> Any:
        raise NotImplementedError  # the plugin's

    def state_dict(self) -> dict[str, Any]:
        """What ``accelerator.save_state`` stores for the guard: the policy and the step."""
        assert self.policy is not None
        return {"version": STATE_VERSION, "policy": self.policy.to_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the policy (``accelerator.load_state``) and verify the models against it."""
        if state.get("version") != STATE_VERSION or "policy" not in state:
            raise PrecisionError(
                f"PrecisionGuardPlugin.load_state_dict: unknown state "
                f"{sorted(state)} (version {state.get('version')!r}). Fix: "
                "load a checkpoint saved by this hf-precision version."
            )
        loaded = PrecisionPolicy.from_dict(state["policy"])
        if self.policy is not None and loaded != self.policy:
            warnings.warn(
                f"PrecisionGuardPlugin.load_state: the checkpoint's policy "
                f"{loaded.describe()} replaces {self.policy.describe()}.",
                PrecisionWarning,
                stacklevel=2,
            )
        self.policy = loaded
        self.steps = int(state.get("steps", 0))
        for g in self._guarded:
            self.verify(g.model, "load_state", check_ranks=False)

    def _save_state_hook(
        self, models: list[nn.Module], weights: list[Any], output_dir: str
    ) -> None:
        if self.policy is not None and getattr(self._accelerator, "is_main_process", True):
            Path(output_dir, POLICY_FILE).write_text(self.policy.to_json())
