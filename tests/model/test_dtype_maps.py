import json

import torch

from hf_precision import PrecisionPolicy, dtype_map
from hf_precision.model.dtype_maps import DtypeMap
from hf_precision.tiny import tiny_llava, tiny_paligemma


def test_records_groups_and_counts_match_parameters():
    model = tiny_llava()
    model.model.vision_tower.to(torch.bfloat16)
    m = dtype_map(model)
    assert m.groups["vision_encoder"].dtypes == ("bfloat16",)
    assert m.groups["language_model"].dtypes == ("float32",)
    total = sum(p.numel() for p in model.parameters())
    assert m.total_params == total
    rec = m.records["model.multi_modal_projector.linear_1"]
    assert rec.group == "projector" and rec.params == {"float32": 32 * 32 + 32}
    assert rec.trainable == 32 * 32 + 32
    # inv_freq (+ original_inv_freq in transformers 5), 4 frequencies each (head_dim 8)
    rotary = model.model.language_model.rotary_emb
    assert m.records["model.language_model.rotary_emb"].buffers == {
        "float32": 4 * len(list(rotary.buffers()))
    }
    assert m.bytes_by_dtype["bfloat16"] == 2 * sum(
        p.numel() for p in model.model.vision_tower.parameters()
    )


def test_tied_weights_not_double_counted():
    model = tiny_paligemma()
    m = dtype_map(model)
    assert m.total_params == sum(p.numel() for p in model.parameters())
    assert any(r.tied for r in m.records.values())


def test_diff_and_digest():
    model = tiny_llava()
    before = dtype_map(model)
    assert not before.diff(dtype_map(model))
    assert before.digest() == dtype_map(model).digest()
    model.model.multi_modal_projector.to(torch.float16)
    after = dtype_map(model)
    diff = before.diff(after)
    assert {c.path for c in diff} == {
        "model.multi_modal_projector.linear_1",
        "model.multi_modal_projector.linear_2",
    }
    assert "float32 on cpu -> float16 on cpu" in str(diff)
    assert before.digest() != after.digest()
    assert diff.to_rows()[0]["after"] == "float16"


def test_meta_model_no_data_read_and_json_round_trip():
    with torch.device("meta"):
        model = tiny_llava()
    m = dtype_map(model, policy=PrecisionPolicy.from_preset("bf16"))
    assert m.groups["language_model"].devices == ["meta"]
    again = DtypeMap.from_dict(json.loads(m.to_json()))
    assert not m.diff(again)
    assert m.records["model.language_model.rotary_emb"].kept_fp32 == "rotary inv_freq buffer"
    rows = m.module_rows()
    assert {r["path"] for r in rows} == set(m.records)
    assert "language_model" in m.table()


def test_quantized_counted():
    model = tiny_llava()
    q = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.int8), requires_grad=False)
    model.lm_head.register_parameter("qweight", q)
    m = dtype_map(model)
    assert m.groups["lm_head"].quantized == 64
    assert m.records["lm_head"].quantized == 64
    assert m.groups["lm_head"].numel["int8"] == 64


def test_a_dtype_map_of_what_is_not_a_model_says_so():
    import pytest

    from hf_precision import PrecisionError

    with pytest.raises(PrecisionError, match=r"^dtype_map\(model\): expected a torch.nn.Module"):
        dtype_map({"a": 1})


def test_groups_count_trainable_parameters_per_dtype():
    model = tiny_llava()
    model.model.vision_tower.requires_grad_(False)
    model.lm_head.to(torch.bfloat16)
    m = dtype_map(model)
    assert m.groups["vision_encoder"].trainable_numel == {}
    head = m.groups["lm_head"]
    assert head.trainable_numel == {"bfloat16": model.lm_head.weight.numel()} == head.numel
    again = DtypeMap.from_dict(json.loads(m.to_json()))
    assert again.groups["lm_head"].trainable_numel == head.trainable_numel
