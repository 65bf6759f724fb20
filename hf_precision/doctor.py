"""``hf-precision doctor``: build or load the model, enforce the policy (as
``PrecisionGuardCallback`` does at ``on_init_end``), install the guard in raise mode, run one
training forward+backward and a ``generate()`` on a synthetic batch, and print the diagnosis.

Mixed presets (``bf16``, ``fp16``) train under autocast, as ``Trainer`` does; autocast resolves
dtype differences itself, so there the guard works as in training (mode ``"fix"``) and the
mismatches autocast hides are listed; ``generate()`` runs without autocast and the guard in
``--mode`` (``raise`` by default).

>>> from hf_precision.cli import main
>>> main(["doctor", "llava", "--policy", "bf16-true"])  # doctest: +SKIP
0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import checkpoint


def _doctor_model(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    from .tiny import REMOTE_LAYOUTS, TINY_CONFIGS, build_tiny, tiny_batch

    kind, where = checkpoint.resolve_source(args.source)
    model: Any
    if kind == "type":
        if where in REMOTE_LAYOUTS:
            model = REMOTE_LAYOUTS[where]()
            return model, model.batch()
        try:
            model = build_tiny(where)
        except KeyError:
            allowed = sorted(set(TINY_CONFIGS) | set(REMOTE_LAYOUTS))
            checkpoint.fail(
                f"doctor: no tiny model for model type {where!r}; allowed: "
                f"{', '.join(allowed)} (or a local checkpoint folder / config.json)"
            )
    else:
        config = checkpoint.load_config(kind, where)
        if Path(where).is_dir() and any(Path(where).glob("*.safetensors")):
            model = checkpoint.model_classes(config)[0].from_pretrained(
                str(where), local_files_only=True
            )
        else:
            n = sum(p.numel() for p in checkpoint.build_model(config, meta=True).parameters())
            if n > args.max_params:
                checkpoint.fail(
                    f"doctor: {where} describes {n:,} parameters (> --max-params "
                    f"{args.max_params:,}); use 'hf-precision audit' or a tiny checkpoint"
                )
            model = checkpoint.build_model(config, meta=False)
    try:
        return model, tiny_batch(
            model,
            image_size=args.image_size,
            text_len=args.text_len,
            image_token_id=args.image_token_id,
        )
    except (KeyError, ValueError) as err:
        checkpoint.fail(
            f"doctor: cannot build a synthetic batch for {type(model).__name__}: {err}. "
            f"{_BATCH_FIX}"
        )


_BATCH_FIX = (
    "The batch is built from the config (vocab size, image token id, image size); pass the "
    "values your processor uses: --image-size N, --text-len N, --image-token-id N"
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
        checkpoint.fail(
            f"doctor: the synthetic batch ({shapes}) does not fit {type(model).__name__}: "
            f"{type(err).__name__}: {str(err).splitlines()[0][:200]}. {_BATCH_FIX}"
        )


def doctor(args: argparse.Namespace) -> int:
    """``hf-precision doctor``: enforce, guard, one training step and ``generate()``."""
    from .batch import cast_batch, key_dtypes_for
    from .enforce import enforce_policy
    from .hooks import receiving_dtypes
    from .policy import PrecisionPolicy

    policy = PrecisionPolicy.from_preset(args.policy)
    model, batch = _doctor_model(args)
    checkpoint.set_trainable(model, args.trainable)
    model.train()
    report = enforce_policy(model, policy, mode="fix")
    steps = {"enforce": f"cast {len(report.changes)} tensor(s) to the policy"}
    if args.batch == "fixed":  # what PrecisionCollator does; "raw" leaves it to the batch guard
        keyed = key_dtypes_for(policy, receiving_dtypes(model, report.groups))
        batch = cast_batch(
            batch, policy.compute_dtype, key_dtypes=keyed, skip_keys=policy.batch_skip_keys
        )
    results = _diagnose_steps(args, model, batch, policy, report, steps)
    ok = all(d.ok for d in results.values())
    if args.json:
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
                },
                indent=1,
                default=str,
            )
        )
        return 0 if ok else 1
    print(
        f"hf-precision doctor: {type(model).__name__} from {args.source}, policy "
        f"{policy.describe()}, trainable {args.trainable}, batch {args.batch}"
    )
    for k, v in steps.items():
        print(f"  {k}: {v}")
    for k, d in results.items():
        print(f"\n[{k}] " + str(d))
    print(
        f"\n{'OK' if ok else 'FAILED'}: "
        + ", ".join(f"{k} {'ok' if d.ok else 'failed'}" for k, d in results.items())
    )
    return 0 if ok else 1


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

    from .diagnostics import diagnose
    from .hooks import install_guards

    def guard(mode: str) -> Any:
        pol = policy.replace(mode=mode, cast_batch=args.batch == "raw")
        return install_guards(model, pol, report, groups=report.groups)

    # Trainer runs mixed presets under autocast, which resolves dtype differences itself: there
    # the guard works as in training (mode "fix") and the mismatches autocast hides are listed.
    mixed = policy.is_mixed and policy.compute_dtype != torch.float32
    train_mode = "fix" if mixed else args.mode
    handle = guard(train_mode)
    steps["train"] = f"forward+backward, guard mode {train_mode!r}, " + (
        f"autocast {policy.compute_dtype}" if mixed else "no autocast"
    )
    results = {}
    try:
        results["train"] = _run(
            diagnose,
            model,
            batch,
            backward=True,
            policy=policy,
            autocast=policy.compute_dtype if mixed else None,
            raise_on_error=False,
        )
        if not args.no_generate:
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
