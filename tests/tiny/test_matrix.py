"""hf_precision/tiny/matrix.py: docs/matrix.md's column for the installed transformers is what
running the matrix gives now (the 4.57 leg checks its own column: tests/tiny is in TF4_TESTS)."""

from __future__ import annotations

from pathlib import Path

from hf_precision.tiny.matrix import COLUMNS, SETUPS, column_key, generate, parse, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "matrix.md"


def test_the_matrix_column_of_this_transformers_is_current():
    new, old = generate(DOC)
    key = column_key()
    fresh, stale = parse(new)[0][key], parse(old)[0][key]
    changed = sorted(k for k in fresh.keys() | stale.keys() if fresh.get(k) != stale.get(k))
    assert not changed, (
        f"docs/matrix.md is stale for {key} in {len(changed)} cell(s), first "
        f"{changed[0]}: {stale.get(changed[0])!r} -> now {fresh.get(changed[0])!r}.\n"
        "Fix: PYTHONPATH=. python -m hf_precision.tiny.matrix (in this venv)"
    )
    assert all(any(k[1] == s.name for k in fresh) for s in SETUPS)  # every setup ran


def test_render_keeps_the_other_column_and_parses_back():
    cells = {COLUMNS[0]: {("llava", "split"): "runs → watches (nothing to do)"}, COLUMNS[1]: {}}
    text = render(cells, {COLUMNS[0]: "5.24.0"})
    assert "python -m hf_precision.tiny.matrix" in text  # the one command, in the header
    parsed, versions = parse(text)
    assert parsed[COLUMNS[0]] == cells[COLUMNS[0]] and parsed[COLUMNS[1]] == {}
    assert versions == {COLUMNS[0]: "5.24.0"}
    assert "| llava | split | runs → watches (nothing to do) | not run |" in text
