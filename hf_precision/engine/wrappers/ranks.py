"""Several processes, one policy: rank agreement, wrapper detection, DeepSpeed config checks.

* :func:`check_ranks_agree` gathers every rank's :meth:`DtypeMap.digest` (``all_gather_object``)
  and raises a :class:`PrecisionError` naming the ranks and modules that differ. Without an
  initialised process group (or with one process) it returns at once.
* :func:`detect_wrapper` says who holds the parameters: ``"FSDP2"`` (``fully_shard``, DTensor
  parameters), ``"FSDP"`` (FSDP1), ``"DeepSpeed"``, ``"DDP"`` or ``None``, each one record of
  :data:`~hf_precision.base.wrapper_kinds.WRAPPERS`. After such a wrapper exists the guard never
  casts parameters it owns; it verifies and explains (:func:`~.check.check_wrapped`,
  :func:`~.check.explain_wrapped`).
* :func:`wrapper_compute_dtypes` maps each FSDP-owned parameter to the dtype FSDP computes it in
  (``MixedPrecisionPolicy.param_dtype``), which is not its storage dtype.
* :func:`compare_deepspeed_dtypes` and the config checks read the DeepSpeed JSON through
  :mod:`hf_precision.rules.deepspeed_config`.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import Counter
from typing import Any

import torch
from torch import nn

from ...base.wrapper_kinds import (
    clean_name,
    wrapper_kind,
    wrapper_of,
)
from ...errors import PrecisionError, PrecisionWarning
from ...model.dtype_maps import DtypeMap, dtype_map
from ...model.view import ModelView
from ...rules.dtypes import dtype_name, zero3_dtype
from ...rules.groups.module_groups import ModuleGroups
from ..records import Change

_MAX_LISTED = 8
__all__ = [
    "check_model_ranks",
    "check_ranks_agree",
    "ddp_restore_error",
    "gather_objects",
    "is_distributed",
    "rank",
    "rank_digest",
]

# ------------------------------------------------------------------------------- processes


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialised."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather_objects(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]``; ``[obj]`` in a single process. Collective."""
    if not is_distributed():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _signatures(dmap: DtypeMap, *, with_numel: bool = True) -> dict[str, tuple[Any, ...]]:
    """What :meth:`DtypeMap.digest` hashes, per module (device indices dropped). Without numel
    (FSDP1 flat shards, ZeRO-3 partitions: each rank holds a different slice) only the dtypes
    and devices are compared."""
    out: dict[str, tuple[Any, ...]] = {}
    for path, r in dmap.records.items():
        devs = tuple(sorted({d.split(":")[0] for d in r.devices}))
        if with_numel:
            out[path] = (
                tuple(sorted(r.params.items())),
                tuple(sorted(r.buffers.items())),
                devs,
                r.trainable,
            )
        else:  # a rank may hold no element of a parameter: trainable counts say nothing here
            out[path] = (
                tuple((d, 0) for d in sorted(r.params)),
                tuple((d, 0) for d in sorted(r.buffers)),
                devs,
                "-",
            )
    return out


def rank_digest(dmap: DtypeMap, *, with_numel: bool = True) -> str:
    """:meth:`DtypeMap.digest`, or its numel-free variant for wrappers that shard in place."""
    if with_numel:
        return dmap.digest()
    text = repr(sorted(_signatures(dmap, with_numel=False).items())).encode()
    return hashlib.sha256(text).hexdigest()[:16]


def _describe(sig: tuple[Any, ...] | None) -> str:
    if sig is None:
        return "(absent)"
    params, buffers, devices, trainable = sig
    dts = "/".join(d for d, _ in params) or "-"
    bufs = f", buffers {'/'.join(d for d, _ in buffers)}" if buffers else ""
    train = f", {trainable} trainable" if trainable != "-" else ""
    return f"{dts}{bufs} on {'/'.join(devices) or '-'}{train}"


def check_ranks_agree(
    dmap: DtypeMap, *, where: str = "check_ranks_agree", with_numel: bool = True
) -> None:
    """Raise :class:`PrecisionError` unless every rank holds the same dtype map. Collective:
    every rank must call it at the same point.

    Digests travel first (16 characters per rank); only when they differ do the per-module
    signatures follow, so the error can name the modules. The reference is the digest most
    ranks share (rank 0's on a tie).

    >>> from hf_precision import dtype_map
    >>> from hf_precision.tiny import tiny_llava
    >>> check_ranks_agree(dtype_map(tiny_llava()))  # one process: nothing to compare
    """
    if not is_distributed():
        return
    digests = gather_objects(rank_digest(dmap, with_numel=with_numel))
    if len(set(digests)) == 1:
        return
    # every rank saw the same digests, so all of them enter this second collective
    sigs = gather_objects(_signatures(dmap, with_numel=with_numel))
    counts = Counter(digests)
    ref_digest = max(counts, key=lambda d: (counts[d], -digests.index(d)))
    ref = digests.index(ref_digest)
    bad = [r for r, d in enumerate(digests) if d != ref_digest]
    lines = []
    for r in bad:
        paths = sorted(set(sigs[ref]) | set(sigs[r]))
        diff = [p for p in paths if sigs[ref].get(p) != sigs[r].get(p)]
        lines.append(f"rank {r} differs from rank {ref} in {len(diff)} module(s):")
        for p in diff[:_MAX_LISTED]:
            lines.append(
                f"    {p or '<model>'}: rank {ref} {_describe(sigs[ref].get(p))}; "
                f"rank {r} {_describe(sigs[r].get(p))}"
            )
        if len(diff) > _MAX_LISTED:
            lines.append(f"    ... and {len(diff) - _MAX_LISTED} more")
    raise PrecisionError(
        f"{where}: the ranks disagree on the model's dtypes (digests "
        f"{', '.join(f'rank {r}={d}' for r, d in enumerate(digests))}):\n  "
        + "\n  ".join(lines)
        + "\nFix: every rank must load, freeze and cast the model the same way and use the same "
        "policy (look for code under `if accelerator.is_main_process:` / `if rank == 0:` that "
        "changes the model, or a policy read from a per-rank setting)."
    )


def check_model_ranks(
    model: nn.Module,
    groups: ModuleGroups | None = None,
    *,
    policy: Any = None,
    where: str = "check_model_ranks",
    view: ModelView | None = None,
    dmap: DtypeMap | None = None,
) -> None:
    """:func:`check_ranks_agree` on ``dtype_map(model)``; free in a single process. ``view``:
    the event's walk; ``dmap``: the event's map when the reporter made it already (one map
    per event)."""
    if is_distributed():
        mods = view.modules_of(model) if view is not None else None
        kind = wrapper_kind(wrapper_of(model, mods))
        in_place = kind is not None and kind.slices_per_rank  # per-rank slices: numel differs
        if dmap is None:
            dmap = dtype_map(model, groups, policy=policy, view=view)
        check_ranks_agree(dmap, where=where, with_numel=not in_place)


def check_zero3_split(view: ModelView, where: str, mode: str) -> None:
    """Refuse (warn in mode ``audit``) a model whose ZeRO-3 partitions hold trainable weights in
    more than one dtype: ZeRO-3 flattens every trainable partition into one buffer of one dtype
    (DeepSpeed's ``defragment`` asserts on it), and the partitions belong to DeepSpeed, so the
    guard cannot cast them. A model built after ``Accelerator``/``TrainingArguments`` turned
    ZeRO-3 on is partitioned at construction (``deepspeed.zero.Init``): its split is frozen in."""
    params = [p for p in view.parameters() if hasattr(p, "ds_id") and p.requires_grad]
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(zero3_dtype(p) or p.dtype, []).append(p)
    if len(by_dtype) < 2:
        return
    names = {id(p): clean_name(n) for n, p in view.root.named_parameters()}
    parts = "; ".join(
        f"{len(ps)} in {dtype_name(d)} (e.g. {names.get(id(ps[0]), '?')})"
        for d, ps in sorted(by_dtype.items(), key=lambda kv: -len(kv[1]))
    )
    msg = (
        f"{where}: DeepSpeed ZeRO-3 partitioned the trainable weights in {len(by_dtype)} dtypes "
        f"({parts}); ZeRO-3 flattens them into one buffer of one dtype and fails "
        "(`assert len(set(t.dtype for t in tensors)) == 1`), and the partitions are DeepSpeed's: "
        "the guard does not cast them. Fix: load the model in one dtype "
        "(from_pretrained(..., dtype=torch.bfloat16)), or build it before the "
        "Accelerator / TrainingArguments that enable ZeRO-3, so the guard casts it first."
    )
    if mode == "audit":
        warnings.warn(msg, PrecisionWarning, stacklevel=3)
    else:
        raise PrecisionError(msg)


def ddp_restore_error(
    changes: list[Change],
    ref: dict[int, torch.dtype],
    root: nn.Module,
    *,
    where: str,
    name: str,
) -> PrecisionError | None:
    """The error for planned parameter changes that do not go back to the dtypes DDP built its
    gradient buckets for (``ref``: ``id(parameter)`` -> dtype at wrapping time); ``None`` when
    every change does."""
    named = dict(root.named_parameters())
    bad = [
        c
        for c in changes
        if c.kind == "param"
        and c.name in named
        and dtype_name(ref.get(id(named[c.name]), named[c.name].dtype)) != c.after
    ]
    if not bad:
        return None
    return PrecisionError(
        f"{where}: {len(bad)} parameter(s) would change dtype under DDP, whose gradient "
        "buckets were built for the dtypes at wrapping time:\n  "
        + "\n  ".join(c.describe() for c in bad[:_MAX_LISTED])
        + f"\nFix: let {name} cast before the model is wrapped (keep it in the "
        "callbacks / call guard.prepare before accelerator.prepare), or load the model "
        "in the policy's dtypes."
    )
