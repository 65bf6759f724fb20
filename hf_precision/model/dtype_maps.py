"""Per-module dtype maps: what dtype and device every part of the model is in right now.

A :class:`DtypeMap` reads metadata only (dtype, shape, device, ``requires_grad``): no tensor data,
so it is cheap on a 70B model and works on the meta device.

>>> from hf_precision import dtype_map
>>> from hf_precision.tiny import tiny_llava
>>> m = dtype_map(tiny_llava())
>>> sorted(m.groups)
['language_model', 'lm_head', 'projector', 'vision_encoder']
>>> m.groups["vision_encoder"].dtypes
('float32',)
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..base.tables import fmt_bytes, render_table
from ..base.wrappers import clean_name, is_sharded, unwrap_model
from ..errors import check_model
from ..rules.dtypes import (
    dtype_name,
    is_quantized,
    logical_numel,
    quantized_format,
    storage_bytes,
    zero3_dtype,
)
from ..rules.groups import OTHER, ModuleGroups, find_module_groups, hidden_module
from ..rules.keep_rules import model_keep_lists
from ..rules.policy import tensor_role
from .view import ModelView, receiving

#: Tensor types that are never DTensors nor packed quantized storage.
_PLAIN = (nn.Parameter, torch.Tensor)


@dataclass
class ModuleRecord:
    """The tensors one module owns directly (not its children's)."""

    path: str
    group: str
    type: str
    # dtype -> numel; a library's quantized weights count under their format
    # ("bitsandbytes:nf4->bfloat16", see dtypes.quantized_format), with their storage bytes
    params: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)  # dtype -> bytes (params + buffers)
    buffers: dict[str, int] = field(default_factory=dict)  # dtype -> numel
    devices: list[str] = field(default_factory=list)
    trainable: int = 0
    quantized: int = 0
    sharded: int = 0  # numel held as DTensor (FSDP2) or ZeRO-3 partitions: the wrapper's dtype
    tied: list[str] = field(default_factory=list)  # "name -> first owner"
    kept_fp32: str | None = None

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(sorted(self.params))

    def signature(self) -> tuple[Any, ...]:
        return (
            self.group,
            tuple(sorted(self.params.items())),
            tuple(sorted(self.buffers.items())),
            tuple(self.devices),
            self.trainable,
        )


@dataclass
class GroupSummary:
    """Totals for one group."""

    group: str
    numel: dict[str, int] = field(default_factory=dict)  # dtype -> parameter numel
    bytes: dict[str, int] = field(default_factory=dict)  # dtype -> bytes (params + buffers)
    devices: list[str] = field(default_factory=list)
    trainable: int = 0
    quantized: int = 0
    modules: int = 0
    #: dtype -> numel of the trainable parameters (the rest of :attr:`numel` is frozen)
    trainable_numel: dict[str, int] = field(default_factory=dict)

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(sorted(self.numel))

    @property
    def mixed(self) -> bool:
        """More than one floating parameter dtype in the group."""
        return len([d for d in self.numel if d.startswith(("float", "bfloat"))]) > 1


@dataclass
class DtypeChange:
    path: str
    before: ModuleRecord | None
    after: ModuleRecord | None

    def describe(self) -> str:
        def fmt(r: ModuleRecord | None) -> str:
            if r is None:
                return "(absent)"
            dt = "/".join(r.dtypes) or "-"
            return f"{dt} on {'/'.join(r.devices) or '-'}"

        return f"{self.path}: {fmt(self.before)} -> {fmt(self.after)}"


@dataclass
class DtypeDiff:
    """What changed between two maps (``before.diff(after)``)."""

    changes: list[DtypeChange]

    def __bool__(self) -> bool:
        return bool(self.changes)

    def __len__(self) -> int:
        return len(self.changes)

    def __iter__(self) -> Iterator[DtypeChange]:
        return iter(self.changes)

    def __str__(self) -> str:
        if not self.changes:
            return "no dtype/device changes"
        return "\n".join(c.describe() for c in self.changes)

    def to_rows(self) -> list[dict[str, Any]]:
        return [
            {
                "path": c.path,
                "before": "/".join(c.before.dtypes) if c.before else "",
                "after": "/".join(c.after.dtypes) if c.after else "",
                "before_devices": "/".join(c.before.devices) if c.before else "",
                "after_devices": "/".join(c.after.devices) if c.after else "",
            }
            for c in self.changes
        ]


@dataclass
class DtypeMap:
    """A snapshot of dtypes/devices per module and per group."""

    records: dict[str, ModuleRecord]
    groups: dict[str, GroupSummary]
    rule: str = ""
    model_type: str | None = None

    # ------------------------------------------------------------------ queries
    def __iter__(self) -> Iterator[ModuleRecord]:
        return iter(self.records.values())

    def __len__(self) -> int:
        return len(self.records)

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.groups.values():
            for d, b in g.bytes.items():
                out[d] = out.get(d, 0) + b
        return out

    @property
    def total_params(self) -> int:
        return sum(sum(g.numel.values()) for g in self.groups.values())

    def diff(self, other: DtypeMap) -> DtypeDiff:
        """Modules whose dtypes, devices or trainable counts differ from ``self`` to ``other``."""
        changes = []
        for path in list(self.records) + [p for p in other.records if p not in self.records]:
            a, b = self.records.get(path), other.records.get(path)
            if a is None or b is None or a.signature() != b.signature():
                changes.append(DtypeChange(path, a, b))
        return DtypeDiff(changes)

    def digest(self) -> str:
        """A short hash of every record's dtypes/devices-kind: equal maps, equal digests (used to
        compare ranks). Device indices are dropped so cuda:0 and cuda:1 compare equal."""
        h = hashlib.sha256()
        for path in sorted(self.records):
            r = self.records[path]
            devs = sorted({d.split(":")[0] for d in r.devices})
            h.update(
                repr(
                    (path, sorted(r.params.items()), sorted(r.buffers.items()), devs, r.trainable)
                ).encode()
            )
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------ output
    def module_rows(self) -> list[dict[str, Any]]:
        """One row per module (for tables): path, group, type, dtypes, devices, numel, bytes,
        trainable, quantized, kept_fp32."""
        return [
            {
                "path": r.path,
                "group": r.group,
                "type": r.type,
                "dtypes": "/".join(r.dtypes) or "-",
                "buffer_dtypes": "/".join(sorted(r.buffers)) or "-",
                "devices": "/".join(r.devices) or "-",
                "numel": sum(r.params.values()),
                "bytes": sum(r.bytes.values()),
                "trainable": r.trainable,
                "quantized": r.quantized,
                "kept_fp32": r.kept_fp32 or "",
            }
            for r in self.records.values()
        ]

    def group_rows(self) -> list[dict[str, Any]]:
        return [
            {
                "group": g.group,
                "dtypes": "/".join(g.dtypes) or "-",
                "devices": "/".join(g.devices) or "-",
                "numel": sum(g.numel.values()),
                "bytes": sum(g.bytes.values()),
                "trainable": g.trainable,
                "quantized": g.quantized,
                "modules": g.modules,
                **{f"numel/{d}": n for d, n in sorted(g.numel.items())},
            }
            for g in self.groups.values()
        ]

    def table_rows(self) -> list[list[str]]:
        """One row per group: dtypes (params), devices, params, bytes, trainable."""
        return [
            [
                g.group,
                ", ".join(f"{d}:{n:,}" for d, n in sorted(g.numel.items())) or "-",
                "/".join(g.devices) or "-",
                f"{sum(g.numel.values()):,}",
                fmt_bytes(sum(g.bytes.values())),
                f"{g.trainable:,}",
            ]
            for g in self.groups.values()
        ]

    def table(self, *, title: str = "", use_rich: bool | None = False, width: int = 110) -> str:
        """The per-group table as text (plain by default; ``use_rich=None``: rich when
        installed), drawn by :func:`hf_precision.base.tables.render_table`."""
        return render_table(
            ["group", "dtypes (params)", "devices", "params", "bytes", "trainable"],
            self.table_rows(),
            title=title,
            right=(3, 4, 5),
            use_rich=use_rich,
            width=width,
        )

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (records, groups, rule, model_type); :meth:`from_dict` reads it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DtypeMap:
        return cls(
            records={k: ModuleRecord(**v) for k, v in data["records"].items()},
            groups={k: GroupSummary(**v) for k, v in data["groups"].items()},
            rule=data.get("rule", ""),
            model_type=data.get("model_type"),
        )

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)


# ---------------------------------------------------------------------------- receiving
def receiving_dtypes(
    model: nn.Module,
    groups: ModuleGroups | None = None,
    *,
    compute: Mapping[int, torch.dtype] | None = None,
) -> dict[str, torch.dtype]:
    """Per group, the dtype its entry receives (majority of its frozen weights)."""
    root, _ = unwrap_model(model)
    groups = groups or find_module_groups(root)
    out = {}
    for group in groups.names:
        for mod in groups.modules(group):
            dtype, _ = receiving(mod, compute)
            if dtype is not None:
                out[group] = dtype
                break
    return out


def _add(d: dict[str, int], key: str, n: int) -> None:
    d[key] = d.get(key, 0) + n


def dtype_map(
    model: nn.Module,
    groups: ModuleGroups | None = None,
    *,
    policy: Any = None,
    view: ModelView | None = None,
) -> DtypeMap:
    """Snapshot the dtypes/devices of every module that owns parameters or buffers.

    ``groups`` defaults to :func:`find_module_groups`; with a ``policy`` the records say why a
    module was kept in fp32; ``view`` is this event's walk of the model, when the caller has
    one (:class:`~hf_precision.model.view.ModelView`).
    """
    # Every container built here is kept (records, per-dtype counts): cyclic-GC passes during
    # the walk would only rescan them, a cost that grows faster than the model (measured on
    # LLaVA-1.5-7B: 4x the layers took up to 3.9x as long with the collector on, 3.1x off).
    if view is None or (model is not view.model and model is not view.root):
        check_model(model, "dtype_map(model)")  # else the event's view checked it
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _dtype_map(model, groups, policy, view)
    finally:
        if enabled:
            gc.enable()


def _stack_walk(root: nn.Module, groups: ModuleGroups) -> Iterator[tuple[str, nn.Module, str]]:
    """``(path, module, group)`` in ``named_modules(remove_duplicate=False)`` order, walked with
    an explicit stack (the recursive generator costs a frame per nesting level for every module
    it yields). Group modules held outside the module tree (a list-held tower) come last, under
    their own group: ``model.named_modules()`` never reaches them."""
    lookup = groups.by_path
    stack: list[tuple[str, nn.Module, str]] = [
        (path, mod, group)
        for group, path in reversed(groups.hidden.items())
        if (mod := hidden_module(root, path)) is not None
    ]
    stack.append(("", root, OTHER))
    while stack:
        raw, mod, parent_group = stack.pop()
        path = clean_name(raw) if "_orig_mod" in raw or "wrapped_module" in raw else raw
        # Pre-order walk: a module's group is its own entry or its parent's (O(1) per module).
        group = lookup.get(path) or (parent_group if path else lookup.get("", OTHER))
        if mod._modules:
            prefix = raw + "." if raw else ""
            stack.extend(
                [
                    (prefix + name, child, group)
                    for name, child in reversed(mod._modules.items())
                    if child is not None
                ]
            )
        yield raw, mod, group


class _Tally:
    """Adds tensors to a module's record and its group's summary. Hot path (a 70B model has
    thousands of tensors): per-dtype facts and device names are computed once, plain
    Parameters skip the subclass checks."""

    def __init__(self) -> None:
        self.summaries: dict[str, GroupSummary] = {}
        self._dtypes: dict[torch.dtype, tuple[str, int, bool]] = {}  # name, itemsize, quantized
        self._devices: dict[torch.device, str] = {}

    def summary(self, group: str) -> GroupSummary:
        found = self.summaries.get(group)
        if found is None:
            found = self.summaries[group] = GroupSummary(group)
        return found

    def param(self, rec: ModuleRecord, group: str, p: torch.Tensor, mod: nn.Module) -> None:
        n, dtype, plain = p.numel(), p.dtype, type(p) in _PLAIN
        zero3 = plain and hasattr(p, "ds_id")  # partitioned by DeepSpeed ZeRO-3
        if zero3:  # the whole parameter, in its partition's dtype (no gather)
            n, dtype = int(getattr(p, "ds_numel", n)), zero3_dtype(p) or dtype
        info = self._dtypes.get(dtype) if plain else None
        if info is None:
            info = (dtype_name(dtype), p.element_size(), is_quantized(p))
            if plain:
                self._dtypes[dtype] = info
        dt, nbytes, quant = info[0], n * info[1], info[2]
        if quant and not plain:  # a library's tensor: by format, its weights, real bytes
            dt, n, nbytes = quantized_format(p, mod), logical_numel(p), storage_bytes(p)
        dev = self._devices.get(p.device)
        if dev is None:
            dev = self._devices[p.device] = str(p.device)
        summary = self.summaries.get(group) or self.summary(group)
        # the module's record and its group's summary count the same facts, side by side
        rp, rb, sp, sb = rec.params, rec.bytes, summary.numel, summary.bytes
        rp[dt] = rp.get(dt, 0) + n
        sp[dt] = sp.get(dt, 0) + n
        rb[dt] = rb.get(dt, 0) + nbytes
        sb[dt] = sb.get(dt, 0) + nbytes
        if dev not in rec.devices:
            rec.devices.append(dev)
        if dev not in summary.devices:
            summary.devices.append(dev)
        if p.requires_grad:
            rec.trainable += n
            summary.trainable += n
            st = summary.trainable_numel
            st[dt] = st.get(dt, 0) + n
        if quant:
            rec.quantized += n
            summary.quantized += n
        if zero3 or (not plain and is_sharded(p)):
            rec.sharded += n

    def buffer(self, rec: ModuleRecord, group: str, b: torch.Tensor) -> None:
        dt, nbytes = dtype_name(b.dtype), b.numel() * b.element_size()
        _add(rec.buffers, dt, b.numel())
        _add(rec.bytes, dt, nbytes)
        _add(self.summary(group).bytes, dt, nbytes)


def _dtype_map(
    model: nn.Module, groups: ModuleGroups | None, policy: Any, view: ModelView | None = None
) -> DtypeMap:
    if view is not None and (model is view.model or model is view.root):
        root = view.root  # the view unwrapped it
    else:
        root, _ = unwrap_model(model)
    if view is not None and view.root is root:
        groups = view.groups
    elif groups is None:
        groups = find_module_groups(root)
    model_keep, strict = model_keep_lists(root)
    records: dict[str, ModuleRecord] = {}
    tally = _Tally()
    seen: dict[int, str] = {}
    lookup = groups.by_path
    walk = (
        ((path, mod, group) for path, group, mod in view.modules)
        if view is not None and view.root is root
        else _stack_walk(root, groups)
    )
    for raw, mod, group in walk:
        path = clean_name(raw) if "_orig_mod" in raw or "wrapped_module" in raw else raw
        mparams, mbufs = mod._parameters, mod._buffers
        if not mparams and not mbufs:
            continue
        rec: ModuleRecord | None = None
        for pname, p in mparams.items():
            if p is None:
                continue
            full = f"{path}.{pname}" if path else pname
            # only direct parameters (image_newline, query_tokens) have entries of their own
            pgroup = lookup.get(full, group) if groups.params else group
            if rec is None:
                rec = ModuleRecord(path, pgroup, type(mod).__name__)
            if id(p) in seen:
                rec.tied.append(f"{pname} -> {seen[id(p)]}")
                continue
            seen[id(p)] = full
            tally.param(rec, pgroup, p, mod)
            if policy is not None and rec.kept_fp32 is None:
                rec.kept_fp32 = policy.keep_fp32_reason(
                    full, is_buffer=False, model_patterns=model_keep, strict_patterns=strict
                )
        for bname, b in mbufs.items():
            if b is None:
                continue
            if rec is None:
                rec = ModuleRecord(path, group, type(mod).__name__)
            tally.buffer(rec, group, b)
            if policy is not None and rec.kept_fp32 is None and b.is_floating_point():
                full = f"{path}.{bname}" if path else bname
                rec.kept_fp32 = policy.keep_fp32_reason(
                    full,
                    is_buffer=True,
                    model_patterns=model_keep,
                    strict_patterns=strict,
                    role=tensor_role(mod, bname, b, is_buffer=True),
                )
        if rec is not None and path not in records:  # registered twice: the first name counts
            records[path] = rec
            tally.summary(rec.group).modules += 1
    order = {g: i for i, g in enumerate((*groups.names, OTHER))}
    summaries = dict(sorted(tally.summaries.items(), key=lambda kv: order.get(kv[0], len(order))))
    return DtypeMap(records, summaries, groups.rule, groups.model_type)
