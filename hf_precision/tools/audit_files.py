"""``hf-precision audit`` of weight files alone (a PEFT adapter folder, a diffusers folder or
component): their dtypes read from the safetensors headers, per group, against the policy; and
the table printer every audit uses."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import checkpoint, weight_files
from .exits import fail

# What --help says and the argument checks need no engine (torch, the registries): the names


# ---------------------------------------------------------------------------- output


def print_table(title: str, columns: list[str], rows: list[list[str]], plain: bool) -> None:
    from ..base.tables import render_table

    width = max(100, min(160, 20 * len(columns)))
    right = range(2, len(columns))
    print(
        render_table(
            columns,
            rows,
            title=title,
            right=right,
            use_rich=None if not plain else False,
            width=width,
        )
    )


_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2}


@dataclass
class _FileAudit:
    """An audit read from safetensors headers alone, one row per group (PEFT adapters) or per
    component (diffusers folders): what each stores, what the policy wants, the verdict."""

    what: str  # "adapter" | "diffusers"
    source: str
    policy: Any
    trainable: str
    rows: list[dict[str, Any]]
    info: dict[str, Any]
    notes: list[str]

    @property
    def ok(self) -> bool:
        return all(not r["to_cast"] for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kind": self.what,
            **self.info,
            "built": "nothing (safetensors headers only)",
            "policy": self.policy.to_dict(),
            "trainable": self.trainable,
            "ok": self.ok,
            "violations": sum(r["to_cast"] for r in self.rows),
            "groups": self.rows,
            "notes": self.notes,
        }

    def emit(self, args: argparse.Namespace) -> int:
        from ..base.tables import fmt_bytes

        if args.json:
            print(json.dumps(self.to_dict(), indent=1, default=str))
            return 0 if self.ok else 1
        key = "component" if self.what == "diffusers" else "group"
        head = ", ".join(f"{k} {v}" for k, v in self.info.items() if isinstance(v, str))
        print_table(
            f"{self.what} {self.source} ({head}; dtypes as stored, read from the headers)",
            [key, "dtypes (params)", "params", "bytes", "trainable", "policy", "verdict"],
            [
                [
                    r[key],
                    ", ".join(f"{d}:{n:,}" for d, n in sorted(r["numel"].items())) or "-",
                    f"{sum(r['numel'].values()):,}",
                    fmt_bytes(r["bytes"]),
                    "yes" if r["trainable"] else "no",
                    r["policy"],
                    "ok" if not r["to_cast"] else f"{r['to_cast']} to cast",
                ]
                for r in self.rows
            ],
            args.plain,
        )
        for note in self.notes:
            print(f"note: {note}")
        verdict = "OK: matches" if self.ok else "VIOLATES"
        print(f"{verdict} policy {self.policy.describe()}")
        return 0 if self.ok else 1


def _file_rows(
    tensors: dict[str, dict[str, Any]],
    group_of: Callable[[str], str],
    want_of: Callable[[str], tuple[Any, bool]],
    key: str,
) -> list[dict[str, Any]]:
    """Rows of a :class:`_FileAudit`: tensors per group, and how many the policy would cast."""
    from ..rules.dtypes import dtype_name

    stored = weight_files.torch_dtypes({k: v["dtype"] for k, v in tensors.items()})
    rows: dict[str, dict[str, Any]] = {}
    for name, meta in tensors.items():
        g = group_of(name)
        want, trainable = want_of(g)
        row = rows.setdefault(
            g,
            {
                key: g,
                "numel": {},
                "bytes": 0,
                "tensors": 0,
                "to_cast": 0,
                "trainable": trainable,
                "policy": dtype_name(want) if want is not None else "-",
            },
        )
        n = 1
        for d in meta.get("shape", []):
            n *= int(d)
        dt = weight_files.SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"])
        row["numel"][dt] = row["numel"].get(dt, 0) + n
        row["bytes"] += n * _ITEMSIZE.get(meta["dtype"], 1)
        row["tensors"] += 1
        if name in stored and want is not None and stored[name] != want:
            row["to_cast"] += 1
    return list(rows.values())


def _trainable_set(spec: str) -> set[str]:
    return set(checkpoint.trainable_groups(spec))


def adapter_audit(args: argparse.Namespace, policy: Any, src: Any) -> _FileAudit:
    """A PEFT adapter folder: the adapter's tensors per group of its base model (when the base
    model's config can be read here: a local folder or the Hub cache), against the dtype the
    policy gives trainable weights."""
    data = weight_files.read_adapter(src.where, src.headers)
    config = data["config"]
    base = config.get("base_model_name_or_path")
    groups, note = _base_groups(base)
    notes = [note] if note else []
    notes.append(
        "PEFT loads adapter weights stored in bf16/fp16 as float32 unless "
        "autocast_adapter_dtype=False; PrecisionGuardCallback then applies the policy"
    )

    def group_of(key: str) -> str:
        path = weight_files.adapter_module_path(key)
        return groups.group_of(path) if groups is not None else "adapter"

    def want_of(group: str) -> tuple[Any, bool]:
        return policy.trainable_dtype or policy.group_dtype(group), True

    info = {
        "peft_type": str(config.get("peft_type")),
        "base_model": str(base),
        "r": config.get("r"),
        "target_modules": config.get("target_modules"),
        "modules_to_save": config.get("modules_to_save"),
    }
    if src.via:
        notes.insert(0, f"read from {src.via}")
    rows = _file_rows(data["tensors"], group_of, want_of, "group")
    return _FileAudit("adapter", str(args.source), policy, "the adapter", rows, info, notes)


def _base_groups(base: str | None) -> tuple[Any, str | None]:
    """The groups of an adapter's base model built on the meta device from its config, when
    that config is here (a local folder or the Hub cache); else ``None`` and why."""
    from ..rules.groups.module_groups import find_module_groups

    if not base:
        return None, "adapter_config.json names no base model: tensors not placed in groups"
    missing = (
        f"base model {base} is not readable here (no local folder, not in the Hugging Face "
        f"cache): tensors not placed in groups; audit the base itself with 'hf-precision "
        f"audit {base}'"
    )
    # every step ends in a one-line CLI error (SystemExit) when it cannot read the base: here
    # that is a note, not the command's error
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            kind, where = checkpoint.resolve_source(base)
            if kind == "hub":
                where, _, _ = checkpoint.resolve_hub(where)
                kind = "path" if (Path(where) / "config.json").is_file() else kind
            if kind != "path":
                return None, missing
            model = checkpoint.build_model(checkpoint.load_config(kind, where), meta=True)
    except SystemExit:
        return None, missing
    return find_module_groups(model), None


def diffusers_audit(args: argparse.Namespace, policy: Any, src: Any) -> _FileAudit:
    """A diffusers folder: each component of model_index.json that stores weights (unet,
    transformer, vae, text encoders), as its diffusion group, against the policy."""
    from ..rules.groups.diffusion import DIFFUSION_GROUPS

    if src.kind == "component":
        components = weight_files.read_component(src.where)
    else:
        components = weight_files.read_diffusers(src.where)
    if not components:
        fail(f"{src.where}: no component of model_index.json stores *.safetensors weights")
    train = _trainable_set(args.trainable)
    rows: list[dict[str, Any]] = []
    for name, comp in components.items():
        group = comp.get("group") or (name if name in DIFFUSION_GROUPS else "other")
        trainable = "all" in train or group in train

        def want_of(_: str, group: str = group, trainable: bool = trainable) -> tuple[Any, bool]:
            if trainable and policy.trainable_dtype is not None:
                return policy.trainable_dtype, True
            return policy.group_dtype(group), trainable

        def component(_: str, name: str = name) -> str:
            return name

        for row in _file_rows(comp["tensors"], component, want_of, "component"):
            row.update({"group": group, "class": comp["class"], "files": comp["files"]})
            rows.append(row)
    notes = [f"read from {src.via}"] if src.via else []
    info = {"components": ", ".join(components)}
    return _FileAudit("diffusers", str(args.source), policy, args.trainable, rows, info, notes)
