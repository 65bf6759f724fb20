"""What one walk of a model finds: a :class:`ModuleRecord` per module that owns tensors and a
:class:`GroupSummary` per group, built by :class:`DtypeTally` (the hot path of
:func:`~hf_precision.model.dtype_maps.dtype_map`; metadata only, no tensor data).

>>> from hf_precision.rules.groups.module_groups import find_module_groups
>>> from hf_precision.tiny import tiny_llava
>>> model = tiny_llava()
>>> tally = DtypeTally(model, find_module_groups(model), None)
>>> tally.count(tally.walk(model))
>>> records, summaries = tally.result()
>>> records["model.multi_modal_projector.linear_1"].params
{'float32': 1056}
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..base.wrapper_kinds import clean_name, is_sharded
from ..rules.dtypes import (
    dtype_name,
    is_quantized,
    logical_numel,
    quantized_format,
    storage_bytes,
    zero3_dtype,
)
from ..rules.groups.group_rule import OTHER
from ..rules.groups.module_groups import ModuleGroups, hidden_module
from ..rules.keep_rules import model_keep_lists
from ..rules.roles import tensor_role

#: Tensor types that are never DTensors nor packed quantized storage.
_PLAIN = (nn.Parameter, torch.Tensor)
_PARAMETER = nn.Parameter


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
    #: its three precision facts when its matmuls or weights are fp8
    #: (``"weights fp32, matmuls fp8 e4m3 tensorwise (torchao)"``, :mod:`hf_precision.model.fp8`)
    fp8: str | None = None

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
            self.fp8,
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
    #: the group's fp8 modules by their facts: ``"weights fp32, matmuls fp8 e4m3 tensorwise
    #: (torchao), 14 of 21 Linears"`` (:mod:`hf_precision.model.fp8`)
    fp8: list[str] = field(default_factory=list)
    #: the dtype it computed in at the first forward the guard watched (``"float32"``; with
    #: ``" (autocast bfloat16)"`` under autocast), ``""`` before any forward ran: what ran, not
    #: what the policy means (:mod:`hf_precision.watch.what_ran`)
    compute: str = ""

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(sorted(self.numel))

    @property
    def mixed(self) -> bool:
        """More than one floating parameter dtype in the group."""
        return len([d for d in self.numel if d.startswith(("float", "bfloat"))]) > 1


def _add(d: dict[str, int], key: str, n: int) -> None:
    d[key] = d.get(key, 0) + n


class DtypeTally:
    """The records and group summaries of one map. Hot path (a 70B model has thousands of
    tensors): the walk is an explicit stack; a plain ``Parameter`` is counted inline, its
    dtype's facts and its device's name computed once per map, its record made with its counts;
    other tensors (quantized, DTensor, ZeRO-3 partitions) take :meth:`param`. Group summaries
    are built once at the end from :attr:`counts`."""

    def __init__(self, root: nn.Module, groups: ModuleGroups, policy: Any) -> None:
        self.groups, self.lookup, self.policy = groups, groups.by_path, policy
        self.keep = model_keep_lists(root)
        self.records: dict[str, ModuleRecord] = {}
        self.seen: dict[int, tuple[str, str]] = {}  # id(parameter) -> first (path, name): ties
        #: what the group summaries count, keyed in the order the walk first meets each fact:
        #: (group, dtype, device, trainable[, quantized]) -> [numel, bytes] for parameters,
        #: (group, dtype) -> [0, bytes] for buffers, (group,) for a group's first record
        self.counts: dict[tuple[Any, ...], list[int]] = {}
        self.modules: dict[str, int] = {}  # group -> records
        self._dtypes: dict[torch.dtype, tuple[str, int, bool]] = {}  # name, itemsize, quantized
        #: the dtypes of plain float parameters met so far, counted inline: name, itemsize
        #: (none under a policy, whose reasons :meth:`param` asks for)
        self._fast: dict[torch.dtype, tuple[str, int]] = {}
        self._devices: dict[torch.device, str] = {}

    def walk(self, root: nn.Module) -> list[tuple[str, nn.Module, str]]:
        """``(path, module, group)`` of every module that owns tensors, in
        ``named_modules(remove_duplicate=False)`` order, then the group modules held outside the
        module tree (a list-held tower: ``model.named_modules()`` never reaches them) under
        their own group. Walked with a stack of child iterators: the recursive generator costs
        a frame per nesting level for every module it yields, and a leaf costs no stack entry."""
        lookup, out = self.lookup, []
        tops = [("", root, OTHER)] + [
            (path, mod, group)
            for group, path in self.groups.hidden.items()
            if (mod := hidden_module(root, path)) is not None
        ]
        for raw, top, top_group in tops:
            path = clean_name(raw) if "_orig_mod" in raw or "wrapped_module" in raw else raw
            group = lookup.get(path) or (top_group if path else lookup.get("", OTHER))
            if top._parameters or top._buffers:
                out.append((path, top, group))
            stack = [(raw + "." if raw else "", group, iter(top._modules.items()))]
            while stack:
                prefix, parent_group, kids = stack[-1]
                for name, mod in kids:  # pre-order: a module, then its subtree
                    if mod is None:
                        continue
                    raw = prefix + name
                    path = clean_name(raw) if "_orig_mod" in raw or "wrapped_module" in raw else raw
                    # a module's group is its own entry or its parent's (O(1) per module)
                    group = lookup.get(path) or parent_group
                    if mod._parameters or mod._buffers:
                        out.append((path, mod, group))
                    if mod._modules:
                        stack.append((raw + ".", group, iter(mod._modules.items())))
                        break
                else:
                    stack.pop()
        return out

    def count(self, entries: Iterable[tuple[str, nn.Module, str]]) -> None:
        """The record of each module, in walk order: its direct parameters, then its buffers. A
        plain parameter of a dtype met before is counted here (the hot path); the first of its
        dtype, a tied, quantized, sharded or ZeRO-3 one, and every one under a policy, by
        :meth:`param`."""
        seen, counts, fast, devices = self.seen, self.counts, self._fast, self._devices
        records, modules = self.records, self.modules
        direct = self.lookup if self.groups.params else None  # image_newline, query_tokens
        for path, mod, group in entries:
            rec: ModuleRecord | None = None
            for pname, p in mod._parameters.items():
                if p is None:
                    continue
                pgroup = (
                    group
                    if direct is None
                    else direct.get(f"{path}.{pname}" if path else pname, group)
                )
                info = (
                    fast.get(p.dtype) if type(p) is _PARAMETER and not hasattr(p, "ds_id") else None
                )
                if info is None or id(p) in seen:
                    rec = self.param(rec, path, mod, pgroup, pname, p)
                    continue
                seen[id(p)] = (path, pname)
                n, trainable = p.numel(), p.requires_grad
                dt, nbytes = info[0], n * info[1]
                dev = devices.get(p.device) or self.device(p)
                found = counts.get(key := (pgroup, dt, dev, trainable))
                if found is None:
                    counts[key] = [n, nbytes]
                else:
                    found[0] += n
                    found[1] += nbytes
                if rec is None:  # path, group, type, params, bytes, buffers, devices, trainable
                    rec = ModuleRecord(
                        path, pgroup, type(mod).__name__, {dt: n}, {dt: nbytes}, {}, [dev],
                        n if trainable else 0,
                    )  # fmt: skip
                    continue
                rec.params[dt] = rec.params.get(dt, 0) + n
                rec.bytes[dt] = rec.bytes.get(dt, 0) + nbytes
                if dev not in rec.devices:
                    rec.devices.append(dev)
                if trainable:
                    rec.trainable += n
            if mod._buffers:
                rec = self.buffers(rec, path, mod, group)
            if rec is not None and path not in records:  # registered twice: the first counts
                records[path] = rec
                if rec.group in modules:
                    modules[rec.group] += 1
                else:
                    modules[rec.group] = 1
                    counts[(rec.group,)] = [0, 0]

    def device(self, p: torch.Tensor) -> str:
        found = self._devices[p.device] = str(p.device)
        return found

    def param(
        self,
        rec: ModuleRecord | None,
        path: str,
        mod: nn.Module,
        group: str,
        pname: str,
        p: torch.Tensor,
    ) -> ModuleRecord:
        """Any parameter: a tied one (named, not counted again), ZeRO-3 partitions (the whole
        parameter, no gather), a library's quantized tensor (by format, its weights, real bytes),
        DTensors (sharded); then why the policy keeps it in fp32."""
        rec = rec if rec is not None else ModuleRecord(path, group, type(mod).__name__)
        full = f"{path}.{pname}" if path else pname
        first = self.seen.get(id(p))
        if first is not None:
            rec.tied.append(
                f"{pname} -> {first[0]}.{first[1]}" if first[0] else f"{pname} -> {first[1]}"
            )
            return rec
        self.seen[id(p)] = (path, pname)
        self.tensor(rec, group, p, mod)
        if self.policy is not None and rec.kept_fp32 is None:
            rec.kept_fp32 = self.policy.keep_fp32_reason(
                full, is_buffer=False, model_patterns=self.keep[0], strict_patterns=self.keep[1]
            )
        return rec

    def tensor(self, rec: ModuleRecord, group: str, p: torch.Tensor, mod: nn.Module) -> None:
        n, dtype, plain = p.numel(), p.dtype, type(p) in _PLAIN
        zero3 = plain and hasattr(p, "ds_id")  # partitioned by DeepSpeed ZeRO-3
        if zero3:  # the whole parameter, in its partition's dtype (no gather)
            n, dtype = int(getattr(p, "ds_numel", n)), zero3_dtype(p) or dtype
        info = self._dtypes.get(dtype) if plain else None
        if info is None:
            info = (dtype_name(dtype), p.element_size(), is_quantized(p))
            if plain:
                self._dtypes[dtype] = info
                if not info[2] and self.policy is None and type(p) is _PARAMETER:
                    self._fast[dtype] = info[:2]
        dt, nbytes, quant = info[0], n * info[1], info[2]
        if quant and not plain:  # a library's tensor: by format, its weights, real bytes
            dt, n, nbytes = quantized_format(p, mod), logical_numel(p), storage_bytes(p)
        dev = self._devices.get(p.device) or self.device(p)
        found = self.counts.setdefault((group, dt, dev, p.requires_grad, quant), [0, 0])
        found[0] += n
        found[1] += nbytes
        _add(rec.params, dt, n)
        _add(rec.bytes, dt, nbytes)
        if dev not in rec.devices:
            rec.devices.append(dev)
        if p.requires_grad:
            rec.trainable += n
        if quant:
            rec.quantized += n
        if zero3 or (not plain and is_sharded(p)):
            rec.sharded += n

    def buffers(
        self, rec: ModuleRecord | None, path: str, mod: nn.Module, group: str
    ) -> ModuleRecord | None:
        for bname, b in mod._buffers.items():
            if b is None:
                continue
            if rec is None:
                rec = ModuleRecord(path, group, type(mod).__name__)
            dt, nbytes = dtype_name(b.dtype), b.numel() * b.element_size()
            _add(rec.buffers, dt, b.numel())
            _add(rec.bytes, dt, nbytes)
            self.counts.setdefault((group, dt), [0, 0])[1] += nbytes
            if self.policy is not None and rec.kept_fp32 is None and b.is_floating_point():
                rec.kept_fp32 = self.policy.keep_fp32_reason(
                    f"{path}.{bname}" if path else bname,
                    is_buffer=True,
                    model_patterns=self.keep[0],
                    strict_patterns=self.keep[1],
                    role=tensor_role(mod, bname, b, is_buffer=True),
                )
        return rec

    def result(self) -> tuple[dict[str, ModuleRecord], dict[str, GroupSummary]]:
        """The records, and the group summaries made from :attr:`counts` in the order the walk
        met each fact, then put in forward order (``other`` last)."""
        summaries: dict[str, GroupSummary] = {}
        for key, (n, nbytes) in self.counts.items():
            group = key[0]
            summary = summaries.get(group) or summaries.setdefault(group, GroupSummary(group))
            if len(key) == 1:  # the group's records
                summary.modules = self.modules[group]
                continue
            dt = key[1]
            if len(key) > 2:  # a parameter's
                _add(summary.numel, dt, n)
            _add(summary.bytes, dt, nbytes)
            if len(key) == 2:
                continue
            if key[2] not in summary.devices:
                summary.devices.append(key[2])
            if key[3]:
                summary.trainable += n
                _add(summary.trainable_numel, dt, n)
            if len(key) == 5 and key[4]:
                summary.quantized += n
        groups = self.groups
        order = {g: i for i, g in enumerate((*groups.names, OTHER))}
        summaries = dict(sorted(summaries.items(), key=lambda kv: order.get(kv[0], len(order))))
        return self.records, summaries
