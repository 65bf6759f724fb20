"""``GuardFrontEnd`` (``hf_precision/engine/frontend.py``): the front ends' shared base, the same
class
from its old path (``hf_precision.engine.guard``), and a bad preset refused when a front end is
built."""

from __future__ import annotations

import pytest

from hf_precision import PrecisionError
from hf_precision.engine import guard
from hf_precision.engine.frontend import GuardFrontEnd
from hf_precision.frontends.accelerate_plugin import PrecisionGuardPlugin
from hf_precision.frontends.callback import PrecisionGuardCallback


def test_the_old_import_path_gives_the_same_class() -> None:
    from hf_precision.engine.guard import GuardFrontEnd as old

    assert old is GuardFrontEnd and guard.GuardFrontEnd is GuardFrontEnd
    assert issubclass(PrecisionGuardCallback, GuardFrontEnd)
    assert issubclass(PrecisionGuardPlugin, GuardFrontEnd)
    with pytest.raises(AttributeError):
        guard.NoSuchName  # noqa: B018


def test_a_bad_preset_fails_when_the_front_end_is_built() -> None:
    with pytest.raises(PrecisionError):
        PrecisionGuardCallback("bf17")
