"""The fields of a policy that are words, and the one check of a new policy's fields: the
mode and leaf-guard vocabularies, dtype names parsed, group names known, ``re:`` patterns that
compile. :class:`~hf_precision.PrecisionPolicy` runs :func:`normalise` once, as it
is built.

>>> MODES, LEAF_GUARDS
(('audit', 'fix', 'raise'), ('auto', 'on', 'off'))
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args

import torch

from ...errors import PrecisionError, did_you_mean
from ..dtypes import parse_dtype
from ..groups.group_rule import group_names

__all__ = ["LEAF_GUARDS", "MODES", "LeafGuards", "Mode", "normalise"]

#: What an event does with drift: report it, fix it, or raise.
Mode = Literal["audit", "fix", "raise"]
MODES: tuple[Mode, ...] = get_args(Mode)
LeafGuards = Literal["auto", "on", "off"]
LEAF_GUARDS: tuple[LeafGuards, ...] = get_args(LeafGuards)


def _parse_mapping(value: Mapping[str, Any] | None, *, call: str) -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    known = group_names()
    for group, dt in (value or {}).items():
        if group not in known:
            hint = did_you_mean(group, known)
            raise PrecisionError(
                f"{call}: unknown group {group!r}.{hint}\nAllowed: {', '.join(known)}.\n"
                "Fix: use one of these, or "
                "hf_precision.rules.groups.group_rule.register_group(name) first."
            )
        out[group] = parse_dtype(dt, call=f"{call}[{group!r}]")
    return out


def _choice(value: str, allowed: Iterable[str], *, call: str, what: str) -> str:
    allowed = tuple(allowed)
    if value in allowed:
        return value
    hint = did_you_mean(value, allowed)
    raise PrecisionError(
        f"{call}: unknown {what} {value!r}.{hint}\nAllowed: {', '.join(allowed)}.\n"
        f"Fix: pass one of these."
    )


def _patterns(value: str | Iterable[str], *, call: str) -> tuple[str, ...]:
    """Path patterns as a tuple (one string is one pattern); a bad ``re:`` regex raises."""
    out = (value,) if isinstance(value, str) else tuple(value)
    for pat in out:
        if pat.startswith("re:"):
            try:
                re.compile(pat[3:])
            except re.error as err:
                raise PrecisionError(
                    f"{call}: bad regex {pat!r}: {err}. Fix: escape it or drop the 're:' "
                    "prefix for a plain path."
                ) from err
    return out


def normalise(policy: Any) -> None:
    """Check and normalise the fields of a new :class:`~hf_precision.PrecisionPolicy`
    in place (it is frozen: once, from its ``__post_init__``)."""
    call = "PrecisionPolicy(...)" if policy.name is None else f"PrecisionPolicy[{policy.name}]"
    set_ = object.__setattr__  # frozen: normalise once, here
    compute = parse_dtype(policy.compute_dtype, call=f"{call}.compute_dtype")
    set_(policy, "compute_dtype", compute)
    set_(
        policy,
        "frozen_dtype",
        parse_dtype(
            compute if policy.frozen_dtype is None else policy.frozen_dtype,
            call=f"{call}.frozen_dtype",
        ),
    )
    if policy.trainable_dtype is not None:
        set_(
            policy,
            "trainable_dtype",
            parse_dtype(policy.trainable_dtype, call=f"{call}.trainable_dtype"),
        )
    if policy.full_eval_dtype is not None:
        set_(
            policy,
            "full_eval_dtype",
            parse_dtype(policy.full_eval_dtype, call=f"{call}.full_eval_dtype"),
        )
    set_(policy, "group_dtypes", _parse_mapping(policy.group_dtypes, call=f"{call}.group_dtypes"))
    for name in ("keep_fp32", "keep_out_of_fp8"):
        set_(policy, name, _patterns(getattr(policy, name), call=f"{call}.{name}"))
    set_(policy, "mode", _choice(policy.mode, MODES, call=f"{call}.mode", what="mode"))
    set_(
        policy,
        "leaf_guards",
        _choice(
            policy.leaf_guards, LEAF_GUARDS, call=f"{call}.leaf_guards", what="leaf_guards value"
        ),
    )
    set_(policy, "batch_skip_keys", tuple(policy.batch_skip_keys))
    set_(policy, "batch_key_groups", dict(policy.batch_key_groups))
    known = group_names()
    for key, group in policy.batch_key_groups.items():
        _choice(group, known, call=f"{call}.batch_key_groups[{key!r}]", what="group")
