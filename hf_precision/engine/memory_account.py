"""What each precision decision costs or saves in bytes.

Computed from a plan (:class:`~hf_precision.engine.records.EnforceReport`): every change is
``numel × (new itemsize − old itemsize)``, summed per kind of decision (trainable weights upcast,
frozen weights cast down or up, buffers); every tensor a keep rule held in float32 costs
``numel × (4 − itemsize of the frozen dtype)`` against the cast it was spared, per rule; the
``*_full_eval`` stash is host memory (CPU copies); the guards hold no tensors (0). Beside them the
alternative a user would weigh: fp32 trainable weights where they are held in a half dtype
(+2 bytes an element; gradients and AdamW's two moments follow the weight's dtype, +6 more), or,
where the guard upcast trainables, what keeping them in half precision would save.

>>> import torch
>>> from hf_precision import enforce_policy
>>> from hf_precision.tiny import tiny_llava
>>> model = tiny_llava().to(torch.bfloat16)
>>> report = enforce_policy(model, "bf16")            # trainables bf16 -> fp32
>>> account = memory_account(report, model)
>>> account["decisions"]["trainable upcast"]["bytes"] == 2 * account["trainable_numel"]
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base.tables import fmt_bytes
from ..model.view import ModelView
from ..rules.dtypes import dtype_name
from .records import EnforceReport


def _itemsize(dtype: torch.dtype | str) -> int | None:
    d = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(d, torch.dtype):
        return None
    return torch.empty((), dtype=d).element_size()


def _tensors(root: nn.Module, view: ModelView | None) -> dict[str, torch.Tensor]:
    """Every buffer and parameter by name (parameters win a shared name), from ``view`` when
    the caller has the event's walk."""
    if view is None:
        out: dict[str, torch.Tensor] = dict(root.named_buffers(remove_duplicate=False))
        out.update(root.named_parameters(remove_duplicate=False))
        return out
    out = {}
    params: dict[str, torch.Tensor] = {}
    for path, _, mod in view.modules:
        prefix = f"{path}." if path else ""
        for attr, into in (("_buffers", out), ("_parameters", params)):
            for key, t in getattr(mod, attr).items():
                if t is not None:
                    into[prefix + key] = t
    out.update(params)
    return out


def _decision(kind: str, trainable: bool, grew: bool) -> str:
    if kind == "buffer":
        return "buffers " + ("upcast" if grew else "cast down")
    return ("trainable" if trainable else "frozen") + (" upcast" if grew else " cast down")


def memory_account(
    report: EnforceReport,
    root: nn.Module,
    *,
    stash_bytes: int = 0,
    view: ModelView | None = None,
) -> dict[str, Any]:
    """The bytes of each decision in ``report`` on ``root`` (see the module docstring); every
    figure is exact (bytes, positive = costs, negative = saves). ``view``: the event's walk of
    ``root``, when the caller has one."""
    tensors = _tensors(root, view if view is not None and view.root is root else None)
    decisions: dict[str, dict[str, int]] = {}
    for c in report.changes:
        t = tensors.get(c.name)
        old, new = _itemsize(c.before), _itemsize(c.after)
        if t is None or old is None or new is None or old == new:
            continue
        trainable = c.kind == "param" and t.requires_grad
        row = decisions.setdefault(_decision(c.kind, trainable, new > old), {"count": 0})
        row["count"] += 1
        row["bytes"] = row.get("bytes", 0) + t.numel() * (new - old)
    frozen = report.policy.frozen_dtype
    spared = 4 - ((_itemsize(frozen) if frozen is not None else None) or 4)
    kept: dict[str, dict[str, int]] = {}
    for name, _, rule, _ in report.kept:
        t = tensors.get(name)
        if t is None or t.dtype != torch.float32:  # kept in a half dtype: costs nothing extra
            continue
        row = kept.setdefault(rule, {"count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += t.numel() * spared
    params = view.parameters() if view is not None and view.root is root else root.parameters()
    trained = [p for p in params if p.requires_grad]
    numel = sum(p.numel() for p in trained)
    half = sum(p.numel() for p in trained if p.dtype in (torch.bfloat16, torch.float16))
    return {
        "decisions": decisions,
        "kept_fp32": kept,
        "kept_fp32_versus": dtype_name(frozen) if frozen is not None else None,
        "stash_host_bytes": stash_bytes,
        "guards_bytes": 0,
        "trainable_numel": numel,
        "alternative": _alternative(decisions, half),
    }


def _alternative(decisions: dict[str, dict[str, int]], half: int) -> dict[str, Any]:
    if half:
        return {
            "what": f"fp32 trainable weights instead of the {_count(half)} half-precision ones",
            "bytes": 2 * half,
            "with_grads_and_adamw_bytes": 8 * half,
        }
    up = decisions.get("trainable upcast", {}).get("bytes", 0)
    if up:
        return {
            "what": "keeping the upcast trainable weights in half precision (updates below "
            "their resolution are lost)",
            "bytes": -up,
            "with_grads_and_adamw_bytes": -4 * up,
        }
    return {}


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f} B"
    if n >= 1e6:
        return f"{n / 1e6:.1f} M"
    if n >= 1e3:
        return f"{n / 1e3:.1f} k"
    return str(n)


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "−") + fmt_bytes(abs(n))


def account_line(account: dict[str, Any]) -> str:
    """The console line: ``hf-precision: memory: trainable upcast 18 tensor(s) +1.2 KiB; kept
    float32 (deliberate_fp32) 4 +64 B vs bfloat16; eval stash 0 B (host); guards 0 B; to weigh:
    ...``."""
    parts = [
        f"{what} {row['count']} tensor(s) {_signed(row['bytes'])}"
        for what, row in sorted(account["decisions"].items())
    ]
    versus = account["kept_fp32_versus"]
    parts += [
        f"kept float32 ({rule}) {row['count']} {_signed(row['bytes'])} vs {versus}"
        for rule, row in sorted(account["kept_fp32"].items())
        if row["bytes"] and rule != "rotary"  # every model's rotary tables: in the JSON only
    ]
    parts.append(f"eval stash {fmt_bytes(account['stash_host_bytes'])} (host)")
    parts.append("guards 0 B")
    alt = account["alternative"]
    if alt:
        parts.append(
            f"to weigh: {alt['what']}: {_signed(alt['bytes'])} "
            f"({_signed(alt['with_grads_and_adamw_bytes'])} with gradients and AdamW moments)"
        )
    return "hf-precision: memory: " + "; ".join(parts)
