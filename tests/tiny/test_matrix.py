"""hf_precision/tiny/matrix.py: docs/matrix.md's column for the installed transformers is what
running the matrix gives now (the 4.57 leg checks its own column: tests/tiny is in TF4_TESTS)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hf_precision.tiny.matrix import COLUMNS, SETUPS, column_key, parse, render, stale

ROOT = Path(__file__).resolve().parents[2]


def test_the_matrix_column_of_this_transformers_is_current():
    # a fresh interpreter: nothing another test registered or patched changes a cell
    run = subprocess.run(
        [sys.executable, "-m", "hf_precision.tiny.matrix", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    cells = parse((ROOT / "docs" / "matrix.md").read_text())[0][column_key()]
    assert all(any(k[1] == s.name for k in cells) for s in SETUPS)  # every setup is there


def test_render_keeps_the_other_column_and_parses_back():
    cells = {COLUMNS[0]: {("llava", "split"): "runs → watches (nothing to do)"}, COLUMNS[1]: {}}
    text = render(cells, {COLUMNS[0]: "5.24.0"})
    assert "python -m hf_precision.tiny.matrix" in text  # the one command, in the header
    parsed, versions = parse(text)
    assert parsed[COLUMNS[0]] == cells[COLUMNS[0]] and parsed[COLUMNS[1]] == {}
    assert versions == {COLUMNS[0]: "5.24.0"}
    assert "| llava | split | runs → watches (nothing to do) | not run |" in text
    assert "1 runs; 0 fail or lose precision without the guard" in text  # the summary
    ours = column_key()
    changed = {c: {("llava", "split"): "runs → casts 1 tensor(s)"} for c in COLUMNS}
    assert stale(render(changed, {}), text) == (
        ["llava / split: 'runs → watches (nothing to do)' -> now 'runs → casts 1 tensor(s)'"]
        if ours == COLUMNS[0]
        else ["llava / split: None -> now 'runs → casts 1 tensor(s)'"]
    )
