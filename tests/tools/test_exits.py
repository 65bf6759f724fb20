"""How a command fails: one line on stderr, exit code 2 for bad input, 3 for weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_precision.tools.exits import EXIT_BAD_INPUT, EXIT_BAD_WEIGHTS, bad_weights, fail


def test_a_failure_is_one_line_and_its_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        fail("no such folder: ./x")
    assert stop.value.code == EXIT_BAD_INPUT == 2
    assert capsys.readouterr().err == "hf-precision: error: no such folder: ./x\n"


def test_unreadable_weights_have_their_own_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        bad_weights(Path("m/model.safetensors"), "the file is empty")
    assert stop.value.code == EXIT_BAD_WEIGHTS == 3
    err = capsys.readouterr().err
    assert (
        err
        == "hf-precision: error: m/model.safetensors: cannot read the weights: the file is empty\n"
    )
