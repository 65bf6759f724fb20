"""hf_precision.tools.audit_files: the table printer the audit tool uses."""

from __future__ import annotations

from hf_precision.tools.audit_files import print_table


def test_print_table_plain_prints_every_cell(capsys) -> None:
    print_table("t", ["group", "dtype", "count"], [["vision_encoder", "float32", "12"]], True)
    out = capsys.readouterr().out
    assert "vision_encoder" in out and "float32" in out and "12" in out
