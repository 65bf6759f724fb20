"""The picture of a dtype map: its numbers add up to the map's bytes, it is a PNG of the fixed
size whatever the model, and ``png_size`` refuses what is not a PNG."""

from __future__ import annotations

import doctest
import io
from pathlib import Path

import pytest
import torch

from hf_precision import dtype_map, plot
from hf_precision.plot import PICTURE_SIZE, group_bytes, plot_group_bytes, png_size
from hf_precision.tiny import tiny_llava


def test_the_numbers_behind_the_picture_are_the_maps_bytes() -> None:
    model = tiny_llava()
    model.model.vision_tower.to(torch.bfloat16)
    dmap = dtype_map(model)
    groups, dtypes, table = group_bytes(dmap)
    assert groups == list(dmap.groups) and {"bfloat16", "float32", "int64"} == set(dtypes)
    vision = groups.index("vision_encoder")
    assert table["float32"][vision] == 0 and table["bfloat16"][vision] > 0
    for d in dtypes:
        assert sum(table[d]) == dmap.bytes_by_dtype[d], d


def test_the_picture_is_a_png_of_the_fixed_size_and_written_where_asked(tmp_path: Path) -> None:
    from PIL import Image

    path = tmp_path / "bytes.png"
    png = plot_group_bytes(dtype_map(tiny_llava()), path, title="tiny")
    assert path.read_bytes() == png and png_size(png) == PICTURE_SIZE
    with Image.open(io.BytesIO(png)) as img:
        img.verify()
    small = plot_group_bytes(dtype_map(torch.nn.Linear(2, 2)), size=(320, 200))
    assert png_size(small) == (320, 200)


def test_png_size_refuses_what_is_not_a_png() -> None:
    with pytest.raises(ValueError, match="not a PNG"):
        png_size(b"GIF89a" + bytes(30))


def test_module_doctest() -> None:
    result = doctest.testmod(plot, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
