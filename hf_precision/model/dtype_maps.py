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
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..base.tables import fmt_bytes, render_table
from ..base.wrapper_kinds import clean_name, unwrap_model
from ..errors import check_model
from ..rules.groups.module_groups import ModuleGroups, find_module_groups
from . import fp8
from .module_records import DtypeTally, GroupSummary, ModuleRecord
from .view import ModelView, receiving

__all__ = ["DtypeChange", "DtypeDiff", "DtypeMap", "dtype_map", "receiving_dtypes"]


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
                "fp8": r.fp8 or "",
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
                "fp8": "; ".join(g.fp8),
                "compute": g.compute,
                **{f"numel/{d}": n for d, n in sorted(g.numel.items())},
            }
            for g in self.groups.values()
        ]

    def table_rows(self) -> list[list[str]]:
        """One row per group: dtypes (params), devices, params, bytes, trainable; and what it
        computed in (``compute (ran)``) once a forward was watched."""
        ran = any(g.compute for g in self.groups.values())
        return [
            [
                g.group,
                ", ".join(f"{d}:{n:,}" for d, n in sorted(g.numel.items())) or "-",
                "/".join(g.devices) or "-",
                f"{sum(g.numel.values()):,}",
                fmt_bytes(sum(g.bytes.values())),
                f"{g.trainable:,}",
            ]
            + ([g.compute or "-"] if ran else [])
            for g in self.groups.values()
        ]

    def note_compute(self, ran: Mapping[str, Mapping[str, Any]]) -> None:
        """Each group's :attr:`GroupSummary.compute` from what a watched forward ran
        (``group -> {"compute": ..., "autocast": ...}``, the guard's ``compute`` section)."""
        for group, seen in ran.items():
            summary = self.groups.get(group)
            if summary is not None and seen.get("compute"):
                auto = seen.get("autocast")
                summary.compute = str(seen["compute"]) + (f" (autocast {auto})" if auto else "")

    def table(self, *, title: str = "", use_rich: bool | None = False, width: int = 110) -> str:
        """The per-group table as text (plain by default; ``use_rich=None``: rich when
        installed), drawn by :func:`hf_precision.base.tables.render_table`; a line per group
        with fp8 modules under it (their three facts: the dtypes column is their storage)."""
        ran = ["compute (ran)"] if any(g.compute for g in self.groups.values()) else []
        text = render_table(
            ["group", "dtypes (params)", "devices", "params", "bytes", "trainable", *ran],
            self.table_rows(),
            title=title,
            right=(3, 4, 5),
            use_rich=use_rich,
            width=width,
        )
        return text + "".join(
            f"\nfp8 {g.group}: {line}" for g in self.groups.values() for line in g.fp8
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


def _dtype_map(
    model: nn.Module, groups: ModuleGroups | None, policy: Any, view: ModelView | None = None
) -> DtypeMap:
    if view is not None and (model is view.model or model is view.root):
        root = view.root  # the view unwrapped it
    else:
        root, _ = unwrap_model(model)
    if view is not None and view.root is root:  # the event's walk
        tally = DtypeTally(root, view.groups, policy)
        entries = [
            (clean_name(raw) if "_orig_mod" in raw or "wrapped_module" in raw else raw, mod, group)
            for raw, group, mod in view.modules
            if mod._parameters or mod._buffers
        ]
    else:
        tally = DtypeTally(root, groups if groups is not None else find_module_groups(root), policy)
        entries = tally.walk(root)
    tally.count(entries)
    records, summaries = tally.result()
    _fp8_facts(entries, records, summaries)
    return DtypeMap(records, summaries, tally.groups.rule, tally.groups.model_type)


def _fp8_facts(
    entries: list[tuple[str, nn.Module, str]],
    records: dict[str, ModuleRecord],
    summaries: dict[str, GroupSummary],
) -> None:
    """Each fp8 module's record says its three facts; each group, its fp8 modules counted
    against its Linears (or its layers, for fp8 storage): ``"weights fp32, matmuls fp8 e4m3
    tensorwise (torchao), 14 of 21 Linears"``. A cheap look per module; facts only for fp8."""
    found: dict[str, fp8.Manifest] = {}
    for path, mod, _ in entries:
        if not fp8.might_be_fp8(mod):
            continue
        facts = fp8.facts(mod)
        if facts.fp8 and path in records:
            records[path].fp8 = facts.text()
            found.setdefault(records[path].group, fp8.Manifest()).modules[path] = facts
    if not found:
        return
    for path, mod, _ in entries:
        rec = records.get(path)
        if rec is not None and rec.group in found:
            man = found[rec.group]
            man.layers += 1
            man.linears += isinstance(mod, nn.Linear)
    for group, man in found.items():
        if group in summaries:
            summaries[group].fp8 = man.lines()
