"""``GuardFrontEnd``: what the front ends share (the callback, the accelerate plugin): the
user's policy argument checked when they are built, its overrides, the user's own call for
messages, and the engine (:class:`~hf_precision.engine.guard.PrecisionGuard`) they run.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from ..engine.guard import PrecisionGuard
from ..engine.lines import flag_conflict
from ..errors import PrecisionError, PrecisionWarning
from ..rules.policy.fields import LeafGuards, Mode
from ..rules.policy.parse import parse_policy
from ..rules.policy.precision_policy import PrecisionPolicy, policy_call
from ..watch.blame import BlameMode
from ..watch.lost_updates import LostUpdates
from .steps import StepWatch

__all__ = ["GuardFrontEnd"]


class GuardFrontEnd:
    """What the front ends share: the user's policy argument, checked when they are built (a
    bad preset fails at the call, not at train time), with its ``mode``/``leaf_guards``
    overrides, and the user's own call for messages. Subclasses run :class:`PrecisionGuard`."""

    policy: PrecisionPolicy | None
    _reporter: Any  # the front end's PrecisionReporter (or None), made when it knows where
    #: the per-step work (trace, blame, lost-update check) the front end holds
    step_watch: StepWatch

    @property
    def blame_mode(self) -> BlameMode:
        """The non-finite blame's mode (held by :attr:`step_watch`)."""
        return self.step_watch.blame_mode

    @property
    def lost_updates(self) -> LostUpdates:
        """The lost-update check's option (held by :attr:`step_watch`)."""
        return self.step_watch.lost_updates

    def _init_policy(
        self,
        name: str,
        policy: PrecisionPolicy | str | None,
        *,
        mode: Mode | None,
        leaf_guards: LeafGuards | None,
    ) -> None:
        self._name, self._policy_arg = name, policy
        self._mode, self._leaf_guards = mode, leaf_guards
        self._call = policy_call(name, policy, mode=mode, leaf_guards=leaf_guards)
        # nothing the caller passed in changes (a policy is a value)
        given = self._with_overrides(parse_policy(policy, call=self._call))
        self.policy = None if policy is None else given

    def _check_flag(
        self, flag: str | None, *, said: str, runner: str, words: Any, stacklevel: int
    ) -> None:
        """The user's explicit policy against the run's mixed-precision flag, before anything
        is cast (:func:`flag_conflict`): refused with a :class:`PrecisionError`, or a warning
        when it runs but not as asked."""
        if self._policy_arg is None or self.policy is None:
            return  # an inferred policy follows the flags
        conflict = flag_conflict(
            self.policy,
            flag,
            call=self._call,
            said=said,
            runner=runner,
            owner=self._name,
            words=words,
        )
        if isinstance(conflict, PrecisionError):
            raise conflict
        if conflict:
            warnings.warn(conflict, PrecisionWarning, stacklevel=stacklevel + 1)

    def _new_guard(self, model: nn.Module, **kwargs: Any) -> PrecisionGuard:
        """The engine for ``model``, owned by this front end, speaking in its user's call and
        reporting through its reporter."""
        assert self.policy is not None
        return PrecisionGuard(
            model,
            self.policy,
            name=self._name,
            call=self._call,
            owner=self,
            reporter=self._reporter,
            **kwargs,
        )

    def _with_overrides(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        return parse_policy(policy, call=self._call, mode=self._mode, leaf_guards=self._leaf_guards)
