"""A rotary table rounded to a half dtype (a ``model.to(bf16)``), recomputed in float32 from the
rotary module's config: the exact values the plan writes instead of an upcast that cannot give
the lost bits back (:meth:`hf_precision.engine.plan._Planner.plan`, rule ``rotary``)."""

from __future__ import annotations

import torch
from torch import nn

from ..rules.dtypes import dtype_name

__all__ = ["recomputed_rotary", "rounded_rotary"]


def recomputed_rotary(mod: nn.Module, key: str, t: torch.Tensor) -> torch.Tensor | None:
    """``mod.<key>`` recomputed in float32 by building the rotary module again from its config
    (transformers' rotary modules keep ``config`` and compute their tables in ``__init__``:
    ``rope_init_fn`` / ``compute_default_rope_parameters``); ``None`` when the module cannot,
    or when the fresh table, rounded, is not what the model holds (a table changed on purpose,
    e.g. by dynamic RoPE scaling, is not replaced)."""
    config = getattr(mod, "config", None)
    if config is None:
        return None
    try:
        with torch.device("cpu"):
            fresh = type(mod)(config)
    except Exception:  # a constructor that needs more than the config: cannot recompute
        return None
    value = fresh._buffers.get(key)
    if value is None or value.shape != t.shape or not value.is_floating_point():
        return None
    value = value.detach().float()
    held = t.detach().to("cpu")
    # the same table rounded, once or through another half dtype (bf16, then fp16)
    chains = ((t.dtype,), (torch.bfloat16, t.dtype), (torch.float16, t.dtype))
    for chain in chains:
        rounded = value
        for dt in chain:
            rounded = rounded.to(dt)
        if torch.equal(rounded, held):
            return value
    return None


def rounded_rotary(
    mod: nn.Module, key: str, t: torch.Tensor, full: str, group: str
) -> tuple[torch.Tensor | None, str, str | None]:
    """A rotary table found in a lower precision (a ``model.to(bf16)`` rounded it): its
    exact values recomputed from the config where the rotary module can (the same table,
    rounded, equals what the model holds), else a warning that the upcast cannot give the
    lost bits back (returned: the value, the reason, the warning)."""
    was = dtype_name(t.dtype)
    value = recomputed_rotary(mod, key, t)
    if value is not None:
        return value, f"rotary table rounded to {was}: recomputed from the config", None
    warning = (
        f"{full} [{group}]: this rotary table was already rounded to {was} "
        f"({type(mod).__name__}, e.g. by model.to({t.dtype})); the guard keeps it in "
        "float32 from now on, but an upcast cannot restore the lost bits, and the table "
        "cannot be recomputed (its module keeps no config, or the config's table rounded "
        "is not what it holds). Fix: load the model with "
        f"from_pretrained(..., dtype={t.dtype}), which keeps rotary tables in float32, "
        f"instead of casting the whole model with .to({t.dtype})."
    )
    return None, f"rotary table rounded to {was}: upcast, the lost bits cannot be restored", warning
