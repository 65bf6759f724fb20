"""``hf-precision``: audit a checkpoint against a precision policy, or run a doctor pass.

Exit codes: 0 the model matches the policy / the doctor pass ran clean; 1 it violates the policy
/ a dtype or device error was diagnosed; 2 bad arguments, or a source that does not exist or whose
config cannot be read; 3 weight files that cannot be read (empty, truncated, corrupt, not
safetensors). 1 is never an input error.

>>> from hf_precision.cli import main
>>> main(["audit", "llava", "--dtype", "bf16", "--json"])  # doctest: +SKIP
0
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from . import checkpoint
from .checkpoint import DEFAULT_TRAINABLE, fail
from .errors import PrecisionError
from .names import GROUP_NAMES, PRESET_NAMES, preset_hint, unknown_groups

# What --help says and the argument checks need no engine (torch, the registries): the names
# live in hf_precision.names, checked against the registries by tests/test_cli.py.
_DTYPES = ("auto", "fp32", "bf16", "fp16", "float32", "bfloat16", "float16")
_SOURCES = """PATH_OR_MODEL_TYPE is a checkpoint folder (config.json inside, sharded or not), a
config.json file, a Hub id (org/name: its config and safetensors headers, no weights; offline,
HF_HUB_OFFLINE=1, from the local Hugging Face cache only), a PEFT adapter folder
(adapter_config.json: the adapter's dtypes and its base model), a diffusers folder
(model_index.json: the dtypes of each component) or a transformers model type."""
_EXIT_CODES = """exit codes:
  0  the model matches the policy (doctor: the guarded step ran clean)
  1  it violates the policy (doctor: a dtype/device error was diagnosed); nothing else exits 1
  2  bad arguments, or a source that does not exist or whose config cannot be read
  3  weight files that cannot be read: empty, truncated, corrupt, not safetensors (one line
     names the file and what is wrong)"""
_EXAMPLES_AUDIT = f"""examples:
  hf-precision audit ./my-llava-checkpoint --policy bf16
  hf-precision audit Qwen/Qwen2-VL-7B-Instruct --policy bf16-true
  hf-precision audit ./my-llava-checkpoint/config.json --dtype bf16 --json
  hf-precision audit llava --policy fp16 --trainable projector,language_model
  hf-precision audit ./lora-adapter --policy bf16
  hf-precision audit ./sd-pipeline --policy fp16-vae32 --trainable none
  hf-precision audit ./sd-pipeline/unet --policy fp16      # one diffusers component
  hf-precision audit ./ckpt --weights          # read the real weights instead of the meta build

{_SOURCES}
Without --weights the model is built on the meta device from its config: nothing is read but
the config and the safetensors headers (each tensor in the dtype it is stored in), or without
weight files the dtype from_pretrained would load (config dtype, or --dtype). A relative path
that does not exist is a missing folder, never looked up on the Hub (owner/name is a Hub id only
where no folder owner/ is).

{_EXIT_CODES}"""
_EXAMPLES_DOCTOR = f"""examples:
  hf-precision doctor llava --policy bf16
  hf-precision doctor ./my-tiny-checkpoint --policy bf16-true --json
  hf-precision doctor ./my-tiny-bert --policy bf16 --text-len 8
  hf-precision doctor minicpmv --policy bf16-true --batch raw

PATH_OR_MODEL_TYPE is a local checkpoint folder (loaded with its weights, each tensor in the
dtype it is stored in), a config.json (built with random weights, small configs only) or a
model type, built tiny. Vision-language models get a synthetic image+text batch; text-only
models (causal LM, seq2seq, classifiers) a text batch. The doctor enforces the policy (as
PrecisionGuardCallback does at on_init_end), installs the guard in --mode fix (as the
callback runs it; --mode raise: every input it would cast is an error), runs one training
forward+backward (under autocast for mixed presets, as Trainer does; there the guard fixes
instead of raising, and what autocast handled is counted as information, not as a problem)
and a generate() (generative models), and prints the diagnosis.

{_EXIT_CODES}"""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``hf-precision: error: ... (choose from ...)``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _common_options(s: argparse.ArgumentParser) -> None:
    """The options every model command takes, with one set of defaults."""
    s.add_argument("source", metavar="PATH_OR_MODEL_TYPE")
    s.add_argument(
        "--policy",
        default="bf16",
        metavar="PRESET",
        help=f"policy preset: {', '.join(PRESET_NAMES)} (default: bf16)",
    )
    s.add_argument("--json", action="store_true", help="print JSON instead of tables")
    s.add_argument("--plain", action="store_true", help="plain text tables even with rich")
    s.add_argument(
        "--trainable",
        default=DEFAULT_TRAINABLE,
        help=f"comma-separated groups that are trained ({', '.join(GROUP_NAMES)}, or a "
        "registered one), 'other', 'all' or "
        f"'none' (default: {DEFAULT_TRAINABLE}: the checkpoint frozen, as under LoRA)",
    )


def _audit_options(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--dtype",
        default="auto",
        choices=_DTYPES,
        help="dtype the model is loaded in (default: auto = as stored, else the config dtype)",
    )
    s.add_argument(
        "--weights",
        action="store_true",
        help="load the real weights (local checkpoint folders only)",
    )


def _doctor_options(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--batch",
        default="fixed",
        choices=("fixed", "raw"),
        help="fixed: synthetic batch cast per policy (as PrecisionCollator); "
        "raw: fp32 as collators build it",
    )
    s.add_argument(
        "--mode",
        default="fix",
        choices=("fix", "raise"),
        help="guard mode outside autocast (default fix: the guard casts at the boundaries, as "
        "PrecisionGuardCallback does; raise: every input the guard would have to cast is an "
        "error)",
    )
    s.add_argument("--no-generate", action="store_true", help="skip generate()")
    s.add_argument(
        "--blame",
        default="auto",
        choices=("off", "auto", "always"),
        help="name the first module whose output turns inf/NaN: auto (default) re-runs the "
        "batch with hooks when the loss or a gradient is non-finite; always: with hooks at once",
    )
    s.add_argument(
        "--trace",
        action="store_true",
        help="record one forward's per-module input/output dtypes and name where the "
        "activation dtype changes first, and what did it",
    )
    s.add_argument(
        "--report-dir",
        default=None,
        help="write the trace's picture and JSON there (doctor-trace.png/.json)",
    )
    for flag, what in (
        ("--image-size", "image side in pixels (vision models; default: the config's)"),
        ("--text-len", "text tokens per row of the synthetic batch (default: 6)"),
        ("--image-token-id", "image placeholder id (vision models; default: the config's)"),
    ):
        s.add_argument(flag, type=int, default=None, help=what)
    s.add_argument(
        "--max-params",
        type=int,
        default=50_000_000,
        help="refuse to build larger models from a config (default 50M)",
    )


def _architectures(args: argparse.Namespace) -> int:
    from .groups import architecture_table

    print(architecture_table(), end="")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import doctor

    return doctor(args)


@dataclass(frozen=True)
class Command:
    """One subcommand: its help, its examples, its own options, what runs it, and whether it
    takes the model options (source, --policy, --trainable, --json, --plain)."""

    help: str
    run: Callable[[argparse.Namespace], int]
    options: Callable[[argparse.ArgumentParser], None] | None = None
    epilog: str | None = None
    description: str | None = None
    model: bool = True


def _commands() -> dict[str, Command]:
    return {
        "architectures": Command(
            "print the supported-architecture table (Markdown, as in docs/api.md)",
            _architectures,
            description="The group rules find_module_groups tries, in order, generated from "
            "the rule registry (registered rules included).",
            model=False,
        ),
        "audit": Command(
            "check a checkpoint/Hub id/adapter/diffusers folder/config/model type against a policy",
            _audit,
            _audit_options,
            _EXAMPLES_AUDIT,
        ),
        "doctor": Command(
            "run one guarded training step and generate()",
            _doctor,
            _doctor_options,
            _EXAMPLES_DOCTOR,
        ),
    }


def _parser() -> argparse.ArgumentParser:
    """The whole command line; building it and --help import no engine (no torch)."""
    commands = _commands()
    p = _Parser(
        prog="hf-precision",
        description="Audit and diagnose the precision (dtypes, "
        "devices) of transformers models against an hf-precision policy.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="run 'hf-precision audit --help' or 'hf-precision doctor --help' for examples\n\n"
        + _EXIT_CODES,
    )
    from . import __version__  # the package's, read from the installed metadata

    p.add_argument("--version", action="version", version=f"hf-precision {__version__}")
    sub = p.add_subparsers(
        dest="command", parser_class=_Parser, metavar="{" + ",".join(commands) + "}"
    )
    sub.required = True
    for name, cmd in commands.items():
        s = sub.add_parser(
            name,
            help=cmd.help,
            description=cmd.description or cmd.help,
            epilog=cmd.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if cmd.model:
            _common_options(s)
        if cmd.options is not None:
            cmd.options(s)
        s.set_defaults(run=cmd.run)
    # `hf-precision run -- COMMAND` / `install-hook`: the launcher (hf_precision.integrations)
    from .integrations.launcher import add_cli as add_launcher_cli

    add_launcher_cli(sub)
    sub.metavar = "{" + ",".join([*commands, "run", "install-hook"]) + "}"
    return p


def _check_values(args: argparse.Namespace) -> None:
    """The values argparse cannot check alone: the preset and the groups, before anything is
    read or built, from the names alone (no torch: an argument error answers at once)."""
    if hasattr(args, "policy") and args.policy not in PRESET_NAMES:
        fail(
            f"argument --policy: unknown preset {args.policy!r}."
            f"{preset_hint(args.policy, PRESET_NAMES)} Allowed: {', '.join(PRESET_NAMES)}"
        )
    error = unknown_groups(args.trainable) if hasattr(args, "trainable") else None
    if error:
        fail(error)


# ---------------------------------------------------------------------------- output
def _print_table(title: str, columns: list[str], rows: list[list[str]], plain: bool) -> None:
    from .tables import render_table

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
    from .dtypes import parse_dtype

    kind, where = src.kind, src.where
    config = checkpoint.load_config(kind, where)
    dtype = None if args.dtype == "auto" else parse_dtype(args.dtype, call="--dtype")
    if src.headers is not None:
        stored = checkpoint.torch_dtypes({k: v["dtype"] for k, v in src.headers.items()})
    else:
        stored = checkpoint.stored_dtypes(where) if kind == "path" and Path(where).is_dir() else {}
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
    from .dtypes import dtype_name
    from .tables import fmt_bytes

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


def _audit(args: argparse.Namespace) -> int:
    from .dtype_maps import dtype_map
    from .enforce import check_policy
    from .policy_spec import parse_policy

    policy = parse_policy(args.policy)
    src = _open_source(args.source)
    if src.kind in ("adapter", "diffusers", "component"):
        if args.weights:
            fail(f"--weights reads checkpoint folders, not {src.kind} folders")
        table = (_adapter_audit if src.kind == "adapter" else _diffusers_audit)(args, policy, src)
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
        from .tables import fmt_bytes

        if args.json:
            print(json.dumps(self.to_dict(), indent=1, default=str))
            return 0 if self.ok else 1
        key = "component" if self.what == "diffusers" else "group"
        head = ", ".join(f"{k} {v}" for k, v in self.info.items() if isinstance(v, str))
        _print_table(
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
    from .dtypes import dtype_name

    stored = checkpoint.torch_dtypes({k: v["dtype"] for k, v in tensors.items()})
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
        dt = checkpoint.SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"])
        row["numel"][dt] = row["numel"].get(dt, 0) + n
        row["bytes"] += n * _ITEMSIZE.get(meta["dtype"], 1)
        row["tensors"] += 1
        if name in stored and want is not None and stored[name] != want:
            row["to_cast"] += 1
    return list(rows.values())


def _trainable_set(spec: str) -> set[str]:
    return set(checkpoint.trainable_groups(spec))


def _adapter_audit(args: argparse.Namespace, policy: Any, src: _Source) -> _FileAudit:
    """A PEFT adapter folder: the adapter's tensors per group of its base model (when the base
    model's config can be read here: a local folder or the Hub cache), against the dtype the
    policy gives trainable weights."""
    data = checkpoint.read_adapter(src.where, src.headers)
    config = data["config"]
    base = config.get("base_model_name_or_path")
    groups, note = _base_groups(base)
    notes = [note] if note else []
    notes.append(
        "PEFT loads adapter weights stored in bf16/fp16 as float32 unless "
        "autocast_adapter_dtype=False; PrecisionGuardCallback then applies the policy"
    )

    def group_of(key: str) -> str:
        path = checkpoint.adapter_module_path(key)
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
    from .groups import find_module_groups

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


def _diffusers_audit(args: argparse.Namespace, policy: Any, src: _Source) -> _FileAudit:
    """A diffusers folder: each component of model_index.json that stores weights (unet,
    transformer, vae, text encoders), as its diffusion group, against the policy."""
    from .diffusion_rules import DIFFUSION_GROUPS

    if src.kind == "component":
        components = checkpoint.read_component(src.where)
    else:
        components = checkpoint.read_diffusers(src.where)
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
        from .dtypes import dtype_name

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

        from .dtypes import dtype_name

        policy, report, by_group = self.policy, self.report, self.by_group
        built = "weights loaded" if self.args.weights else "built on the meta device"
        if self.dtype_from:
            built += f", dtypes: {self.dtype_from}"
        if self.note:
            built += f"; {self.note}"
        _print_table(
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
        from .tables import fmt_bytes

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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-precision`` command; returns the exit code."""

    try:
        parser = _parser()
        args = parser.parse_args(argv)
        if args.command in ("run", "install-hook"):  # its own options: auto, a policy file
            from .integrations.launcher import run_cli

            return run_cli(args)
        _check_values(args)
        code: int = args.run(args)
        return code
    except SystemExit as exc:
        return int(exc.code or 0)
    except PrecisionError as err:
        print(f"hf-precision: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
