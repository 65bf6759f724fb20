"""``--policy`` of ``hf-precision audit``/``doctor`` takes what every front end takes
(``parse_policy``): a preset name, a policy JSON file or JSON text."""

from __future__ import annotations

import json

import pytest

from hf_precision import PrecisionPolicy
from hf_precision.tools.cli import main


def _audit(capsys: pytest.CaptureFixture[str], policy: str) -> tuple[int, dict]:
    code = main(["audit", "llava", "--policy", policy, "--trainable", "none", "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_policy_file_or_json_text_audits_as_its_preset(tmp_path, capsys) -> None:
    policy = PrecisionPolicy.from_preset("bf16", group_dtypes={"vision_encoder": "fp32"})
    file = tmp_path / "policy.json"
    file.write_text(policy.to_json())
    by_file, by_text = _audit(capsys, str(file)), _audit(capsys, policy.to_json())
    assert by_file == by_text
    assert by_file[1]["policy"] == policy.to_dict()
    assert by_file[1]["policy"]["group_dtypes"] == {"vision_encoder": "float32"}


def test_a_bad_policy_file_is_one_line(tmp_path, capsys) -> None:
    file = tmp_path / "policy.json"
    file.write_text("{not json")
    assert main(["audit", "llava", "--policy", str(file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-precision: error: ") and "not valid JSON" in err
    assert err.count("\n") == 1
    assert main(["audit", "llava", "--policy", "bf61"]) == 2
    assert "a policy JSON file or JSON text" in capsys.readouterr().err
