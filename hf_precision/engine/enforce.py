"""``enforce_policy``: the one function in hf-precision that changes a model.

It is two steps on one walk of the model (:class:`~hf_precision.model.view.ModelView`): plan
(:func:`~hf_precision.engine.plan.plan_policy`, frozen and pure) and apply (:func:`apply_plan`,
the one place that casts). It casts parameters and buffers group by group, in place: each
``nn.Parameter`` keeps its identity (``param.data`` is replaced), so optimizer references stay
valid and tied weights stay tied. Quantized storage, integer buffers and FSDP2-sharded parameters
are never cast. Before a downcast to fp16 the plan checks the value range, so nothing silently
becomes ``inf``.

>>> import torch
>>> from hf_precision import enforce_policy, PrecisionPolicy
>>> from hf_precision.tiny import tiny_llava
>>> model = tiny_llava()
>>> model.model.vision_tower.to(torch.float16)  # doctest: +ELLIPSIS
CLIPVisionModel(...)
>>> report = enforce_policy(model, PrecisionPolicy.from_preset("bf16-true"))
>>> {p.dtype for p in model.parameters()}
{torch.bfloat16}
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..base.wrapper_kinds import owning_wrapper, unwrap_model
from ..errors import PrecisionError, PrecisionWarning, check_model
from ..model.view import ModelView
from ..rules.groups.module_groups import ModuleGroups
from ..rules.policy.fields import MODES, Mode
from ..rules.policy.precision_policy import PrecisionPolicy
from .plan import plan_policy
from .records import EnforceReport, Plan, TensorKind

__all__ = ["apply_plan", "check_policy", "enforce_policy", "restore_values"]


def _cast_optimizer_state(
    optimizer: Any, p: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> None:
    state = getattr(optimizer, "state", {}).get(p)
    if not state:
        return
    for key, value in state.items():
        if (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and key != "step"
            and value.shape == p.shape
        ):
            state[key] = value.to(device=device, dtype=dtype)


def _refuse_wrapped(model: nn.Module, wrapper: str, report: EnforceReport) -> PrecisionError:
    return PrecisionError(
        f"enforce_policy({wrapper}(...)): {len(report.changes)} tensor(s) violate "
        f"{report.policy.describe()} but {wrapper} already holds the parameters, so they "
        "cannot be cast in place:\n  "
        + "\n  ".join(c.describe() for c in report.changes[:8])
        + f"\nFix: call enforce_policy(model, ...) on the model before {wrapper} wraps it "
        "(PrecisionGuardCallback in Trainer(callbacks=[...]) and guard.prepare(accelerator, ...) "
        "do), or load the model in the policy's dtypes; mode='audit' only reports."
    )


def _meta_message(groups: ModuleGroups, meta: list[str], device: torch.device) -> str:
    unreached = [
        f"{p} (held in a {groups.held.get(g, 'attribute')}, outside the module "
        "tree, so model.to() and from_pretrained never reach it)"
        for g, p in groups.hidden.items()
        if any(m.startswith(p + ".") for m in meta)
    ]
    where = f" The module {'; '.join(unreached)} was never materialised." if unreached else ""
    return (
        f"enforce_policy: {len(meta)} tensor(s) are on the meta device while the model "
        f"is on {device} (weights never loaded), e.g. {', '.join(meta[:3])}.{where}\n"
        "Fix: load the weights (from_pretrained / load_state_dict(assign=True)) before "
        "training; the guard cannot move tensors that hold no data."
    )


def _violations(report: EnforceReport) -> PrecisionError:
    lines = report.listed_changes()
    lines += [f"{n}: max |value| {v:g} exceeds fp16 range" for n, v in report.overflow]
    return PrecisionError(
        f"enforce_policy(mode='raise'): the model violates policy {report.policy.describe()}:\n  "
        + "\n  ".join(lines)
        + "\nFix: use mode='fix' to let the guard cast them, or load the model in the "
        "policy's dtypes (from_pretrained(..., dtype=...))."
    )


def enforce_policy(
    model: nn.Module,
    policy: PrecisionPolicy | str | None = None,
    *,
    groups: ModuleGroups | None = None,
    optimizer: Any = None,
    mode: Mode | None = None,
    allow_wrapped: bool = False,
    view: ModelView | None = None,
    master_fp32: torch.dtype | None = None,
) -> EnforceReport:
    """Bring ``model`` to ``policy`` in place and return what changed.

    ``mode`` overrides ``policy.mode``: ``"audit"`` changes nothing and reports what would
    change; ``"fix"`` casts; ``"raise"`` raises :class:`PrecisionError` listing the violations.
    Pass the ``optimizer`` when it already holds state, so its moment tensors follow. A model
    that DDP/FSDP/DeepSpeed already wraps is not cast (a :class:`PrecisionError` says what to
    do) unless ``allow_wrapped`` (the accelerate plugin's drift repair under DDP). ``view`` is
    this event's walk of the model (:class:`~hf_precision.model.view.ModelView`), when the caller
    has one. ``master_fp32``: the half dtype of a DeepSpeed ZeRO-3 run, whose trainable weights
    in it are left as they are (rule ``wrapper_master_fp32``; the front ends pass it).
    """
    view = ModelView.reuse(view, model, groups, call="enforce_policy(model, policy)")
    policy, mode = _policy_and_mode(view, policy, mode)
    plan = plan_policy(view, policy, master_fp32=master_fp32)
    return apply_plan(plan, mode, optimizer, allow_wrapped=allow_wrapped)


def _policy_and_mode(
    view: ModelView, policy: PrecisionPolicy | str | None, mode: Mode | None
) -> tuple[PrecisionPolicy, Mode]:
    resolved = PrecisionPolicy.resolve(policy, view.root)
    mode = resolved.mode if mode is None else mode
    if mode not in MODES:
        raise PrecisionError(f"enforce_policy(mode={mode!r}): allowed modes audit, fix, raise.")
    return resolved, mode


def apply_plan(
    plan: Plan,
    mode: Mode = "fix",
    optimizer: Any = None,
    *,
    allow_wrapped: bool = False,
) -> EnforceReport:
    """Carry out ``plan`` (:func:`~hf_precision.engine.plan.plan_policy`) in ``mode``, without
    planning again: the one place that casts. Returns a new :class:`EnforceReport`, ``applied`` in
    ``fix`` mode; ``audit`` casts nothing and ``raise`` raises on any change."""
    report = plan.report()
    wrapper = owning_wrapper(plan.view.model)
    if mode == "fix" and report.changes and wrapper is not None and not allow_wrapped:
        raise _refuse_wrapped(plan.view.model, wrapper, report)
    if report.meta and report.device is not None:
        msg = _meta_message(report.groups, report.meta, report.device)
        if mode != "audit":
            raise PrecisionError(msg)
        report.warnings.append(msg)
    if mode == "fix":  # audits repeat every step: they report, they do not warn
        for w in report.warnings:
            warnings.warn(w, PrecisionWarning, stacklevel=3)
    if mode == "raise" and (report.changes or report.overflow):
        raise _violations(report)
    if mode == "fix":
        with torch.no_grad():
            for c in report.planned:
                _apply(
                    c.module, c.key, c.tensor, c.change.kind, c.dtype, c.device, optimizer, c.value
                )
        report.applied = True
    return report


def _apply(
    mod: nn.Module,
    key: str,
    t: torch.Tensor,
    kind: TensorKind,
    dtype: torch.dtype,
    device: torch.device,
    optimizer: Any,
    value: torch.Tensor | None = None,
) -> None:
    if kind == "buffer":  # ``value``: exact values the plan recomputed (a rounded rotary table)
        mod._buffers[key] = (t if value is None else value).to(device=device, dtype=dtype)
        return
    grad = t.grad
    if grad is not None:
        t.grad = None
    # Replacing .data keeps the Parameter object: optimizer param_groups and tied modules
    # still point at it.
    t.data = t.data.to(device=device, dtype=dtype)
    if grad is not None:
        t.grad = grad.to(device=device, dtype=dtype)
    if optimizer is not None:
        _cast_optimizer_state(optimizer, t, dtype, device)


def restore_values(model: nn.Module, saved: Mapping[str, torch.Tensor]) -> int:
    """Give named parameters/buffers of ``model`` the exact values (and dtypes) of ``saved``
    where their dtype changed (after an in-place ``model.to(bf16)`` of ``*_full_eval``).
    Parameter objects are kept (``.data`` is replaced); returns how many were restored."""
    root, _ = unwrap_model(model)
    tensors: dict[str, torch.Tensor] = dict(root.named_parameters())
    tensors.update(dict(root.named_buffers()))
    n = 0
    with torch.no_grad():
        for name, value in saved.items():
            t = tensors.get(name)
            if t is not None and t.dtype != value.dtype:
                t.data = value.to(t.device)
                n += 1
    return n


def check_policy(
    model: nn.Module,
    policy: PrecisionPolicy | str | None = None,
    *,
    groups: ModuleGroups | None = None,
) -> EnforceReport:
    """What :func:`enforce_policy` would change; changes nothing (``mode="audit"``)."""
    check_model(model, "check_policy(model, policy)")
    return enforce_policy(model, policy, groups=groups, mode="audit")
