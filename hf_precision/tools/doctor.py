"""``hf-precision doctor``: load the model (a checkpoint with each tensor in the dtype it is
stored in, a config with random weights, or a tiny build of a model type), enforce the policy
(as ``PrecisionGuardCallback`` does at ``on_init_end``), install the guard (``--mode fix`` by
default, as the callback runs it; ``--mode raise`` makes every cast it would need an error), run
one training forward+backward and a ``generate()`` (generative models) on a synthetic batch
(image+text for vision-language models, text for causal LM / seq2seq / classifiers), and print
the diagnosis.

Mixed presets (``bf16``, ``fp16``) train under autocast, as ``Trainer`` does; autocast resolves
dtype differences itself, so there the guard works as in training (mode ``"fix"``) and what
autocast handled is counted as information, apart from failures and from mismatches outside
autocast; ``generate()`` runs without autocast and the guard in ``--mode`` (``fix`` by
default).

>>> from hf_precision.tools.cli import main
>>> main(["doctor", "llava", "--policy", "bf16-true"])  # doctest: +SKIP
0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import checkpoint, weight_files
from .exits import fail


def _is_vision(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None or hasattr(config, "image_size")


def _doctor_model(args: argparse.Namespace) -> tuple[Any, dict[str, Any], str | None]:
    """The model, its synthetic batch, and how it was loaded (``None`` for a tiny build)."""
    from ..tiny import REMOTE_LAYOUTS, TINY_CONFIGS, build_tiny

    kind, where = _doctor_source(args)
    model: Any
    loaded = None
    if kind == "type":
        if where in REMOTE_LAYOUTS:
            model = REMOTE_LAYOUTS[where]()
            return model, model.batch(), None
        try:
            model = build_tiny(where)
        except KeyError:
            allowed = sorted(set(TINY_CONFIGS) | set(REMOTE_LAYOUTS))
            fail(
                f"doctor: no tiny model for model type {where!r}; allowed: "
                f"{', '.join(allowed)} (or a local checkpoint folder / config.json)"
            )
    else:
        model, loaded = _load_checkpoint(args, where)
    return model, _doctor_batch(args, model, kind), loaded


def _doctor_source(args: argparse.Namespace) -> tuple[str, Any]:
    """What ``args.source`` is (a model type, a local folder or config; a Hub id only through
    its downloaded weights) and where; adapter and diffusers folders are refused."""
    kind, where = checkpoint.resolve_source(args.source)
    if kind == "hub":
        repo = where
        where, _, headers = checkpoint.resolve_hub(repo)
        if headers is not None:  # online: only the config was fetched, no weights
            fail(
                f"doctor: {repo} runs with its weights, which the doctor does not download: "
                f"fetch them once (hf download {repo}) and pass the Hub id offline "
                "(HF_HUB_OFFLINE=1) or the folder"
            )
        kind = next((k for m, k in checkpoint.MARKERS if (where / m).is_file()), "path")
    if kind in ("adapter", "diffusers", "component"):
        fail(
            f"doctor: {args.source} is a {kind.replace('component', 'diffusers component')} "
            "folder; the doctor runs a transformers model "
            f"(a checkpoint folder, a config.json or a model type). 'hf-precision audit "
            f"{args.source}' reads its dtypes."
        )
    return kind, where


def _doctor_batch(args: argparse.Namespace, model: Any, kind: str) -> dict[str, Any]:
    """The synthetic batch the doctor runs: image+text for a tiny build or a vision model,
    text for a text model."""
    from ..tiny import tiny_batch

    try:
        if kind == "type" or _is_vision(model.config):
            return tiny_batch(
                model,
                image_size=args.image_size,
                text_len=args.text_len,
                image_token_id=args.image_token_id,
            )
        return text_batch(model, text_len=args.text_len)
    except KeyError:  # no recipe: no flag would help
        from ..tiny.vlm import BATCH_TYPES

        fail(
            f"doctor: no synthetic image+text batch for model type "
            f"{getattr(model.config, 'model_type', None)!r} ({type(model).__name__}); the doctor "
            f"builds them for {', '.join(BATCH_TYPES)}. 'hf-precision audit {args.source}' "
            "reads the dtypes of any"
        )
    except ValueError as err:
        fail(
            f"doctor: cannot build a synthetic batch for {type(model).__name__}: {err}. "
            f"{_batch_fix(model)}"
        )


def _load_checkpoint(args: argparse.Namespace, where: Any) -> tuple[Any, str]:
    """A local checkpoint with its weights, each tensor in the dtype it is stored in (loaded in
    float32, then every tensor cast back to its stored dtype: exact, bf16/fp16 values widen to
    float32 without loss), or a config built with random weights."""
    import torch

    config = checkpoint.load_config("path", where)
    stored = weight_files.stored_dtypes(where) if Path(where).is_dir() else {}
    if stored:
        key = "dtype" if "dtype" in dir(config) else "torch_dtype"  # 4.56+ / before
        model = checkpoint.model_classes(config)[0].from_pretrained(
            str(where), local_files_only=True, **{key: torch.float32}
        )
        matched, total = checkpoint.apply_stored_dtypes(model, stored)
        kinds = sorted({str(d).removeprefix("torch.") for d in stored.values()})
        return model, (
            f"from_pretrained in float32, then each tensor back to its stored dtype "
            f"({matched} of {total} tensors; stored: {', '.join(kinds)})"
        )
    n = sum(p.numel() for p in checkpoint.build_model(config, meta=True).parameters())
    if n > args.max_params:
        fail(
            f"doctor: {where} describes {n:,} parameters (> --max-params "
            f"{args.max_params:,}); use 'hf-precision audit' or a tiny checkpoint"
        )
    return checkpoint.build_model(config, meta=False), "built from the config, random weights"


def text_batch(model: Any, batch_size: int = 2, text_len: int | None = None) -> dict[str, Any]:
    """A synthetic batch for a text-only model: ``input_ids``/``attention_mask`` and the labels
    its head takes (next tokens for causal/masked LMs, decoder labels for seq2seq, one class
    per row for classifiers)."""
    import torch

    cfg = model.config
    vocab = int(getattr(cfg.get_text_config(), "vocab_size", 0) or 0)
    if vocab < 8:
        raise ValueError(f"vocab_size {vocab} is too small for a text batch")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, min(vocab, 200), (batch_size, text_len or 6), generator=g)
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    name = type(model).__name__
    if "ForSequenceClassification" in name:
        batch["labels"] = torch.zeros(batch_size, dtype=torch.long)
    elif "ForTokenClassification" in name:
        batch["labels"] = torch.zeros_like(ids)
    elif name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")):
        batch["labels"] = ids.clone()
    return batch


_BATCH_FIX = (
    "The batch is built from the config (vocab size, image token id, image size); pass the "
    "values your processor uses: --image-size N, --text-len N, --image-token-id N"
)


def _batch_fix(model: Any) -> str:
    if _is_vision(model.config):
        return _BATCH_FIX
    return (
        "The text batch is built from the config (vocab size); pass the length your data uses: "
        "--text-len N"
    )


def _run(diagnose: Any, model: Any, batch: dict[str, Any], **kwargs: Any) -> Any:
    """``diagnose`` on the synthetic batch; a batch that does not fit the model (shape, index)
    ends in a one-line message saying which values to pass, not a traceback."""
    from .diagnostics import is_mismatch_error

    try:
        return diagnose(model, batch, **kwargs)
    except (IndexError, RuntimeError, ValueError) as err:
        if isinstance(err, RuntimeError) and is_mismatch_error(err):
            raise
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items() if hasattr(v, "shape"))
        fail(
            f"doctor: the synthetic batch ({shapes}) does not fit {type(model).__name__}: "
            f"{type(err).__name__}: {str(err).splitlines()[0][:200]}. {_batch_fix(model)}"
        )


def doctor(args: argparse.Namespace) -> int:
    """``hf-precision doctor``: enforce, guard, one training step and ``generate()``."""
    from ..engine.batch import cast_batch, key_dtypes_for
    from ..engine.enforce import enforce_policy
    from ..model.dtype_maps import receiving_dtypes
    from ..rules.policy.parse import parse_policy

    policy = parse_policy(args.policy)
    model, batch, loaded = _doctor_model(args)
    checkpoint.set_trainable(model, args.trainable)
    model.train()
    steps = {"load": loaded} if loaded else {}
    report = enforce_policy(model, policy, mode="fix")
    steps["enforce"] = f"cast {len(report.changes)} tensor(s) to the policy" + (
        f" ({_casts(report)})" if report.changes else ""
    )
    if args.batch == "fixed":  # what PrecisionCollator does; "raw" leaves it to the batch guard
        keyed = key_dtypes_for(policy, receiving_dtypes(model, report.groups))
        batch = cast_batch(
            batch, policy.compute_dtype, key_dtypes=keyed, skip_keys=policy.batch_skip_keys
        )
    results = _diagnose_steps(args, model, batch, policy, report, steps)
    silent = _silent_checks(args, model, batch, policy, report)
    if getattr(args, "headroom", False):
        from ..watch.headroom import probe_headroom

        silent["headroom"] = probe_headroom(model, batch)
    ok = all(d.ok for d in results.values()) and "nonfinite" not in silent
    ok = ok and not _fp16_overflow(policy, silent.get("headroom"))
    if args.json:
        _print_json(args, model, policy, ok, steps, results, silent)
    else:
        _print_text(args, model, policy, ok, steps, results, silent)
    return 0 if ok else 1


def _print_json(
    args: argparse.Namespace,
    model: Any,
    policy: Any,
    ok: bool,
    steps: dict[str, str],
    results: dict[str, Any],
    silent: dict[str, Any],
) -> None:
    print(
        json.dumps(
            {
                "source": args.source,
                "model_class": type(model).__name__,
                "policy": policy.to_dict(),
                "ok": ok,
                "steps": steps,
                "batch": args.batch,
                "trainable": args.trainable,
                "diagnosis": {k: d.to_dict() for k, d in results.items()},
                **{k: v.to_dict() for k, v in silent.items() if k != "clean"},
            },
            indent=1,
            default=str,
        )
    )


def _print_text(
    args: argparse.Namespace,
    model: Any,
    policy: Any,
    ok: bool,
    steps: dict[str, str],
    results: dict[str, Any],
    silent: dict[str, Any],
) -> None:
    print(
        f"hf-precision doctor: {type(model).__name__} from {args.source}, policy "
        f"{policy.describe()}, trainable {args.trainable}, batch {args.batch}"
    )
    for k, v in steps.items():
        print(f"  {k}: {v}")
    for k, d in results.items():
        print(f"\n[{k}] " + str(d))
    for k, v in silent.items():
        print(f"\n[{k}] " + (v if isinstance(v, str) else v.line()))
    bad = silent.get("nonfinite")
    print(
        f"\n{'OK' if ok else 'FAILED'}: "
        + ", ".join(_summary(k, d) for k, d in results.items())
        + (f"; {bad.module} made {bad.kind} values ({bad.role})" if bad is not None else "")
        + (
            f"; {len(silent['headroom'].beyond('float16'))} module(s) leave float16 (headroom)"
            if _fp16_overflow(policy, silent.get("headroom"))
            else ""
        )
    )
    if not ok and args.mode == "raise":
        print(
            "note: --mode raise makes every cast the guard would need an error; "
            "PrecisionGuardCallback runs mode 'fix' (the doctor's default): drop --mode raise "
            "to see what a training run meets"
        )


def _fp16_overflow(policy: Any, headroom: Any) -> bool:
    """A float16 policy whose activations leave the float16 range (``--headroom``): the run
    would meet inf where the probe saw these values."""
    import torch

    return (
        headroom is not None
        and policy.compute_dtype == torch.float16
        and bool(headroom.beyond("float16"))
    )


def _casts(report: Any) -> str:
    """``group before->after xN`` of the casts enforce_policy made."""
    counts: dict[str, int] = {}
    for c in report.changes:
        key = f"{c.group} {c.before}->{c.after}"
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{k} x{n}" for k, n in counts.items())


def _summary(step: str, d: Any) -> str:
    """``train ok (autocast handled 9 dtype differences)``: failures apart from what autocast
    handled (information: that is autocast doing its work)."""
    if not d.ok:
        return f"{step} failed"
    handled = len(d.autocast_handled)
    return f"{step} ok" + (f" (autocast handled {handled} dtype difference(s))" if handled else "")


def _diagnose_steps(
    args: argparse.Namespace,
    model: Any,
    batch: dict[str, Any],
    policy: Any,
    report: Any,
    steps: dict[str, str],
) -> dict[str, Any]:
    """One guarded training step (``"train"``) and a ``generate()`` (``"generate"``), each
    recorded by :func:`hf_precision.diagnose`; ``steps`` gets a line per step."""
    import torch

    from ..engine.hooks import install_guards
    from ..rules.dtypes import dtype_name
    from .diagnostics import diagnose

    def guard(mode: str) -> Any:
        pol = policy.replace(mode=mode, cast_batch=args.batch == "raw")
        return install_guards(model, pol, report, groups=report.groups)

    # Trainer runs mixed presets under autocast, which resolves dtype differences itself: there
    # the guard works as in training (mode "fix") and the mismatches autocast hides are listed.
    mixed = policy.is_mixed and policy.compute_dtype != torch.float32
    train_mode = "fix" if mixed else args.mode
    handle = guard(train_mode)
    # a backward needs something trained (--trainable); with nothing, the forward alone
    backward = any(p.requires_grad for p in model.parameters())
    steps["train"] = (
        ("forward+backward" if backward else "forward (nothing trainable: --trainable GROUPS)")
        + f", guard mode {train_mode!r}, "
        + (f"autocast {dtype_name(policy.compute_dtype)}" if mixed else "no autocast")
    )
    results = {}
    try:
        results["train"] = _run(
            diagnose,
            model,
            batch,
            backward=backward,
            policy=policy,
            autocast=policy.compute_dtype if mixed else None,
            raise_on_error=False,
        )
        if not args.no_generate and getattr(model, "can_generate", lambda: False)():
            model.eval()
            handle = guard(args.mode)
            steps["generate"] = f"generate(), guard mode {args.mode!r}, no autocast"
            results["generate"] = _run(
                diagnose,
                model,
                batch,
                forward=False,
                generate=True,
                policy=policy,
                raise_on_error=False,
            )
    finally:
        handle.remove()
    return results


def _silent_checks(
    args: argparse.Namespace, model: Any, batch: dict[str, Any], policy: Any, report: Any
) -> dict[str, Any]:
    """``--trace``: one forward recorded module by module (``"trace"``; the picture in
    ``--report-dir``); ``--blame``: ``auto`` runs the batch once and, when the loss or a
    gradient is non-finite, re-runs the same batch armed; ``always`` runs it armed
    (``"nonfinite"``, or ``"clean"``: a line saying all was finite)."""
    import torch

    from ..engine.hooks import install_guards
    from ..watch.blame import blame_batch
    from ..watch.trace import trace_forward

    mixed = policy.is_mixed and policy.compute_dtype != torch.float32
    autocast = policy.compute_dtype if mixed else None
    handle = install_guards(model, policy.replace(mode="fix"), report, groups=report.groups)
    out: dict[str, Any] = {}
    model.train()
    try:
        if getattr(args, "trace", False):
            trace = trace_forward(model, **batch, autocast=autocast)
            out["trace"] = trace
            if getattr(args, "report_dir", None):
                from ..report.plot import plot_trace

                Path(args.report_dir).mkdir(parents=True, exist_ok=True)
                png = Path(args.report_dir) / "doctor-trace.png"
                plot_trace(trace, png, title=f"{type(model).__name__}: activation dtype trace")
                Path(args.report_dir, "doctor-trace.json").write_text(
                    json.dumps(trace.to_dict(), indent=1)
                )
        mode = getattr(args, "blame", "off")
        backward = any(p.requires_grad for p in model.parameters())
        if mode == "always" or (mode == "auto" and not _finite_step(model, batch, autocast)):
            why = "blame='always'" if mode == "always" else "the loss or a gradient was non-finite"
            finding = blame_batch(
                model, batch, backward=backward, autocast=autocast, trigger=f"doctor, {why}"
            )
            if finding is not None:
                out["nonfinite"] = finding
        if mode != "off" and "nonfinite" not in out:
            out["clean"] = f"blame {mode}: the loss and every module's output were finite"
    finally:
        handle.remove()
    return out


def _finite_step(model: Any, batch: dict[str, Any], autocast: Any) -> bool:
    """One forward (+backward when something is trained): loss and gradients finite?"""
    import torch

    from ..watch.blame import is_nonfinite

    device = next((p.device.type for p in model.parameters()), "cpu")
    with torch.autocast(device, dtype=autocast or torch.float32, enabled=autocast is not None):
        out = model(**batch)
    loss = out.get("loss") if isinstance(out, dict) else None
    if loss is None:
        return True
    ok = not is_nonfinite(loss)
    if ok and loss.requires_grad:
        loss.backward()
        ok = not any(p.grad is not None and is_nonfinite(p.grad) for p in model.parameters())
    model.zero_grad(set_to_none=True)
    return ok
