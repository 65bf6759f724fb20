"""``SyncIntegrity``: PEFT's merge/unmerge round trip on a bf16 base drifts the frozen weights
(TRL 6688), an in-place ``model.to(bf16)`` is found and restored in the same Parameter objects,
and the wrappers come off."""

from __future__ import annotations

from typing import Any

import torch

from hf_precision.engine.sync_integrity import FIXES, SyncIntegrity


def test_merge_unmerge_round_trips_drift_a_bf16_base(lora_llama: Any):
    model = lora_llama()
    watch = SyncIntegrity(model, sample=256)
    watch.round_trip(model, "merge_adapter", "unmerge_adapter", event="sync")
    for _ in range(20):
        model.merge_adapter()
        model.unmerge_adapter()
    assert len(watch.findings) == 20
    first, last = watch.findings[0], watch.findings[-1]
    assert 0 < first.changed_share < 0.5 and first.max_drift > 0
    assert all(".base_layer." in n for n in first.changed_tensors)
    assert last.total_max_drift >= first.max_drift and last.calls == 20
    assert FIXES["round_trip"] in first.line() and "sync changed" in first.line()
    watch.remove()
    assert "merge_adapter" not in vars(model) and "unmerge_adapter" not in vars(model)


def test_an_fp32_base_round_trip_is_not_reported_as_a_dtype_change(lora_llama: Any):
    model = lora_llama(torch.float32)
    watch = SyncIntegrity(model)
    watch.round_trip(model, "merge_adapter", "unmerge_adapter", event="sync")
    model.merge_adapter()
    model.unmerge_adapter()
    assert all(not f.dtype_changes for f in watch.findings)


class _Generator:
    """Holds the model and casts it in place, as TRL 1.16's continuous-batching generate."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def generate(self) -> str:
        self.model.to(torch.bfloat16)
        return "done"


def test_an_in_place_cast_is_restored_in_the_same_parameters(lora_llama: Any):
    model = lora_llama()
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    values = {n: p.detach().clone() for n, p in adapters.items()}
    opt = torch.optim.AdamW(adapters.values(), lr=1e-5)
    gen = _Generator(model)
    said: list[Any] = []
    watch = SyncIntegrity(model, on_finding=said.append)
    watch.around(gen, "generate", event="generation", restore=True)
    assert gen.generate() == "done"
    (found,) = said
    assert found.restored == len(adapters) == len(found.dtype_changes)
    assert {(a, b) for _, a, b, _ in found.dtype_changes} == {("float32", "bfloat16")}
    assert "restored" in found.line() and "use_transformers_continuous_batching" in found.line()
    for n, p in model.named_parameters():
        if n in adapters:
            assert p is adapters[n] and p.dtype == torch.float32 and torch.equal(p, values[n])
    assert [p for g in opt.param_groups for p in g["params"]] == list(adapters.values())
    watch.remove()
    assert "generate" not in vars(gen)


def test_without_restore_the_cast_is_said_and_left(lora_llama: Any):
    model = lora_llama()
    gen = _Generator(model)
    watch = SyncIntegrity(model)
    watch.around(gen, "generate", event="generation")
    gen.generate()
    assert watch.findings[0].restored == 0 and "left as they are" in watch.findings[0].line()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
