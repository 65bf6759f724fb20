"""The ``*_full_eval`` stash: exact CPU copies of what an in-place ``model.to(eval_dtype)`` would
round, most precious first, up to a byte limit
(:meth:`~hf_precision.engine.guard.PrecisionGuard.stash`
keeps them, :meth:`~hf_precision.engine.guard.PrecisionGuard.restore` gives their values back).

>>> import torch
>>> from hf_precision import PrecisionPolicy
>>> from hf_precision.tiny import tiny_llava
>>> model = tiny_llava()
>>> fp32 = PrecisionPolicy.from_preset("fp32")
>>> kept, said = stash_tensors(model, fp32, set(), torch.bfloat16, 2**30)
>>> floating = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
>>> len(kept) == len(floating), said
(True, None)
"""

from __future__ import annotations

import torch
from torch import nn

from ..rules.dtypes import dtype_name
from ..rules.keep_rules import model_keep_lists
from ..rules.policy.precision_policy import PrecisionPolicy

__all__ = ["stash_tensors"]

_WHAT = ("trainable weight(s)", "tensor(s) the policy keeps in float32", "frozen tensor(s)")


def _tiers(
    root: nn.Module, policy: PrecisionPolicy, kept: set[str], eval_dtype: torch.dtype
) -> tuple[list[tuple[str, torch.Tensor]], ...]:
    """Floating tensors not in ``eval_dtype``: trainable weights, then what the policy keeps in
    float32 (``kept``: what the last plan kept), then the other frozen tensors."""
    model_keep, strict = model_keep_lists(root)
    tiers: tuple[list[tuple[str, torch.Tensor]], ...] = ([], [], [])
    for kind, named in (("param", root.named_parameters()), ("buffer", root.named_buffers())):
        for name, t in named:
            if not t.is_floating_point() or t.dtype == eval_dtype or t.device.type == "meta":
                continue
            if kind == "param" and t.requires_grad:
                tiers[0].append((name, t))
            elif name in kept or policy.keep_fp32_reason(
                name, is_buffer=kind == "buffer", model_patterns=model_keep, strict_patterns=strict
            ):
                tiers[1].append((name, t))
            else:
                tiers[2].append((name, t))
    return tiers


def stash_tensors(
    root: nn.Module,
    policy: PrecisionPolicy,
    kept: set[str],
    eval_dtype: torch.dtype,
    limit_bytes: int,
) -> tuple[dict[str, torch.Tensor], str | None]:
    """CPU copies of what fits in ``limit_bytes``, and the warning for what does not (``None``
    when everything fits): those tensors come back in their dtype with rounded values."""
    keep: dict[str, torch.Tensor] = {}
    left: list[tuple[str, int]] = [("", 0)] * 3  # per tier: (first name, bytes) left out
    counts = [0, 0, 0]
    total = 0
    for k, tier in enumerate(_tiers(root, policy, kept, eval_dtype)):
        for name, t in tier:
            size = t.numel() * t.element_size()
            if total + size > limit_bytes:
                counts[k] += 1
                left[k] = (left[k][0] or name, left[k][1] + size)
                continue
            keep[name] = t
            total += size
    copies = {k: v.detach().to("cpu", copy=True) for k, v in keep.items()}
    if not any(counts):
        return copies, None
    lost = "; ".join(
        f"{n} {_WHAT[k]} ({left[k][1] / 2**20:.0f} MiB, e.g. {left[k][0]})"
        for k, n in enumerate(counts)
        if n
    )
    ev = dtype_name(eval_dtype)
    return copies, (
        f"{ev}_full_eval casts the model to {ev} in place. The guard keeps exact copies "
        f"of {len(copies)} tensor(s) ({total / 2**20:.0f} MiB) to give their values "
        f"back after the evaluation, up to its {limit_bytes / 2**30:.1f} GiB limit; "
        f"these do not fit and come back in their dtype with {ev}-rounded values: "
        f"{lost}. Fix: drop {ev}_full_eval (evaluation then runs under autocast), "
        f"load the frozen weights in {ev}, or train LoRA."
    )
