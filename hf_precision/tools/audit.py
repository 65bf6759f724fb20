"""``hf-precision audit``: read a checkpoint folder, a Hub id, an adapter or diffusers folder,
a config or a model type, and check it against a policy (:mod:`hf_precision.tools.cli` parses the
arguments and calls :func:`audit`). Building the model and reading weights import torch here,
never at ``--help``."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import checkpoint, weight_files
from .audit_files import adapter_audit, diffusers_audit, print_table
from .exits import fail

# What --help says and the argument checks need no engine (torch, the registries): the names


# ---------------------------------------------------------------------------- output
@dataclass
class _Source:
    """Where ``hf-precision audit`` reads from: the kind, the local folder/file/model type,
    where that came from (a Hub id), and safetensors headers already read (from the Hub)."""

    kind: str
    where: Any
    via: str | None = None
    headers: dict[str, dict[str, Any]] | None = None


def _open_source(text: str) -> _Source:
    kind, where = checkpoint.resolve_source(text)
    if kind != "hub":
        return _Source(kind, where)
    folder, via, headers = checkpoint.resolve_hub(where)
    kind = next((k for m, k in checkpoint.MARKERS if (folder / m).is_file()), "path")
    kind = "component" if kind == "path" and checkpoint.is_component(folder) else kind
    if kind in ("diffusers", "component") and headers is not None:
        fail(
            f"{where}: a diffusers repository on the Hub keeps its components' headers in "
            f"subfolders, which the Hub's metadata does not read: download it (hf download "
            f"{where}) and audit the folder"
        )
    return _Source(kind, folder, via, headers)


def _audit_model(
    args: argparse.Namespace, policy: Any, src: _Source
) -> tuple[Any, Any, Any, str, str | None, bool]:
    """The model ``hf-precision audit`` checks: ``(model, config, load dtype, where the dtypes
    come from, a note, whether stored dtypes were read)``; built on the meta device unless
    ``--weights``."""
    from ..rules.dtypes import parse_dtype

    kind, where = src.kind, src.where
    config = checkpoint.load_config(kind, where)
    dtype = None if args.dtype == "auto" else parse_dtype(args.dtype, call="--dtype")
    if src.headers is not None:
        stored = weight_files.torch_dtypes({k: v["dtype"] for k, v in src.headers.items()})
    else:
        stored = (
            weight_files.stored_dtypes(where) if kind == "path" and Path(where).is_dir() else {}
        )
    note = None
    dtype_from = "--dtype" if dtype is not None else ""
    if dtype is None and not stored and not args.weights:
        declared = (
            getattr(config, "dtype", None)
            if "dtype" in dir(config)
            else getattr(config, "torch_dtype", None)
        )
        if declared is not None and str(declared) != "auto":
            dtype = parse_dtype(str(declared), call="config.dtype")
            dtype_from = "the config's dtype"
        else:
            dtype = policy.frozen_dtype
            dtype_from = "the policy's dtype (the config declares none)"
        if kind == "path" and Path(where).is_dir():
            dtype_from += " (no safetensors files to read the stored dtypes from)"
    if args.weights:
        if kind != "path" or not Path(where).is_dir() or src.via is not None:
            fail("--weights needs a local checkpoint folder")
        cls = checkpoint.model_classes(config)[0]
        # transformers spells the load dtype ``dtype`` since 4.56, ``torch_dtype`` before: the
        # config says which (a feature check, not a version check)
        key = "dtype" if "dtype" in dir(config) else "torch_dtype"
        model = cls.from_pretrained(str(where), local_files_only=True, **{key: dtype or "auto"})
        dtype_from = dtype_from or "as loaded"
    elif kind == "type":
        model, note = checkpoint.build_bare(str(where), dtype=dtype)
    else:
        model = checkpoint.build_model(config, meta=True, dtype=dtype)
        if stored and dtype is None:
            matched, total = checkpoint.apply_stored_dtypes(model, stored)
            dtype_from = f"as stored in the safetensors files ({matched} of {total} tensors"
            dtype_from += ")" if matched == total else "; the rest in the config's dtype)"
    if src.via:
        note = f"read from {src.via}" + (f"; {note}" if note else "")
    return model, config, dtype, dtype_from, note, bool(stored) and not args.weights


def _audit_rows(dmap: Any, policy: Any, by_group: dict[str, dict[str, int]]) -> list[list[str]]:
    """One row per group: what it holds, what the policy wants, the verdict."""
    from ..base.tables import fmt_bytes
    from ..rules.dtypes import dtype_name

    tied_in: dict[str, str] = {}  # group -> "name -> owner" of a weight tied elsewhere
    for rec in dmap:
        for t in rec.tied:
            tied_in.setdefault(rec.group, f"{rec.path}.{t}")
    rows = []
    for g in dmap.groups.values():
        want = dtype_name(policy.group_dtype(g.group))
        if g.trainable and policy.trainable_dtype is not None:
            want += f" (trainable {dtype_name(policy.trainable_dtype)})"
        bad = sum(by_group.get(g.group, {}).values())
        if not g.numel and g.group in tied_in:
            rows.append([g.group, f"tied: {tied_in[g.group]}", "0", "-", "-", want, "ok (tied)"])
            continue
        rows.append(
            [
                g.group,
                ", ".join(f"{d}:{n:,}" for d, n in sorted(g.numel.items())) or "-",
                f"{sum(g.numel.values()):,}",
                fmt_bytes(sum(g.bytes.values())),
                f"{g.trainable:,}",
                want,
                "ok" if not bad else f"{bad} to cast",
            ]
        )
    return rows


def audit(args: argparse.Namespace) -> int:
    """Run ``hf-precision audit`` on parsed arguments; returns the exit code."""
    from ..engine.enforce import check_policy
    from ..model.dtype_maps import dtype_map
    from ..rules.policy.parse import parse_policy

    policy = parse_policy(args.policy)
    src = _open_source(args.source)
    if src.kind in ("adapter", "diffusers", "component"):
        if args.weights:
            fail(f"--weights reads checkpoint folders, not {src.kind} folders")
        table = (adapter_audit if src.kind == "adapter" else diffusers_audit)(args, policy, src)
        return table.emit(args)
    model, config, dtype, dtype_from, note, stored = _audit_model(args, policy, src)
    checkpoint.set_trainable(model, args.trainable)
    report = check_policy(model, policy)
    dmap = dtype_map(model, report.groups, policy=policy)
    audit = _Audit(args, model, config, dtype, dtype_from, note, policy, report, dmap, stored)
    if args.json:
        print(json.dumps(audit.to_dict(), indent=1, default=str))
    else:
        audit.show()
    return 0 if audit.ok else 1


@dataclass
class _Audit:
    """What ``hf-precision audit`` found: the model as built, the policy's verdict, the map."""

    args: argparse.Namespace
    model: Any
    config: Any
    dtype: Any
    dtype_from: str | None
    note: str | None
    policy: Any
    report: Any  # EnforceReport of check_policy
    dmap: Any  # DtypeMap
    stored: bool = False  # dtypes read from safetensors headers

    @property
    def ok(self) -> bool:
        return not self.report.changes and not self.report.overflow

    @property
    def memory(self) -> dict[str, dict[str, int]]:
        """group -> bytes ``before`` and ``after`` the casts the policy asks for, for the
        groups it changes (a policy that upcasts trainable weights grows them)."""
        import torch

        tensors = dict(self.model.named_parameters(remove_duplicate=False))
        tensors.update(dict(self.model.named_buffers(remove_duplicate=False)))
        out: dict[str, dict[str, int]] = {}
        for g in self.dmap.groups.values():
            if any(c.group == g.group for c in self.report.changes):
                total = sum(g.bytes.values())
                out[g.group] = {"before": total, "after": total}
        for c in self.report.changes:
            t = tensors.get(c.name)
            if t is None or c.group not in out:
                continue
            size = {d: getattr(torch, d).itemsize for d in (c.before, c.after)}
            out[c.group]["after"] += t.numel() * (size[c.after] - size[c.before])
        return out

    @property
    def by_group(self) -> dict[str, dict[str, int]]:
        """group -> {"before->after": count} of the casts the policy asks for."""
        out: dict[str, dict[str, int]] = {}
        for c in self.report.changes:
            key = f"{c.before}->{c.after}"
            out.setdefault(c.group, {})[key] = out.setdefault(c.group, {}).get(key, 0) + 1
        return out

    def group_rows(self) -> list[dict[str, Any]]:
        """The map's rows; a model built on the meta device is on no device: its rows say
        where the dtypes were read instead."""
        rows = self.dmap.group_rows()
        if not self.args.weights:
            where = "read from the files" if self.stored else "built from the config"
            for r in rows:
                r["devices"] = f"not loaded ({where})"
        return rows

    def to_dict(self) -> dict[str, Any]:
        from ..rules.dtypes import dtype_name

        report = self.report
        return {
            "source": str(self.args.source),
            "model_class": type(self.model).__name__,
            "model_type": getattr(self.config, "model_type", None),
            "rule": report.groups.rule,
            "built": "weights" if self.args.weights else "meta",
            "dtype": dtype_name(self.dtype) if self.dtype is not None else "auto",
            "dtype_from": self.dtype_from,
            "note": self.note,
            "policy": self.policy.to_dict(),
            "ok": self.ok,
            "violations": len(report.changes),
            "changes_by_group": self.by_group,
            "memory_by_group": self.memory,
            "groups": self.group_rows(),
            # a meta build is on no device: its changes say nothing of devices
            "changes": [
                {k: v for k, v in c.__dict__.items() if self.args.weights or "device" not in k}
                for c in report.changes
            ],
            "kept_fp32": report.kept_fp32,
            "skipped": report.skipped,
            "overflow": report.overflow,
        }

    def show(self) -> None:
        import torch

        from ..rules.dtypes import dtype_name

        policy, report, by_group = self.policy, self.report, self.by_group
        built = "weights loaded" if self.args.weights else "built on the meta device"
        if self.dtype_from:
            built += f", dtypes: {self.dtype_from}"
        if self.note:
            built += f"; {self.note}"
        print_table(
            f"{type(self.model).__name__} ({getattr(self.config, 'model_type', None)}, groups "
            f"by rule {report.groups.rule!r}, {built})",
            ["group", "dtypes (params)", "params", "bytes", "trainable", "policy", "verdict"],
            _audit_rows(self.dmap, policy, by_group),
            self.args.plain,
        )
        if self.ok:
            print(f"OK: the model matches policy {policy.describe()}")
            return
        detail = "; ".join(f"{g} {k} x{n}" for g, d in by_group.items() for k, n in d.items())
        from ..base.tables import fmt_bytes

        memory = self.memory
        if memory:
            print(
                "memory after the policy's casts: "
                + ", ".join(
                    f"{g} {fmt_bytes(m['before'])} -> {fmt_bytes(m['after'])}"
                    for g, m in memory.items()
                )
                + f" (total {fmt_bytes(sum(m['before'] for m in memory.values()))} -> "
                f"{fmt_bytes(sum(m['after'] for m in memory.values()))})"
            )
        frozen = dtype_name(policy.frozen_dtype or torch.float32)
        load = (
            f"; or load with from_pretrained(..., dtype=torch.{frozen})"
            if all(c.after == frozen for c in report.changes)
            else ""
        )
        print(
            f"VIOLATES policy {policy.describe()}: {len(report.changes)} tensor(s) would be "
            f"cast ({detail}). PrecisionGuardCallback casts them at on_init_end{load}."
        )
        for name, value in report.overflow:
            print(f"  {name}: max |value| {value:g} exceeds the fp16 range")
        up = dtype_name(policy.trainable_dtype) if policy.trainable_dtype is not None else None
        if self.args.trainable == "all" and any(c.after == up for c in report.changes):
            print(
                f"  (--trainable all: every weight is counted as trained, and the policy keeps "
                f"trained weights in {up}; pass the groups your run trains, e.g. --trainable "
                "projector, or none for LoRA, the default)"
            )
