"""hf_precision.tools.audit: the audit tool, run on parsed arguments (cli only parses and
dispatches)."""

from __future__ import annotations

import json

from hf_precision.tools import audit, cli


def test_cli_dispatches_audit_to_its_module(capsys) -> None:
    args = cli._parser().parse_args(["audit", "llava", "--dtype", "bf16", "--json"])
    assert args.run is cli._audit
    assert audit.audit(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] in ("bfloat16", "torch.bfloat16")


def test_a_violation_exits_1(capsys) -> None:
    args = cli._parser().parse_args(["audit", "llava", "--dtype", "fp32", "--json"])
    assert audit.audit(args) == 1
