"""The console lines of the engine (:class:`~hf_precision.engine.guard.PrecisionGuard`) and its
front ends: what a setup cast (:func:`cast_line`), the memory upcast weights take
(:func:`memory_line`), what keep rules held (:func:`kept_words`), a flag that conflicts with
an explicit policy (:func:`flag_conflict`) and where a policy came from
(:func:`policy_origin`). Pure functions of a plan's report and a policy: they print nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import PrecisionError
from ..rules.dtypes import dtype_name
from ..rules.policy.precedence import KEEP_RULES
from ..rules.policy.precision_policy import PrecisionPolicy
from .records import EnforceReport

__all__ = [
    "bridged_line",
    "cast_line",
    "flag_conflict",
    "kept_as_is",
    "kept_words",
    "memory_line",
    "policy_origin",
]


_HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}
#: how many tensor names the console line lists
_NAMED = 3
_RULE_WORDS = {
    "frozen": "frozen",
    "trainable": "trainable",
    "keep_trainable_fp32": "trainable kept fp32",
    "device": "moved",
}


def _why(reason: str) -> str:
    """A plan record's reason (its ``Decision``'s) in words."""
    return _RULE_WORDS.get(reason, reason)


def cast_line(report: EnforceReport, *, origin: str | None, report_dir: str | None) -> str:
    """The one console line for what a guard cast at setup: target dtypes with counts and the
    rule that decided each, the first names, where the policy came from, the report's path.

    ``hf-precision: 46 tensors → bfloat16 (frozen), 18 → float32 (trainable) in projector,
    language_model (e.g. ...); policy bf16 (...), inferred from TrainingArguments(bf16=True);
    report: out/precision/``
    """
    by_dtype: dict[str, dict[str, int]] = {}
    moved: dict[str, int] = {}
    for c in report.changes:
        if c.before == c.after:
            moved[c.device_after] = moved.get(c.device_after, 0) + 1
            continue
        rules = by_dtype.setdefault(c.after, {})
        rules[_why(c.reason)] = rules.get(_why(c.reason), 0) + 1
    parts = []
    for i, (dtype, rules) in enumerate(
        sorted(by_dtype.items(), key=lambda kv: -sum(kv[1].values()))
    ):
        n = sum(rules.values())
        ranked = sorted(rules.items(), key=lambda kv: -kv[1])
        why = ranked[0][0] if len(ranked) == 1 else ", ".join(f"{k} {v}" for k, v in ranked)
        parts.append(f"{n}{' tensors' if i == 0 else ''} → {dtype} ({why})")
    parts += [f"{n} moved to {dev}" for dev, n in moved.items()]
    held = kept_words(report)
    touched = {c.group for c in report.changes}
    order = [g for g in report.groups.names if g in touched]  # forward order, then the rest
    groups = ", ".join(order + sorted(touched - set(order)))
    named = [f"{c.name} {c.before} → {c.after}" for c in report.changes[:_NAMED]]
    more = len(report.changes) - len(named)
    names = "; ".join(named) + (f"; and {more} more" if more > 0 else "")
    source = f", {origin}" if origin else ""
    return (
        f"hf-precision: {', '.join(parts)} in {groups} (e.g. {names}); "
        + (f"{held}; " if held else "")
        + "policy "
        f"{report.policy.describe()}{source}; report: {report_dir or 'off (report=False)'}"
    )


def kept_as_is(report: EnforceReport) -> bool:
    """A rule kept a tensor in its own (half) dtype on purpose (``wrapper_master_fp32``); 0-D
    scalars kept as they are (rule ``scalar``) are in the report, not worth a line alone."""
    return any(k[2] not in (*KEEP_RULES, "scalar") for k in report.kept)


def kept_words(report: EnforceReport) -> str:
    """What keep rules held on purpose, for the console: ``kept in float32 on purpose: 4
    (deliberate_fp32); kept in their dtype on purpose: 8 (wrapper_master_fp32)``; ``""`` for
    none. Rotary tables (every model has them) are in the report, not on the console."""
    by_rule: dict[str, int] = {}
    for _, _, rule, _ in report.kept:
        if rule != "rotary":
            by_rule[rule] = by_rule.get(rule, 0) + 1
    parts = []
    for words, rules in (
        ("kept in float32 on purpose", {r: n for r, n in by_rule.items() if r in KEEP_RULES}),
        (
            "kept in their dtype on purpose",
            {r: n for r, n in by_rule.items() if r not in KEEP_RULES},
        ),
    ):
        if rules:
            ranked = sorted(rules.items(), key=lambda kv: -kv[1])
            parts.append(f"{words}: " + ", ".join(f"{n} ({rule})" for rule, n in ranked))
    return "; ".join(parts)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def memory_line(report: EnforceReport) -> str | None:
    """Bytes before → after per group where the setup upcast weights (the memory a user of
    PEFT's ``print_trainable_parameters()`` watches), with the rules that decided; ``None``
    when no weight grew."""
    before: dict[str, int] = {}
    after: dict[str, int] = {}
    rules: dict[str, int] = {}
    for item in report.planned:
        t, change = item.tensor, item.change
        was = getattr(torch, change.before, None)  # the tensor may hold its new data already
        if not isinstance(was, torch.dtype):
            continue
        size, new = _itemsize(was), _itemsize(item.dtype)
        if change.kind != "param" or new <= size:
            continue
        before[change.group] = before.get(change.group, 0) + t.numel() * size
        after[change.group] = after.get(change.group, 0) + t.numel() * new
        rules[_why(change.reason)] = rules.get(_why(change.reason), 0) + 1
    if not before:
        return None
    from ..base.tables import fmt_bytes

    listed = ", ".join(
        f"{g} {fmt_bytes(before[g])} → {fmt_bytes(after[g])}" for g in sorted(before)
    )
    why = ", ".join(f"{k} {v}" for k, v in sorted(rules.items(), key=lambda kv: -kv[1]))
    return (
        f"hf-precision: upcast weights take more memory: {listed} "
        f"({sum(rules.values())} weights; rule: {why})"
    )


def flag_conflict(
    policy: PrecisionPolicy,
    flag: str | None,
    *,
    call: str,
    said: str,
    runner: str,
    owner: str,
    words: Any,
) -> PrecisionError | str | None:
    """What a mixed-precision flag (``"bf16"``/``"fp16"``, ``None``: no flag) and an explicit
    policy make together, checked before anything is cast: a :class:`PrecisionError` when they
    cannot run together (a half dtype of the policy is not the one autocast computes in: the
    two meet in every op autocast promotes), a warning text when it runs but is not what either
    says (fp32 weights under autocast), else ``None``.

    ``call`` is the user's call, ``said`` how the user set the flag (``bf16: true``), ``runner``
    who autocasts (``the Trainer``), ``owner`` the front end's name and ``words(flag, value)``
    the flag in the user's tool (:func:`hf_precision.rules.flags.flag`).
    """
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(flag or "")
    if autocast is None:
        return None
    held = (policy.compute_dtype, policy.frozen_dtype, policy.trainable_dtype)
    halves = {d for d in (*held, *policy.group_dtypes.values()) if d in _HALF}
    other = sorted(halves - {autocast}, key=str)
    follow = f"{owner}() (it follows {said}), or {owner}({flag!r})"
    if other:
        theirs = other[0]
        return PrecisionError(
            f"{call} with {said}: {runner} autocasts to {dtype_name(autocast)}, but the policy "
            f"holds weights in {dtype_name(theirs)} ({policy.describe()}). {dtype_name(theirs)} "
            f"weights under {dtype_name(autocast)} autocast fail in the first op that mixes "
            "them ('RuntimeError: Unexpected floating ScalarType in "
            "at::autocast::prioritize', 'expected scalar type'). Nothing was cast.\n"
            f"Fix: {follow}, or train in {dtype_name(theirs)}: "
            f"{words(_HALF[theirs], True)} instead of {said}."
        )
    if policy.compute_dtype != autocast:
        return (
            f"{call} with {said}: {runner} autocasts to {dtype_name(autocast)}, but the policy "
            f"keeps weights in {dtype_name(policy.compute_dtype)} ({policy.describe()}): it "
            f"runs, with {dtype_name(policy.compute_dtype)} memory for weights that compute in "
            f"{dtype_name(autocast)}. Fix: {follow}, or {words(flag, False)} to train in "
            f"{dtype_name(policy.compute_dtype)}."
        )
    return None


def policy_origin(policy: PrecisionPolicy, inferred: bool, said: str, call: str) -> str:
    """Where a front end's policy came from, in the user's words: the flag it follows
    (``said``), the no-flag rule, or the user's own ``call``."""
    if not inferred:
        return f"as given: {call}"
    if said:
        return f"inferred from {said}"
    return (
        f"no precision flag: frozen weights follow the language model's "
        f"{dtype_name(policy.group_dtype('language_model'))}, trainable weights keep the "
        "dtype they were "
        "loaded in"
    )


def bridged_line(
    kind: str,
    path: str,
    what: str,
    src: torch.dtype,
    dst: torch.dtype,
    cast: bool,
    report_dir: str | None,
) -> str:
    """The console line for a guard that cast an input at run time (once per kind); ``cast``:
    whether the setup cast weights."""
    # what was done, not what would have happened without it: a run that would have
    # finished anyway (autocast, a script's own casts) is not "kept going" by the hooks
    how = (
        "the guard cast weights at setup and its hooks bridge the rest"
        if cast
        else "nothing in the model was cast: its hooks cast inputs at the boundary"
    )
    where = f" at {path}" if path else ""
    return (
        f"hf-precision: the {kind} guard{where} casts {what} {dtype_name(src)} → "
        f"{dtype_name(dst)} (said once per guard kind); {how}; report: {report_dir or 'off'}"
    )
