"""The fast walk behind ``dtype_map`` (``DtypeTally``) gives the same map, key order included, as
a plain per-parameter reference: the records and group summaries of every tiny layout, with
mixed dtypes, frozen parts, a packed int8 weight, tied weights, a direct group parameter, a
list-held tower, ``torch.compile`` names, the meta device and a ZeRO-3-partitioned parameter."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import PrecisionPolicy, dtype_map, find_module_groups
from hf_precision.base.wrapper_kinds import clean_name, unwrap_model
from hf_precision.model.module_records import DtypeTally
from hf_precision.model.view import ModelView
from hf_precision.rules.dtypes import dtype_name, is_quantized
from hf_precision.rules.groups.group_rule import OTHER
from hf_precision.rules.groups.module_groups import ModuleGroups, hidden_module
from hf_precision.tiny import (
    OmniLMMTiny,
    tiny_llava,
    tiny_llava_next,
    tiny_paligemma,
    tiny_qwen2_vl,
)


def _walk(root: nn.Module, groups: ModuleGroups) -> list[tuple[str, nn.Module, str]]:
    """named_modules(remove_duplicate=False), then the list-held group modules."""
    tops = [("", root, OTHER)] + [
        (p, m, g) for g, p in groups.hidden.items() if (m := hidden_module(root, p)) is not None
    ]
    out: list[tuple[str, nn.Module, str]] = []
    for top_path, top, top_group in tops:
        group_at: dict[str, str] = {}
        for raw, mod in top.named_modules(prefix=top_path, remove_duplicate=False):
            path = clean_name(raw)
            parent = raw.rsplit(".", 1)[0] if "." in raw else None
            inherited = group_at.get(parent, top_group) if parent is not None else top_group
            group = groups.by_path.get(path) or (
                inherited if path else groups.by_path.get("", OTHER)
            )
            group_at[raw] = group
            out.append((path, mod, group))
    return out


def _reference(model: nn.Module) -> dict[str, Any]:
    """The map as plain loops build it: one parameter at a time, record and summary side by side
    (unquantized tensors and packed int8 storage: what these models hold)."""
    root, _ = unwrap_model(model)
    groups = find_module_groups(root)
    records: dict[str, dict[str, Any]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    seen: dict[int, str] = {}

    def summary(group: str) -> dict[str, Any]:
        return summaries.setdefault(group, _blank_summary(group))

    def add(d: dict[str, int], key: str, n: int) -> None:
        d[key] = d.get(key, 0) + n

    for path, mod, group in _walk(root, groups):
        rec: dict[str, Any] | None = None
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            full = f"{path}.{pname}" if path else pname
            pgroup = groups.by_path.get(full, group) if groups.params else group
            rec = rec or _blank_record(path, pgroup, type(mod).__name__)
            if id(p) in seen:
                rec["tied"].append(f"{pname} -> {seen[id(p)]}")
                continue
            seen[id(p)] = full
            n, dtype = p.numel(), p.dtype
            if hasattr(p, "ds_id"):
                n, dtype = p.ds_numel, p.ds_tensor.dtype
            dt, nbytes, dev = dtype_name(dtype), n * p.element_size(), str(p.device)
            s = summary(pgroup)
            for counts, value in ((rec["params"], n), (s["numel"], n)):
                add(counts, dt, value)
            for counts in (rec["bytes"], s["bytes"]):
                add(counts, dt, nbytes)
            for devs in (rec["devices"], s["devices"]):
                if dev not in devs:
                    devs.append(dev)
            if p.requires_grad:
                rec["trainable"] += n
                s["trainable"] += n
                add(s["trainable_numel"], dt, n)
            if is_quantized(p):
                rec["quantized"] += n
                s["quantized"] += n
            if hasattr(p, "ds_id"):
                rec["sharded"] += n
        for b in mod._buffers.values():
            if b is None:
                continue
            rec = rec or _blank_record(path, group, type(mod).__name__)
            dt, nbytes = dtype_name(b.dtype), b.numel() * b.element_size()
            add(rec["buffers"], dt, b.numel())
            add(rec["bytes"], dt, nbytes)
            add(summary(group)["bytes"], dt, nbytes)
        if rec is not None and path not in records:
            records[path] = rec
            summary(rec["group"])["modules"] += 1
    order = {g: i for i, g in enumerate((*groups.names, OTHER))}
    ordered = dict(sorted(summaries.items(), key=lambda kv: order.get(kv[0], len(order))))
    return {"records": records, "groups": ordered, "rule": groups.rule}


def _blank_record(path: str, group: str, type_name: str) -> dict[str, Any]:
    return {
        **{"path": path, "group": group, "type": type_name, "params": {}, "bytes": {}},
        **{"buffers": {}, "devices": [], "trainable": 0, "quantized": 0, "sharded": 0},
        **{"tied": [], "kept_fp32": None, "fp8": None},
    }


def _blank_summary(group: str) -> dict[str, Any]:
    return {
        **{"group": group, "numel": {}, "bytes": {}, "devices": [], "trainable": 0},
        **{"quantized": 0, "modules": 0, "trainable_numel": {}, "fp8": [], "compute": ""},
    }


def _mixed_llava() -> nn.Module:
    model = tiny_llava()
    model.model.vision_tower.to(torch.bfloat16).requires_grad_(False)
    model.lm_head.to(torch.float16)
    q = nn.Parameter(torch.zeros(8, 8, dtype=torch.int8), requires_grad=False)
    model.lm_head.register_parameter("qweight", q)
    linear = model.model.multi_modal_projector.linear_1
    linear.weight.requires_grad_(False)  # a module half frozen
    linear.register_buffer("scale", torch.zeros(3, dtype=torch.float16))
    return model


def _llava_next_half_newline() -> nn.Module:
    model = tiny_llava_next()
    model.model.image_newline.data = model.model.image_newline.data.half()
    return model


def _zero3_llava() -> nn.Module:
    """A parameter as DeepSpeed ZeRO-3 leaves it (empty, its partition in ``ds_tensor``)."""
    model = tiny_llava()
    p = model.model.language_model.layers[0].mlp.up_proj.weight
    p.ds_id, p.ds_numel, p.ds_tensor = 3, p.numel(), torch.zeros(4, dtype=torch.bfloat16)
    return model


def _meta_llava() -> nn.Module:
    with torch.device("meta"):
        return tiny_llava()


def _shared_module_llava() -> nn.Module:
    model = tiny_llava()
    layers = model.model.language_model.layers
    layers[0].mlp.shared = layers[1].mlp.up_proj  # one module under two paths
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llava": tiny_llava,
    "llava_mixed": _mixed_llava,
    "llava_next_half_newline": _llava_next_half_newline,
    "qwen2_vl": tiny_qwen2_vl,
    "paligemma_tied": tiny_paligemma,
    "omnilmm_list_held_tower": lambda: OmniLMMTiny(torch.float32),
    "llava_compiled": lambda: torch.compile(tiny_llava()),
    "llava_meta": _meta_llava,
    "llava_zero3": _zero3_llava,
    "llava_shared_module": _shared_module_llava,
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_fast_walk_gives_the_reference_map_in_the_same_order(name: str) -> None:
    model = MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the list-held tower warns
        expected = _reference(model)
        got = dtype_map(model).to_dict()
        viewed = dtype_map(model, view=ModelView.of(model)).to_dict()
    got_records = {p: {**r} for p, r in got["records"].items()}
    # json.dumps keeps key order: the records, their dtypes and the groups in walk order
    assert json.dumps(got_records) == json.dumps(expected["records"])
    assert json.dumps(got["groups"]) == json.dumps(expected["groups"])
    assert got["rule"] == expected["rule"]
    # the event's view walks named_modules() (shared modules once): same groups, same counts
    assert json.dumps(viewed["groups"]) == json.dumps(got["groups"]) or name.endswith("module")


def test_a_policy_names_the_kept_modules_on_the_same_counts() -> None:
    model = _mixed_llava()
    plain = dtype_map(model)
    kept = dtype_map(model, policy=PrecisionPolicy.from_preset("bf16"))
    assert json.dumps(kept.to_dict()["groups"]) == json.dumps(plain.to_dict()["groups"])
    assert kept.records["model.language_model.rotary_emb"].kept_fp32 == "rotary inv_freq buffer"
    assert all(r.kept_fp32 is None for r in plain.records.values())


def test_the_tally_walks_each_module_that_owns_tensors_once_in_order() -> None:
    model = tiny_llava()
    tally = DtypeTally(model, find_module_groups(model), None)
    walked = [path for path, _, _ in tally.walk(model)]
    expected = [p for p, m in model.named_modules() if m._parameters or m._buffers]
    assert walked == expected
    tally.count(tally.walk(model))
    records, summaries = tally.result()
    assert list(records) == expected
    assert list(summaries) == ["vision_encoder", "projector", "language_model", "lm_head"]
    assert summaries["lm_head"].modules == 1
