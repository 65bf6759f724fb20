"""Several processes, one policy: rank agreement, wrapper detection, DeepSpeed config checks.

* :func:`check_ranks_agree` gathers every rank's :meth:`DtypeMap.digest` (``all_gather_object``)
  and raises a :class:`PrecisionError` naming the ranks and modules that differ. Without an
  initialised process group (or with one process) it returns at once.
* :func:`detect_wrapper` says who holds the parameters: ``"FSDP2"`` (``fully_shard``, DTensor
  parameters), ``"FSDP"`` (FSDP1), ``"DeepSpeed"``, ``"DDP"`` or ``None``. After such a wrapper
  exists the guard never casts parameters it owns; it verifies and explains.
* :func:`wrapper_compute_dtypes` maps each FSDP-owned parameter to the dtype FSDP computes it in
  (``MixedPrecisionPolicy.param_dtype``), which is not its storage dtype.
* :func:`check_deepspeed_config` (from :mod:`hf_precision.engine.deepspeed_config`) checks a
  DeepSpeed
  JSON's ``bf16``/``fp16`` sections against the ``--bf16``/``--fp16`` flags (the LLaVA
  "``--bf16 True`` but the JSON says fp16" failure), ``"auto"`` understood, without DeepSpeed.

>>> from hf_precision.engine.distributed import check_deepspeed_config
>>> check_deepspeed_config({"bf16": {"enabled": "auto"}}, bf16=True, fp16=False)
torch.bfloat16
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..base.wrappers import (
    WRAPPERS,
    clean_name,
    detect_wrapper,
    planned_wrapper,
    settle_shards,
    unwrap_model,
    wrapper_compute_dtypes,
    wrapper_of,
)
from ..errors import PrecisionError, PrecisionWarning
from ..model.dtype_maps import DtypeMap, dtype_map
from ..model.view import ModelView, walk_modules
from ..rules.dtypes import dtype_name, is_castable, zero3_dtype
from ..rules.groups import ModuleGroups, find_module_groups
from ..rules.keep_rules import model_keep_lists
from ..rules.policy import PrecisionPolicy, tensor_role
from .deepspeed_config import (
    check_deepspeed_config,
    check_training_args,
    deepspeed_config_of,
    load_deepspeed_config,
)
from .enforce import Change, EnforceReport
from .plan import group_compute_dtypes

_MAX_LISTED = 8
__all__ = [
    "WRAPPERS",
    "WrapperCheck",
    "check_deepspeed_config",
    "check_model_ranks",
    "check_ranks_agree",
    "check_training_args",
    "check_wrapped",
    "ddp_restore_error",
    "deepspeed_config_of",
    "detect_wrapper",
    "explain_wrapped",
    "gather_objects",
    "is_distributed",
    "load_deepspeed_config",
    "planned_wrapper",
    "rank",
    "rank_digest",
    "settle_shards",
    "wrapper_compute_dtypes",
    "wrapper_of",
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
        in_place = wrapper_of(model, mods) in (
            "FSDP",
            "DeepSpeed",
        )  # per-rank slices: numel differs
        if dmap is None:
            dmap = dtype_map(model, groups, policy=policy, view=view)
        check_ranks_agree(dmap, where=where, with_numel=not in_place)


@dataclass
class WrapperCheck:
    """What :func:`check_wrapped` found on a model a wrapper holds (nothing was cast)."""

    wrapper: str
    violations: list[str] = field(default_factory=list)  # the policy is broken: cannot cast
    names: set[str] = field(default_factory=set)  # parameters behind the violations
    expected: dict[str, int] = field(default_factory=dict)  # why deviations are fine -> count
    notes: list[str] = field(default_factory=list)  # allowed but worth a warning
    #: parameters the wrapper itself cast against the policy (a keep-fp32 or fp32 group held in
    #: DeepSpeed's dtype): (name, group, held dtype, wanted dtype, rule)
    casts: list[tuple[str, str, torch.dtype, torch.dtype, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.violations)

    def cast_message(self, where: str) -> str:
        """One message naming what the wrapper cast against the policy, and the fix."""
        by_group: dict[str, list[str]] = {}
        for name, group, _, _, _ in self.casts:
            by_group.setdefault(group, []).append(name)
        _, _, held, want, rule = self.casts[0]
        listed = "; ".join(f"{g}: {len(n)} parameter(s), e.g. {n[0]}" for g, n in by_group.items())
        fix = (
            "DeepSpeed casts every parameter to the dtype its config enables when the engine "
            "is built (bf16/fp16 'enabled'), and has no setting that keeps one module in "
            "float32. Fix: accept it by dropping the float32 rule (keep_fp32 / group_dtypes) "
            "from the policy, or train that part without DeepSpeed's half precision "
            "(bf16/fp16 'enabled': false and autocast)"
            if self.wrapper == "DeepSpeed"
            else f"Fix: configure {self.wrapper}'s mixed precision to leave these parameters in "
            f"{dtype_name(want)}, or drop the rule from the policy"
        )
        return (
            f"{where}: {self.wrapper} holds {len(self.casts)} parameter(s) in "
            f"{dtype_name(held)} that the policy keeps in {dtype_name(want)} ({rule}): "
            f"{listed}. {fix}; mode='raise' stops here instead of warning."
        )

    def error(self, where: str, policy: PrecisionPolicy) -> PrecisionError:
        listed = self.violations[:_MAX_LISTED]
        more = len(self.violations) - len(listed)
        return PrecisionError(
            f"{where}: {len(self.violations)} parameter(s) violate {policy.describe()} and "
            f"{self.wrapper} holds them, so the guard will not cast them:\n  "
            + "\n  ".join(listed + ([f"... and {more} more"] if more > 0 else []))
            + "\nFix: let the guard cast before wrapping (guard.prepare(accelerator, model, ...) "
            "or PrecisionGuardCallback in Trainer(callbacks=[...])), or load the model in the "
            "policy's dtypes; for FSDP set MixedPrecisionPolicy(param_dtype=...) to the policy's "
            "compute dtype."
        )


def check_wrapped(
    model: nn.Module,
    policy: PrecisionPolicy,
    groups: ModuleGroups | None = None,
    *,
    wrapper: str | None = None,
    deepspeed_dtype: torch.dtype | None = None,
    master_fp32: torch.dtype | None = None,
) -> WrapperCheck:
    """Verify, without casting, a model FSDP (1 or 2) or DeepSpeed holds.

    Expected and not drift: FSDP's upcast of trainable parameters to fp32 (accelerate does it,
    the fp32 copy is the master weight); weights stored in one dtype that FSDP mixed precision
    computes in the policy's dtype; DeepSpeed holding every weight in its config's dtype (its
    optimizer keeps fp32 master weights; ``master_fp32``, the half dtype of a ZeRO-3 run, says
    so per tensor: rule ``wrapper_master_fp32``). Anything else is a violation.
    """
    settle_shards(model)  # after an evaluation FSDP2's root unit holds unsharded bf16 views
    root, _ = unwrap_model(model)
    groups = groups or find_module_groups(root)
    wrapper = wrapper or wrapper_of(model) or "the wrapper"
    compute = wrapper_compute_dtypes(model)
    keep, strict = model_keep_lists(root)
    out = WrapperCheck(wrapper)
    walk = list(walk_modules(root, groups))
    owners = {id(p): (m, k) for _, _, m in walk for k, p in m._parameters.items() if p is not None}
    group_dtype = group_compute_dtypes(groups, walk)
    for raw, p in root.named_parameters():
        if not is_castable(p):
            continue
        name = clean_name(raw)
        group = groups.group_of(name)
        mod, key = owners.get(id(p), (None, ""))
        decision = policy.decide(
            name,
            group,
            trainable=p.requires_grad,
            model_patterns=keep,
            strict_patterns=strict,
            current=zero3_dtype(p) or p.dtype,
            role=tensor_role(mod, key, p, is_buffer=False) if mod is not None else None,
            group_dtype=group_dtype.get(group),
            master_fp32=master_fp32,
        )
        target, reason = decision.dtype, decision.reason
        storage = zero3_dtype(p) or p.dtype
        runs = compute.get(id(p), storage)
        ds_cast = (
            wrapper == "DeepSpeed" and storage != target and storage == (deepspeed_dtype or storage)
        )
        if decision.keeps_fp32:
            if storage == target == runs:
                continue
            if ds_cast:
                out.casts.append((name, group, storage, target, reason))
                continue
            if storage == target or wrapper == "DeepSpeed":
                out.notes.append(
                    f"{name} [{group}] should stay float32 ({reason}) but {wrapper} "
                    f"computes it in {dtype_name(runs)}"
                )
                continue
            why = None
        elif ds_cast and not p.requires_grad and target == torch.float32:
            out.casts.append((name, group, storage, target, reason))
            continue
        elif runs not in (target, policy.compute_dtype):
            why = None
        elif storage == target:
            continue
        elif runs == target:
            why = f"stored {dtype_name(storage)}, computed {dtype_name(runs)} by {wrapper}"
        elif wrapper in ("FSDP", "FSDP2") and p.requires_grad and storage == torch.float32:
            why = f"trainable weights upcast to float32 by {wrapper} (master weights)"
        elif wrapper == "DeepSpeed" and storage == (deepspeed_dtype or storage):
            why = f"held in {dtype_name(storage)} by DeepSpeed (fp32 master weights: optimizer)"
        else:
            why = None
        if why is not None:
            out.expected[why] = out.expected.get(why, 0) + 1
            continue
        how = f", computed in {dtype_name(runs)}" if runs != storage else ""
        out.names.add(name)
        out.violations.append(
            f"{name} [{group}]: {dtype_name(storage)}{how}; the policy wants "
            f"{dtype_name(target)} ({reason})"
        )
    return out


def explain_wrapped(
    model: nn.Module,
    policy: PrecisionPolicy,
    groups: ModuleGroups,
    audit: EnforceReport,
    *,
    args: Any = None,
    where: str,
    wrapper: str | None = None,
    check: WrapperCheck | None = None,
) -> EnforceReport:
    """Drop from an audit what FSDP/DeepSpeed do on purpose (see :func:`check_wrapped`); raise
    for the rest unless the policy only audits. What the wrapper cast against the policy (a
    keep-fp32 group held in bf16) is listed in ``wrapper_casts`` with a message (with the fix)
    in ``wrapper_note``, and raised in ``raise`` mode. Without such a wrapper ``audit`` is
    returned. ``wrapper`` and ``check`` skip the detection and the check when the caller has
    them."""
    wrapper = wrapper or detect_wrapper(model, args=args)
    if wrapper not in ("FSDP", "FSDP2", "DeepSpeed"):
        return audit
    if check is None:
        check = check_wrapped(
            model,
            policy,
            groups,
            wrapper=wrapper,
            deepspeed_dtype=check_training_args(args) if args is not None else None,
        )
    if check and policy.mode != "audit":
        raise check.error(where, policy)
    if check.casts and policy.mode == "raise":
        raise PrecisionError(check.cast_message(where))
    kept = copy.copy(audit)
    kept.wrapper_note = check.cast_message(where) if check.casts else None
    kept.changes = [c for c in audit.changes if clean_name(c.name) in check.names]
    kept.wrapper_casts = [
        Change(
            name,
            "param",
            group,
            dtype_name(held),
            dtype_name(want),
            f"cast by {wrapper}; the policy wants {dtype_name(want)} ({rule})",
        )
        for name, group, held, want, rule in check.casts
    ]
    return kept


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
