"""``hf-precision``: audit a checkpoint against a precision policy, or run a doctor pass.

Exit codes: 0 the model matches the policy / the doctor pass ran clean; 1 it violates the policy
/ a dtype or device error was diagnosed; 2 bad arguments or a source that cannot be read.

>>> from hf_precision.cli import main
>>> main(["audit", "llava", "--dtype", "bf16", "--json"])  # doctest: +SKIP
0
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from .checkpoint import (
    apply_stored_dtypes,
    build_bare,
    build_model,
    fail,
    load_config,
    model_classes,
    resolve_source,
    set_trainable,
    stored_dtypes,
)
from .errors import PrecisionError

_DTYPES = ("auto", "fp32", "bf16", "fp16", "float32", "bfloat16", "float16")
_EXAMPLES_AUDIT = """examples:
  hf-precision audit ./my-llava-checkpoint --policy bf16
  hf-precision audit ./my-llava-checkpoint/config.json --dtype bf16 --json
  hf-precision audit llava --policy fp16 --trainable projector,language_model
  hf-precision audit ./ckpt --weights          # read the real weights instead of the meta build

PATH_OR_MODEL_TYPE is a checkpoint folder (config.json inside), a config.json file, or a
transformers model type. Without --weights the model is built on the meta device from its
config: nothing is read but the config, in the dtype from_pretrained would load (config dtype,
or --dtype).
Exit code 0: matches the policy; 1: violates it; 2: bad arguments."""
_EXAMPLES_DOCTOR = """examples:
  hf-precision doctor llava --policy bf16
  hf-precision doctor ./my-tiny-checkpoint --policy bf16-true --json
  hf-precision doctor minicpmv --policy bf16-true --batch raw

PATH_OR_MODEL_TYPE is a local checkpoint folder (loaded with its weights), a config.json
(built with random weights, small configs only) or a model type, built tiny. The doctor
enforces the policy (as PrecisionGuardCallback does at on_init_end), installs the guard in
raise mode, runs one training forward+backward (under autocast for mixed presets, as Trainer
does; there the guard fixes instead of raising) and a generate() on a synthetic batch, and
prints the diagnosis. Exit code 0: clean; 1: a dtype/device error was
diagnosed; 2: bad arguments."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``hf-precision: error: ... (choose from ...)``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _audit_options(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--dtype",
        default="auto",
        choices=_DTYPES,
        help="dtype the model is loaded in (default: auto = config dtype)",
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
        default="raise",
        choices=("raise", "fix"),
        help="guard mode outside autocast (default raise: every input the "
        "guard would have to cast is an error)",
    )
    s.add_argument("--no-generate", action="store_true", help="skip generate()")
    for flag, what in (
        ("--image-size", "image side in pixels for the synthetic batch (default: the config's)"),
        ("--text-len", "text tokens per row of the synthetic batch (default: 6)"),
        ("--image-token-id", "image placeholder id (default: the config's image_token_id)"),
    ):
        s.add_argument(flag, type=int, default=None, help=what)
    s.add_argument(
        "--max-params",
        type=int,
        default=50_000_000,
        help="refuse to build larger models from a config (default 50M)",
    )


def _parser() -> argparse.ArgumentParser:
    from .groups import group_names
    from .policy import PRESETS

    p = _Parser(
        prog="hf-precision",
        description="Audit and diagnose the precision (dtypes, "
        "devices) of transformers models against an hf-precision policy.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="run 'hf-precision audit --help' or 'hf-precision doctor --help' for examples",
    )
    sub = p.add_subparsers(
        dest="command", parser_class=_Parser, metavar="{architectures,audit,doctor}"
    )
    sub.required = True
    sub.add_parser(
        "architectures",
        help="print the supported-architecture table (Markdown, as in the README)",
        description="The group rules find_module_groups tries, in order, generated from the "
        "rule registry (registered rules included).",
    )
    groups_help = (
        f"comma-separated groups that are trained ({', '.join(group_names())}), 'all' or 'none'"
    )
    for name, epilog, helptext in (
        ("audit", _EXAMPLES_AUDIT, "check a checkpoint/config/model type against a policy"),
        ("doctor", _EXAMPLES_DOCTOR, "run one guarded training step and generate()"),
    ):
        s = sub.add_parser(
            name,
            help=helptext,
            description=helptext,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        s.add_argument("source", metavar="PATH_OR_MODEL_TYPE")
        s.add_argument(
            "--policy", default="bf16", choices=list(PRESETS), help="policy preset (default: bf16)"
        )
        s.add_argument("--json", action="store_true", help="print JSON instead of tables")
        s.add_argument("--plain", action="store_true", help="plain text tables even with rich")
        s.add_argument(
            "--trainable",
            default="none" if name == "audit" else "all",
            help=f"{groups_help} (default: {'none' if name == 'audit' else 'all'})",
        )
        (_audit_options if name == "audit" else _doctor_options)(s)
    # `hf-precision run -- COMMAND` / `install-hook`: the launcher (hf_precision.integrations)
    from .integrations.launcher import add_cli as _add_launcher_cli

    _add_launcher_cli(sub)
    sub.metavar = "{architectures,audit,doctor,run,install-hook}"
    return p


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


def _audit_model(args: argparse.Namespace, policy: Any) -> tuple[Any, Any, Any, str, str | None]:
    """The model ``hf-precision audit`` checks: ``(model, config, load dtype, where the dtypes
    come from, a note)``; built on the meta device unless ``--weights``."""
    from .dtypes import parse_dtype

    kind, where = resolve_source(args.source)
    config = load_config(kind, where)
    dtype = None if args.dtype == "auto" else parse_dtype(args.dtype, call="--dtype")
    stored = stored_dtypes(where) if kind == "path" and Path(where).is_dir() else {}
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
    if args.weights:
        if kind != "path" or not Path(where).is_dir():
            fail("--weights needs a local checkpoint folder")
        cls = model_classes(config)[0]
        # transformers spells the load dtype ``dtype`` since 4.56, ``torch_dtype`` before: the
        # config says which (a feature check, not a version check)
        key = "dtype" if "dtype" in dir(config) else "torch_dtype"
        model = cls.from_pretrained(str(where), local_files_only=True, **{key: dtype or "auto"})
        dtype_from = dtype_from or "as loaded"
    elif kind == "type":
        model, note = build_bare(str(where), dtype=dtype)
    else:
        model = build_model(config, meta=True, dtype=dtype)
        if stored and dtype is None:
            matched, total = apply_stored_dtypes(model, stored)
            dtype_from = f"as stored in the safetensors files ({matched} of {total} tensors"
            dtype_from += ")" if matched == total else "; the rest in the config's dtype)"
    return model, config, dtype, dtype_from, note


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
    from .policy import PrecisionPolicy

    policy = PrecisionPolicy.from_preset(args.policy)
    model, config, dtype, dtype_from, note = _audit_model(args, policy)
    set_trainable(model, args.trainable)
    report = check_policy(model, policy)
    dmap = dtype_map(model, report.groups, policy=policy)
    audit = _Audit(args, model, config, dtype, dtype_from, note, policy, report, dmap)
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

    @property
    def ok(self) -> bool:
        return not self.report.changes and not self.report.overflow

    @property
    def by_group(self) -> dict[str, dict[str, int]]:
        """group -> {"before->after": count} of the casts the policy asks for."""
        out: dict[str, dict[str, int]] = {}
        for c in self.report.changes:
            key = f"{c.before}->{c.after}"
            out.setdefault(c.group, {})[key] = out.setdefault(c.group, {}).get(key, 0) + 1
        return out

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
            "groups": self.dmap.group_rows(),
            "changes": [c.__dict__ for c in report.changes],
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
        frozen = dtype_name(policy.frozen_dtype or torch.float32)
        print(
            f"VIOLATES policy {policy.describe()}: {len(report.changes)} tensor(s) would be "
            f"cast ({detail}). PrecisionGuardCallback casts them at on_init_end; or load with "
            f"from_pretrained(..., dtype=torch.{frozen})."
        )
        for name, value in report.overflow:
            print(f"  {name}: max |value| {value:g} exceeds the fp16 range")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-precision`` command; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
        if args.command == "audit":
            return _audit(args)
        if args.command in ("run", "install-hook"):
            from .integrations.launcher import run_cli

            return run_cli(args)
        if args.command == "architectures":
            from .groups import architecture_table

            print(architecture_table(), end="")
            return 0
        from .doctor import doctor

        return doctor(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    except PrecisionError as err:
        print(f"hf-precision: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
