"""``GuardFrontEnd`` (``hf_precision/frontends/frontend.py``): the front ends' shared base, with
the front ends (the engine knows nothing of it), and a bad preset refused when a front end is
built."""

from __future__ import annotations

import pytest

from hf_precision import PrecisionError
from hf_precision.engine import guard
from hf_precision.frontends.accelerate_plugin import PrecisionGuardPlugin
from hf_precision.frontends.callback import PrecisionGuardCallback
from hf_precision.frontends.frontend import GuardFrontEnd


def test_the_front_ends_share_one_base_that_the_engine_does_not_know() -> None:
    assert not hasattr(guard, "GuardFrontEnd")
    assert issubclass(PrecisionGuardCallback, GuardFrontEnd)
    assert issubclass(PrecisionGuardPlugin, GuardFrontEnd)


def test_a_bad_preset_fails_when_the_front_end_is_built() -> None:
    with pytest.raises(PrecisionError):
        PrecisionGuardCallback("bf17")
