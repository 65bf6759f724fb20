"""One event's text block: the table, or one line while the map is unchanged."""

from __future__ import annotations

from hf_precision import dtype_map
from hf_precision.report.rows import module_table_rows
from hf_precision.report.snapshot import EventSnapshot
from hf_precision.tiny import tiny_llava


def _snap(**kw: object) -> EventSnapshot:
    dmap = dtype_map(tiny_llava())
    rows, folded = module_table_rows(dmap, max_rows=5)
    fields: dict = dict(
        event="on_evaluate",
        step=7,
        policy=None,
        report=None,
        dmap=dmap,
        drift=[],
        rows=rows,
        aggregated=folded,
        first=False,
        stem="000007-on_evaluate",
    )
    return EventSnapshot(**{**fields, **kw})  # type: ignore[arg-type]


def test_the_text_names_the_event_the_unchanged_map_and_the_folded_rows() -> None:
    full = _snap()
    assert full.text().startswith("hf-precision on_evaluate (step 7)")
    assert f"{full.aggregated} of {len(full.dmap)} module rows aggregated" in full.text()
    same = _snap(unchanged_since=("on_train_begin", 0))
    assert same.text().splitlines()[0] == (
        "hf-precision on_evaluate (step 7): dtypes/devices unchanged since on_train_begin "
        "(step 0); 000007-on_evaluate.json"
    )
    assert same.mismatches == {"found": 0, "repaired": 0, "open": 0}
