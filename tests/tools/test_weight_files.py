"""Weight files read without their data: headers checked against the file, stored dtypes,
adapter and diffusers folders; the old path (``tools.checkpoint``) names the same functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_precision.tools.weight_files import (
    adapter_module_path,
    read_adapter,
    read_header,
    stored_dtypes,
)


def test_the_headers_give_the_stored_dtypes_and_no_data(tmp_path: Path) -> None:
    save_file(
        {"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(3, dtype=torch.int64)},
        str(tmp_path / "model.safetensors"),
    )
    assert stored_dtypes(tmp_path) == {"a": torch.bfloat16}
    assert read_header(tmp_path / "model.safetensors")["b"]["shape"] == [3]


def test_a_truncated_file_is_exit_code_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(64)}, str(path))
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(SystemExit) as stop:
        read_header(path)
    assert stop.value.code == 3
    assert "truncated" in capsys.readouterr().err


def test_an_adapter_folder_and_its_module_paths(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({key: torch.zeros(4, 8)}, str(tmp_path / "adapter_model.safetensors"))
    adapter = read_adapter(tmp_path)
    assert adapter["config"] == {"r": 4}
    assert adapter["tensors"][key]["dtype"] == "F32"
    assert adapter_module_path(key) == "model.layers.0.self_attn.q_proj"
