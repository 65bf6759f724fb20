"""Where the activation dtype changed (``hf_precision.watch.trace``): an fp32 buffer promoting the
bf16 stream of a real tiny LLaMA (as Gemma 4's ``std_bias``), traced to that buffer by
``trace_forward``, by the callback's ``trace=True`` event under a real ``Trainer`` and by
``hf-precision doctor --trace``; an fp32 norm named as a norm; the picture."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision.report.plot import PICTURE_SIZE, plot_trace, png_size
from hf_precision.tiny import tiny_text_llama
from hf_precision.watch.trace import DtypeTrace, trace_forward

PROMOTER = "model.layers.0.mlp"


class StdBiasMLP(nn.Module):
    """An MLP whose output is multiplied by a float32 buffer, as Gemma 4's ``std_bias``."""

    def __init__(self, mlp: nn.Module, hidden: int) -> None:
        super().__init__()
        self.mlp = mlp
        self.register_buffer("std_bias", torch.ones(hidden, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) * self.std_bias


def _promoting_llama() -> nn.Module:
    model = tiny_text_llama(torch.bfloat16)
    layer = model.model.layers[0]
    layer.mlp = StdBiasMLP(layer.mlp, model.config.hidden_size)
    return model


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(4, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _hooks(model: nn.Module) -> int:
    """The model's forward hooks, less the one-shot hooks that record what ran at the next
    forward (``watch/what_ran``: every event puts them, the forward takes them)."""
    hooks = [h for m in model.modules() for h in m._forward_hooks.values()]
    return sum(not getattr(h, "__qualname__", "").startswith("ComputeWatch.") for h in hooks)


def test_an_fp32_buffer_promoting_a_bf16_stream_is_traced_to_the_buffer() -> None:
    model = _promoting_llama()
    trace = trace_forward(model, **_batch(), autocast=torch.bfloat16)
    first = trace.first_change
    assert first is not None and trace.error is None
    assert (first.module, first.module_type) == (PROMOTER, "StdBiasMLP")
    assert (first.before, first.after) == ("bfloat16", "float32")
    assert (first.cause, first.detail) == ("buffer", "std_bias (float32)")
    # everything before it kept the stream bf16: the embedding, layer 0's attention and MLP
    before = [r for r in trace.records if r.index < first.index and r.inputs]
    assert before and all(r.outputs[0] == "bfloat16" for r in before if r.outputs)
    assert "mlp.down_proj" in {r.module.removeprefix(PROMOTER + ".") for r in before}
    assert f"first at {PROMOTER} (StdBiasMLP): bfloat16 -> float32, made by its buffer" in (
        trace.line()
    )
    assert _hooks(model) == 0


def test_without_autocast_the_trace_stops_at_the_error_and_still_names_the_buffer() -> None:
    model = _promoting_llama()
    trace = trace_forward(model, **_batch())
    assert trace.error is not None and "dtype" in trace.error  # q_proj of layer 1: fp32 input
    assert trace.first_change is not None and trace.first_change.module == PROMOTER
    assert trace.first_change.cause == "buffer" and _hooks(model) == 0


def test_an_fp32_norm_in_a_bf16_model_is_named_as_a_norm() -> None:
    model = tiny_text_llama(torch.bfloat16)
    model.model.layers[1].post_attention_layernorm.float()
    trace = trace_forward(model, **_batch(), autocast=torch.bfloat16)
    first = trace.first_change
    assert first is not None
    assert first.module == "model.layers.1.post_attention_layernorm"
    assert (first.before, first.after, first.cause) == ("bfloat16", "float32", "norm")
    assert first.detail == "LlamaRMSNorm returning float32"


def test_callback_trace_records_the_first_training_step(make_trainer: Any, said: Any) -> None:
    from hf_precision import PrecisionGuardCallback

    model = _promoting_llama()
    # audit: the guard reports and casts nothing (in fix mode it would cast the frozen buffer
    # to bf16 and the stream would stay bf16)
    cb = PrecisionGuardCallback(mode="audit", trace=True)
    trainer = make_trainer(model, _batch(), callbacks=[cb], max_steps=2, bf16=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        trainer.train()
    assert said.about("made by its buffer std_bias (float32)")  # logging, at INFO
    assert model.model.layers[0].mlp.std_bias.dtype == torch.float32
    first = cb.trace_result.first_change
    assert (first.module, first.cause, first.detail) == (PROMOTER, "buffer", "std_bias (float32)")
    assert _hooks(model) == 0, "the trace hooks come off after the one forward"
    out = Path(trainer.args.output_dir) / "precision"
    record = json.loads((out / "000001-trace.json").read_text())["trace"]
    assert record["first_change"]["module"] == PROMOTER
    assert record["first_change"]["detail"] == "std_bias (float32)"
    assert png_size((out / "000001-trace.png").read_bytes()) == PICTURE_SIZE
    assert "made by its buffer std_bias (float32)" in (out / "precision.log").read_text()


def test_the_picture_is_a_strip_of_the_modules(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace = trace_forward(_promoting_llama(), **_batch(), autocast=torch.bfloat16)
    png = plot_trace(trace, tmp_path / "t.png", title="trace")
    assert png_size(png) == PICTURE_SIZE and (tmp_path / "t.png").read_bytes() == png
    assert png == plot_trace(trace, title="trace"), "the same trace, the same bytes"


def test_a_trace_records_one_forward_only() -> None:
    model = _promoting_llama()
    trace = DtypeTrace(model)
    assert trace.hooks_installed() == len(list(model.modules()))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(**_batch())
        n = len(trace.records)
        model(**_batch())
    assert len(trace.records) == n and trace.done and _hooks(model) == 0


def test_doctor_trace(capsys: Any) -> None:
    from hf_precision.tools.cli import main

    assert main(["doctor", "llama", "--policy", "bf16", "--trace", "--no-generate"]) == 0
    out = capsys.readouterr().out
    assert "hf-precision trace:" in out and "module forward(s) recorded" in out
    assert main(["doctor", "llama", "--policy", "bf16", "--trace", "--json", "--no-generate"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trace"]["records"] and "line" in data["trace"]
