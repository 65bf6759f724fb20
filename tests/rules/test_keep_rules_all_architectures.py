"""No harm to what transformers keeps in float32, on every architecture that declares it.

Generated like the matrix: every modeling module of the installed transformers whose source
declares a non-empty ``_keep_in_fp32_modules`` or ``_keep_in_fp32_modules_strict`` is imported;
its top model class (``*ForConditionalGeneration``, else ``*ForCausalLM``, else ``*Model``) is
built from its default config shrunk to a few dozen units (one shrink table for all), then
"loaded" as ``from_pretrained(dtype=...)`` loads it: every floating tensor in the load dtype but
those the loader's dtype plan keeps in float32 (``PreTrainedModel._get_dtype_plan``: the strict
list for bf16 and fp16 loads, the non-strict list for fp16 loads; a pattern selects every name it
is found in, as the loader's regex search does). ``enforce_policy`` then applies ``bf16`` /
``fp16`` to the frozen model: the tensors the loader kept are float32 and bit-exact afterwards,
and under bf16 the non-strict ones the loader left in bf16 are not upcast. No forward runs.

Architectures that do not build tiny are skipped with the error as the reason (and counted in
:func:`test_most_declaring_architectures_build_tiny`).
"""

from __future__ import annotations

import importlib
import re
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import PrecisionPolicy, enforce_policy

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("keep_rules_all_architectures")  # built once per worker

_DECLARES = re.compile(r"_keep_in_fp32_modules(_strict)?\s*=\s*[\[{(]\s*[\"']")
#: config fields set to at most these values (on the config and its sub-configs)
_SHRINK = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 128,
    "moe_intermediate_size": 16,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
    "d_model": 32,
    "d_ff": 64,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "d_kv": 16,
    "num_heads": 2,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 32,
    "decoder_ffn_dim": 32,
    "depth": 1,
    "embed_dim": 32,
    "projection_dim": 32,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "topk_group": 1,
    "n_group": 1,
    "out_hidden_size": 32,
    "attention_hidden_size": 32,
}
#: what the shrunk model may hold; larger ones (the table missed a size field) are skipped
_MAX_PARAMS = 4_000_000
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _modules() -> list[str]:
    models = Path(transformers.__file__).parent / "models"
    return [
        f"transformers.models.{f.parent.name}.{f.stem}"
        for f in sorted(models.glob("*/modeling_*.py"))
        if _DECLARES.search(f.read_text(encoding="utf-8"))
    ]


MODULES = _modules()


def _shrink(config: Any, depth: int = 0) -> None:
    for key, most in _SHRINK.items():
        now = getattr(config, key, None)
        if isinstance(now, int) and not isinstance(now, bool) and now > most:
            try:
                setattr(config, key, most)
            except Exception:  # a per-layer or derived attribute: left as it is
                pass
    vocab = getattr(config, "vocab_size", None)
    for key in _TOKEN_IDS:  # token ids beyond the shrunk vocabulary
        now = getattr(config, key, None)
        if isinstance(vocab, int) and isinstance(now, int) and now >= vocab:
            setattr(config, key, 0)
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict") and depth < 3:
            _shrink(sub, depth + 1)


def _top_class(module_name: str) -> type[nn.Module]:
    from transformers import PreTrainedModel

    mod = importlib.import_module(module_name)
    declaring = [
        c
        for c in vars(mod).values()
        if isinstance(c, type)
        and issubclass(c, PreTrainedModel)
        and c.__module__ == module_name
        and not c.__name__.endswith("PreTrainedModel")
        and (c._keep_in_fp32_modules or c._keep_in_fp32_modules_strict)
    ]
    for suffix in ("ForConditionalGeneration", "ForCausalLM", "Model"):
        for cls in declaring:
            if cls.__name__.endswith(suffix):
                return cls
    raise LookupError(f"no top model class among {[c.__name__ for c in declaring]}")


@cache
def _built(module_name: str) -> nn.Module | str:
    """The tiny model in float32 (frozen), or why it does not build."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    try:
        cls = _top_class(module_name)
        config = cls.config_class()  # type: ignore[attr-defined]
        _shrink(config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):  # its size first, at no cost
                sized = cls(config)
            n = sum(p.numel() for p in sized.parameters())
            if n > _MAX_PARAMS:
                big = max(sized.named_parameters(), key=lambda kv: kv[1].numel())
                return (
                    f"{n / 1e6:.0f}M parameters after the shrink (the table misses a size "
                    f"field: {big[0]} {tuple(big[1].shape)})"
                )
            torch.manual_seed(0)
            model = cls(config)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]
    return model.requires_grad_(False)


def _loader_keeps(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """The patterns ``from_pretrained(dtype=dtype)`` keeps in float32 (its dtype plan)."""
    strict = list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    loose = list(getattr(model, "_keep_in_fp32_modules", None) or ())
    return strict + loose if dtype == torch.float16 else strict


def _matches(patterns: list[str], name: str) -> bool:
    return any(re.search(p.replace("*", ".*"), name) for p in patterns)


def _load(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast ``model`` as the loader would, the kept tensors filled with float32 values that no
    half dtype holds; returns {name: exact copy} of the kept tensors."""
    kept = _loader_keeps(model, dtype)
    gen = torch.Generator().manual_seed(1)
    exact: dict[str, torch.Tensor] = {}
    for mname, mod in model.named_modules():
        for store in (mod._parameters, mod._buffers):
            for key, t in store.items():
                if t is None or not t.is_floating_point():
                    continue
                name = f"{mname}.{key}" if mname else key
                with torch.no_grad():
                    if _matches(kept, name):
                        value = (torch.rand(t.shape, generator=gen) - 0.5) * 2 + 1e-4
                        t.data = value.float()
                        exact.setdefault(name, t.detach().clone())
                    else:
                        t.data = t.data.to(dtype)
    return exact


CASES = [(m, preset) for m in MODULES for preset in ("bf16", "fp16")]


@pytest.mark.parametrize(
    ("module_name", "preset"), CASES, ids=[f"{m.split('.')[2]}-{p}" for m, p in CASES]
)
def test_enforce_keeps_what_the_loader_kept_bit_exact(module_name: str, preset: str) -> None:
    import copy

    built = _built(module_name)
    if isinstance(built, str):
        pytest.skip(f"does not build tiny: {built}")
    model = copy.deepcopy(built)
    dtype = torch.bfloat16 if preset == "bf16" else torch.float16
    exact = _load(model, dtype)
    if not exact and not _load(copy.deepcopy(built), torch.float16):
        pytest.skip(f"{type(model).__name__}: no tensor of the tiny model is on its keep lists")
    enforce_policy(model, PrecisionPolicy.from_preset(preset, mode="fix"))
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    wrong = {
        n: str(named[n].dtype)
        for n, value in exact.items()
        if n in named and (named[n].dtype != torch.float32 or not torch.equal(named[n], value))
    }
    assert not wrong, f"{type(model).__name__} under {preset}: {wrong}"
    if preset == "bf16":  # what the loader left in bf16 stays bf16 (nothing upcast)
        loose = list(getattr(model, "_keep_in_fp32_modules", None) or ())
        up = [
            n
            for n, t in named.items()
            if n not in exact
            and _matches(loose, n)
            and t.dtype == torch.float32
            and t.is_floating_point()
            and "inv_freq" not in n
        ]
        assert not up, f"{type(model).__name__}: upcast what the loader left in bf16: {up[:3]}"


def test_most_declaring_architectures_build_tiny() -> None:
    """The sweep covers what it says: the skipped ones are few and listed here."""
    skipped = {m.split(".")[2]: r for m in MODULES if isinstance(r := _built(m), str)}
    assert len(MODULES) >= 10
    assert len(skipped) <= len(MODULES) // 3, skipped
