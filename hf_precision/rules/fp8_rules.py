"""What stays out of fp8: the policy's ``keep_out_of_fp8`` and the one decision every converter
is fed from (accelerate's ``AORecipeKwargs`` filter, torchao's ``module_filter_fn``,
diffusers' ``skip_modules_pattern``) and the guard checks after ``prepare``.

An entry of ``keep_out_of_fp8`` is a group name (``vision_encoder``, ``projector``,
``lm_head``, ...), one of the words below, or a path pattern (exact, prefix, component,
``re:`` regex, as ``keep_fp32``):

- ``embeddings``: ``nn.Embedding`` and modules named ``*embed*`` (patch and position
  embeddings, ``embed_tokens``);
- ``norms``: norm layers;
- ``routers``: MoE routers (a module named ``gate`` or ``router``, never ``gate_proj``);
- ``adapters``: PEFT's adapter layers (``lora_A``, ``lora_B``, ...);
- ``first_last_blocks``: the first and the last numbered block of the language model (not in
  the defaults: torchtune's "the first and last layers are often sensitive").

A module a ``keep_fp32`` pattern keeps is out of fp8 too: its weights are fp32 because the user
asked for its precision.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from .policy.precedence import match_pattern

#: out of fp8 unless the policy says otherwise: every careful stack keeps these out
DEFAULT_KEEP_OUT_OF_FP8: tuple[str, ...] = (
    "vision_encoder",
    "audio_encoder",
    "resampler",
    "projector",
    "lm_head",
    "embeddings",
    "norms",
    "routers",
    "adapters",
)
WORDS = ("embeddings", "norms", "routers", "adapters", "first_last_blocks")
_ADAPTER_PREFIXES = ("lora_", "hada_", "lokr_", "ia3_", "oft_", "boft_", "vera_")
_BLOCK = re.compile(r"^(.*\.(?:layers|h|blocks|block|layer))\.(\d+)(?:\.|$)")


def _parts(path: str) -> list[str]:
    return path.split(".") if path else []


def _word(word: str, path: str, mod: nn.Module) -> bool:
    parts = _parts(path)
    low = [p.lower() for p in parts]
    if word == "embeddings":
        return isinstance(mod, nn.Embedding) or any("embed" in p for p in low)
    if word == "norms":
        return "norm" in type(mod).__name__.lower() or any(
            "norm" in p or p.startswith("ln_") for p in low
        )
    if word == "routers":
        return any(p in ("gate", "router") for p in low)
    if word == "adapters":
        return any(p.startswith(_ADAPTER_PREFIXES) for p in low)
    return False


def language_edge_blocks(paths: Iterable[tuple[str, str]]) -> set[str]:
    """The first and the last numbered block (``...layers.0``, ``...layers.N``) among the
    ``(path, group)`` pairs of the ``language_model`` group."""
    found: dict[str, list[int]] = {}
    for path, group in paths:
        if group != "language_model":
            continue
        m = _BLOCK.match(path)
        if m:
            found.setdefault(m.group(1), []).append(int(m.group(2)))
    out = set()
    for stem, idx in found.items():
        out.update({f"{stem}.{min(idx)}", f"{stem}.{max(idx)}"})
    return out


def keep_out_reason(
    entries: Iterable[str],
    path: str,
    group: str,
    mod: nn.Module,
    *,
    keep_fp32: Iterable[str] = (),
    edge_blocks: set[str] | frozenset[str] = frozenset(),
) -> str | None:
    """Why ``mod`` at ``path`` (in ``group``) stays out of fp8: ``"group projector"``,
    ``"adapters"``, ``"pattern re:.*mlp"``, ``"keep_fp32 model.multi_modal_projector"``,
    ``"first_last_blocks"``; ``None`` when it may run fp8.

    >>> keep_out_reason(DEFAULT_KEEP_OUT_OF_FP8, "model.lm_head", "lm_head", nn.Linear(2, 2))
    'group lm_head'
    """
    parts = _parts(path)
    for entry in entries:
        if entry == "first_last_blocks":
            if any(path == b or path.startswith(b + ".") for b in edge_blocks):
                return entry
        elif entry in WORDS:
            if _word(entry, path, mod):
                return entry
        elif entry == group or (entry == "lm_head" and "lm_head" in parts):
            return f"group {entry}"
        elif ("." in entry or entry.startswith("re:") or entry in parts) and match_pattern(
            entry, path
        ):
            return f"pattern {entry}"
    for pat in keep_fp32:
        if match_pattern(pat, path) or match_pattern(pat, f"{path}.weight"):
            return f"keep_fp32 {pat}"
    return None


__all__ = ["DEFAULT_KEEP_OUT_OF_FP8", "WORDS", "keep_out_reason", "language_edge_blocks"]
