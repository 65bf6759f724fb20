"""The sampler-trainer gap (hf_precision.watch.rl_gap) on hand-made log-probs and on a real
transformers model's ``generate`` against its own forward, with and without autocast."""

from __future__ import annotations

import math

import pytest
import torch

from hf_precision.tiny import tiny_text_llama
from hf_precision.watch.rl_gap import (
    Correction,
    GapRecord,
    GapWatch,
    gap_record,
    measure_gap,
    sampler_logps,
)


def test_gap_record_figures_and_the_corrections_share():
    s = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]])
    t = torch.tensor([[-1.0, -0.5, -0.5], [-0.1, -0.2, -0.3]])  # +1.5 nats on one token
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    r = gap_record(t, s, mask)
    assert (r.tokens, r.sequences) == (5, 2)
    assert r.mean_abs == pytest.approx(1.5 / 5) and r.max_abs == pytest.approx(1.5)
    assert r.k3 == pytest.approx((math.expm1(1.5) - 1.5) / 5)
    assert r.corrected_share is None
    # exp(1.5) = 4.48 > 3: TRL's default sequence_mask masks the first sequence, not the second
    seq = gap_record(t, s, mask, correction=Correction("sequence_mask", None, 3.0))
    assert seq.corrected_share == 0.5 and seq.corrected_tokens == pytest.approx(3 / 5)
    tok = gap_record(t, s, mask, correction=Correction("token_truncate", 0.5, 3.0))
    assert tok.corrected_share == 0.5 and tok.corrected_tokens == pytest.approx(1 / 5)
    assert "sequence_mask would mask 50% of sequences" in seq.line()
    assert "token_truncate would clip" in tok.line()


def test_nan_sampler_logps_and_empty_masks_are_left_out():
    s = torch.tensor([[float("nan"), -1.0]])
    r = gap_record(torch.tensor([[-3.0, -1.25]]), s)
    assert r.tokens == 1 and r.max_abs == 0.25
    empty = gap_record(s, s, torch.zeros(1, 2))
    assert empty == GapRecord(0, 0, 0.0, 0.0, 0.0)


def test_gap_watch_weights_by_tokens_and_keeps_the_largest_max():
    w = GapWatch(steps=2)
    w.add(GapRecord(10, 2, 0.1, 0.5, 0.01, 0.0, 0.0))
    assert not w.done
    w.add(GapRecord(30, 2, 0.2, 0.3, 0.02, 1.0, 0.5))
    r = w.result()
    assert w.done and r is not None
    assert r.tokens == 40 and r.mean_abs == pytest.approx(0.175) and r.max_abs == 0.5
    assert r.corrected_share == 0.5 and r.corrected_tokens == pytest.approx(15 / 40)


def _generated(model, temperature: float = 1.0):
    torch.manual_seed(0)
    prompt = torch.randint(3, 100, (2, 5))
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=True,
        temperature=temperature,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    completion = out.sequences[:, prompt.size(1) :]
    return out.sequences, sampler_logps(out.logits, completion, temperature)


def test_generate_logits_against_the_forward_same_and_different_numerics():
    """A real model: ``generate``'s raw logits give the log-probs its forward gives (fp32 both
    sides: the KV cache only); scoring under bf16 autocast opens a gap, at the temperature too."""
    model = tiny_text_llama(torch.float32).eval()
    seqs, s = _generated(model, temperature=0.7)
    same = measure_gap(model, seqs, s, temperature=0.7, source="generate logits")
    assert same.tokens == 12 and same.max_abs < 1e-4 and same.source == "generate logits"
    bf16 = measure_gap(
        model, seqs, s, temperature=0.7, autocast=torch.autocast("cpu", dtype=torch.bfloat16)
    )
    assert bf16.mean_abs > 100 * max(same.mean_abs, 1e-7)
    wrong_t = measure_gap(model, seqs, s, temperature=1.0)
    assert wrong_t.mean_abs > 10 * max(same.mean_abs, 1e-7)


def test_measure_gap_takes_the_trainers_own_scoring():
    model = tiny_text_llama(torch.float32).eval()
    seqs, s = _generated(model)
    calls = []

    def score(m, ids, mask, keep, **kw):
        calls.append((ids.shape, keep, kw))
        return s + 0.5

    r = measure_gap(model, seqs, s, score=score, correction=Correction("token_mask", None, 1.5))
    assert calls == [(seqs.shape, 6, {})]
    assert r.mean_abs == pytest.approx(0.5) and r.corrected_share == 1.0


def test_generate_tap_returns_the_ids_keeps_the_logits_and_leaves_the_config_alone():
    from transformers import GenerationConfig

    from hf_precision.watch.rl_gap import GenerateTap

    model = tiny_text_llama(torch.float32).eval()
    tap = GenerateTap(model).attach()
    torch.manual_seed(1)
    config = GenerationConfig(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    prompt = torch.randint(3, 100, (2, 5))
    ids = model.generate(input_ids=prompt, generation_config=config)
    assert isinstance(ids, torch.Tensor) and ids.shape == (2, 9)
    assert not config.return_dict_in_generate and not config.output_logits
    completion = ids[:, 5:]
    s = tap.completion_logps(completion, torch.ones_like(completion))
    assert s is not None and s.shape == (2, 4)
    assert measure_gap(model, ids, s).max_abs < 1e-4
    assert tap.completion_logps(completion.flip(1), torch.ones_like(completion)) is None
    tap.detach()
    assert "generate" not in vars(model)
