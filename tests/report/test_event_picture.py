"""The event picture: drawn again only when what it shows changed; matplotlib missing is said
once and turns the picture off."""

from __future__ import annotations

import sys
import warnings

import pytest

from hf_precision import PrecisionWarning, dtype_map
from hf_precision.report.event_picture import EventPicture
from hf_precision.report.plot import PICTURE_SIZE, png_size
from hf_precision.tiny import tiny_llava


def test_the_same_map_is_the_same_picture_a_new_title_a_new_one() -> None:
    pytest.importorskip("matplotlib")
    model = tiny_llava()
    dmap = dtype_map(model)
    picture = EventPicture()
    first = picture.render(dmap, "setup", 0, None, None, model)
    assert first is not None and png_size(first) == PICTURE_SIZE
    assert picture.render(dmap, "setup", 0, None, None, model) is first
    assert picture.render(dmap, "setup", 1, None, None, model) is not first


def test_without_matplotlib_one_warning_then_no_picture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    model = tiny_llava()
    picture = EventPicture()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert picture.render(dtype_map(model), "setup", 0, None, None, model) is None
        assert picture.render(dtype_map(model), "setup", 1, None, None, model) is None
    msgs = [str(w.message) for w in record if issubclass(w.category, PrecisionWarning)]
    assert len(msgs) == 1 and "matplotlib is not installed" in msgs[0]
    assert not picture.enabled
