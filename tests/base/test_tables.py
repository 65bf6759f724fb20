"""The one text-table renderer: plain columns, or rich when asked or installed."""

from __future__ import annotations

import pytest

from hf_precision.base.tables import fmt_bytes, render_table

COLUMNS = ["group", "dtypes", "params"]
ROWS = [["vision_encoder", "bfloat16", "21,536"], ["lm_head", "float32", "8,192"]]


def test_plain_columns_align_and_right_justify() -> None:
    text = render_table(COLUMNS, ROWS, title="dtypes", right=(2,), use_rich=False)
    lines = text.splitlines()
    assert lines[0] == "dtypes"
    assert lines[1] == "group           dtypes    params"
    assert lines[2] == "--------------  --------  ------"
    assert lines[3] == "vision_encoder  bfloat16  21,536"
    assert lines[4] == "lm_head         float32    8,192"  # right-aligned numbers
    assert all(line == line.rstrip() for line in lines)


def test_rich_draws_the_same_cells_with_its_title() -> None:
    pytest.importorskip("rich")
    text = render_table(COLUMNS, ROWS, title="dtypes", use_rich=True, width=80)
    assert text.splitlines()[0].strip() == "dtypes"
    for row in ROWS:
        line = next(x for x in text.splitlines() if row[0] in x)
        assert all(cell in line for cell in row)
    assert render_table(COLUMNS, ROWS, title="dtypes", width=80) == text  # None: rich if there


def test_fmt_bytes_units() -> None:
    assert [fmt_bytes(n) for n in (0, 1023, 1024, 1536, 2**20, 3 * 2**30)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "1.0 MiB",
        "3.0 GiB",
    ]
