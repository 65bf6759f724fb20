"""Result types of :func:`hf_precision.diagnose`: readable as text (``str``) and as a dict.

>>> from hf_precision.watch.diagnosis import Diagnosis
>>> Diagnosis(model="M", policy="bf16").ok
True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ..rules.dtypes import dtype_name, is_castable, majority_dtype
from ..rules.groups.module_groups import ModuleGroups
from ..rules.policy.precision_policy import PrecisionPolicy

#: Root-cause classes (docs/architecture.md) that a recorded pass can tell apart.
CLASS_NAMES: dict[str, str] = {
    "A": "input from outside (batch tensor in another dtype)",
    "B": "component dtype split (groups in different dtypes)",
    "C": "fp32 upcast leak (a leaf of another dtype feeds a half-precision module)",
    "F": "tensor made in forward (numpy tables, masks built in fp32 or on CPU)",
    "G": "wrong device (a group or input on another device)",
}
_LISTED = 20


MismatchKind = Literal["dtype", "device", "dtype+device"]


@dataclass
class Mismatch:
    """One module whose input differed from its weights (repeats are counted, not listed)."""

    module: str
    module_type: str
    group: str
    input: str
    input_dtype: str
    input_device: str
    weight_dtype: str
    weight_device: str
    producer: str
    producer_module: str | None = None
    producer_group: str | None = None
    producer_dtype: str | None = None
    kind: MismatchKind = "dtype"
    phase: str = "forward"
    autocast: bool = False
    count: int = 1
    order: int = 0

    def describe(self) -> str:
        where = f"{self.input_dtype} on {self.input_device}"
        weights = f"{self.weight_dtype}" + (
            f" on {self.weight_device}" if self.weight_device else ""
        )
        src = self.producer
        if self.producer_module is not None:
            dt = f", weights {self.producer_dtype}" if self.producer_dtype else ""
            src = f"{self.producer_module} ({self.producer_group}{dt})"
        extra = f" [{self.phase}]" if self.phase != "forward" else ""
        extra += " [autocast]" if self.autocast else ""
        extra += f" x{self.count}" if self.count > 1 else ""
        return (
            f"{self.module} ({self.module_type}, {self.group}) got {self.input} as {where}, "
            f"weights {weights}; from {src}{extra}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Diagnosis:
    """What one recorded pass saw. ``ok`` is False when a dtype/device error happened."""

    model: str
    policy: str | None = None
    passes: dict[str, str] = field(default_factory=dict)  # phase -> ok | failed | skipped: ...
    mismatches: list[Mismatch] = field(default_factory=list)
    error: str | None = None
    phase: str | None = None
    culprit: Mismatch | None = None
    failed_in: str | None = None
    root_cause: str | None = None
    expected: str | None = None
    fix: str | None = None
    violations: dict[str, int] = field(default_factory=dict)  # group -> tensors off-policy
    failing_stack: list[str] = field(default_factory=list)  # module calls open at the error
    calls: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def autocast_handled(self) -> list[Mismatch]:
        """Mismatches that did not fail because autocast ran the op in its dtype: autocast
        doing its work (information, not a problem)."""
        return [m for m in self.silent if m.autocast]

    @property
    def unhandled(self) -> list[Mismatch]:
        """Mismatches that did not fail outside autocast (an op's own upcasting, a guard): the
        ones to look at when a later pass (generate, evaluation) fails."""
        return [m for m in self.silent if not m.autocast]

    @property
    def silent(self) -> list[Mismatch]:
        """Mismatches that did not fail (autocast, the op's own upcast, or a guard hid them)."""
        stack = set(self.failing_stack)
        return [
            m
            for m in self.mismatches
            if not (m.phase == self.phase and m.module in stack) and m is not self.culprit
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "model": self.model,
            "policy": self.policy,
            "passes": dict(self.passes),
            "error": self.error,
            "phase": self.phase,
            "culprit": self.culprit.to_dict() if self.culprit else None,
            "failed_in": self.failed_in,
            "failing_stack": list(self.failing_stack),
            "root_cause": self.root_cause,
            "root_cause_name": CLASS_NAMES.get(self.root_cause or ""),
            "expected": self.expected,
            "fix": self.fix,
            "violations": dict(self.violations),
            "mismatches": [m.to_dict() for m in self.mismatches],
            "autocast_handled": len(self.autocast_handled),
            "silent_outside_autocast": len(self.unhandled),
            "calls": self.calls,
        }

    def __str__(self) -> str:
        passes = ", ".join(f"{k} {v}" for k, v in self.passes.items()) or "none run"
        lines = [f"hf-precision diagnosis of {self.model} under {self.policy}", f"passes: {passes}"]
        if self.error is not None:
            lines.append(f"{self.phase} failed: {self.error}")
            c = self.culprit
            if c is not None:
                lines.append(
                    f"module:   {c.module or '<model>'} ({c.module_type}, group {c.group}) "
                    "received "
                    f"{c.input} as {c.input_dtype} on {c.input_device}; its weights "
                    f"are {c.weight_dtype}" + (f" on {c.weight_device}" if c.weight_device else "")
                )
                src = c.producer
                if c.producer_module is not None:
                    src = (
                        f"{c.producer_module} (group {c.producer_group}, weights "
                        f"{c.producer_dtype})"
                    )
                lines.append(f"producer: {src}")
            if self.failed_in:
                lines.append(f"failed in: {self.failed_in}")
            if self.expected:
                lines.append(f"expected: {self.expected}")
            if self.violations:
                lines.append(
                    "off-policy tensors per group: "
                    + ", ".join(f"{g}: {n}" for g, n in self.violations.items())
                )
            if self.root_cause:
                lines.append(f"root cause: {self.root_cause} ({CLASS_NAMES[self.root_cause]})")
            if self.fix:
                lines.append(f"fix: {self.fix}")
        handled, silent = self.autocast_handled, self.unhandled
        if handled:
            lines.append(
                f"info: autocast handled {len(handled)} input/weight dtype difference(s) "
                "(autocast runs those ops in its dtype, as in training: not a problem)"
            )
        if silent:
            lines.append(
                f"{len(silent)} other input/weight mismatch(es) did not fail outside "
                "autocast (an op upcast or a guard cast them):"
            )
            lines += ["  " + m.describe() for m in silent[:_LISTED]]
            if len(silent) > _LISTED:
                lines.append(f"  ... and {len(silent) - _LISTED} more (see .to_dict())")
        elif self.ok and not handled:
            lines.append("no module received inputs in another dtype/device than its weights")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- explanations
def module_weights(mod: nn.Module, *, own: bool) -> tuple[torch.dtype | None, torch.device | None]:
    """Majority floating dtype (frozen weights first) and device of a module's weights."""
    params = mod._parameters.values() if own else mod.parameters()
    frozen: list[tuple[torch.dtype, int]] = []
    every: list[tuple[torch.dtype, int]] = []
    devices: dict[torch.device, int] = {}
    for p in params:
        if p is None or not is_castable(p):
            continue
        every.append((p.dtype, p.numel()))
        if not p.requires_grad:
            frozen.append((p.dtype, p.numel()))
        devices[p.device] = devices.get(p.device, 0) + p.numel()
    device = max(devices, key=lambda d: devices[d]) if devices else None
    return majority_dtype(frozen) or majority_dtype(every), device


def classify(root: nn.Module, groups: ModuleGroups, m: Mismatch) -> str:
    """Root-cause class (A, B, C, F, G) of a mismatch that made an op fail."""
    if m.kind != "dtype":
        return "G"
    if m.producer.startswith("batch["):
        return "A"
    if m.producer_module is None:
        return "F"
    own, _ = module_weights(root.get_submodule(m.producer_module), own=True)
    group_dt = None
    for mod in groups.modules(m.producer_group or ""):
        group_dt, _ = module_weights(mod, own=False)
        break
    if own is not None and group_dt is not None and own != group_dt:
        return "C"  # a leaf (fp32 norm) inside a group of another dtype leaks its output
    return "B" if m.producer_group != m.group else "C"


def _policy_dtype(root: nn.Module, policy: PrecisionPolicy, path: str, group: str) -> str:
    """What the policy wants for the weights of module ``path`` (trainable or frozen)."""
    trainable = any(p.requires_grad for p in root.get_submodule(path).parameters())
    if trainable and policy.trainable_dtype is not None:
        return f"{dtype_name(policy.trainable_dtype)} (trainable)"
    return dtype_name(policy.group_dtype(group))


def expected_text(root: nn.Module, policy: PrecisionPolicy, m: Mismatch) -> str:
    """What the policy wanted for the module and the producer of its input."""
    if not m.module:
        return (
            f"policy {policy.name or 'custom'} wants batch[{m.input!r}] in {m.weight_dtype} "
            f"(compute in {dtype_name(policy.compute_dtype)})"
        )
    text = (
        f"policy {policy.name or 'custom'} wants {m.group} weights in "
        f"{_policy_dtype(root, policy, m.module, m.group)}"
    )
    if m.producer_module is not None and m.producer_group is not None:
        want = _policy_dtype(root, policy, m.producer_module, m.producer_group)
        text += f", {m.producer_group} weights in {want}"
    return text + f", compute in {dtype_name(policy.compute_dtype)}"


def fix_text(cls: str, m: Mismatch, policy: PrecisionPolicy, intended: bool = False) -> str:
    """The fix for one root-cause class: the policy setting or the line to change."""
    name = policy.name or "custom"
    want = dtype_name(policy.group_dtype(m.group))
    if cls == "A":
        key = m.producer[len("batch[") : -1]
        return (
            f"cast the batch where it is built: wrap the collator in "
            f"PrecisionCollator(collator, policy={name!r}) or use PrecisionGuardCallback "
            f"(its batch guard casts {key}); by hand: batch[{key}] = "
            f"batch[{key}].to(torch.{m.weight_dtype})."
        )
    if cls == "B" and not intended:
        pgd = dtype_name(policy.group_dtype(m.producer_group or ""))
        return (
            f"bring the groups to one policy: enforce_policy(model, {name!r}) casts "
            f"{m.producer_group} to {pgd} (PrecisionGuardCallback does it at on_init_end), "
            f"or load with from_pretrained(..., dtype=torch.{want}); if the split is meant, "
            f"say so with PrecisionPolicy(group_dtypes={{{m.producer_group!r}: ...}}) and "
            f"the boundary guard casts the input of {m.module}."
        )
    if cls == "B":
        return (
            f"{m.producer_group} ({m.producer_dtype}) and {m.group} ({m.weight_dtype}) both "
            f"follow policy {name!r}, which splits them (e.g. trainable weights in fp32): "
            "outside autocast (generate, evaluation) the input must be cast at the boundary. "
            f"Use the guard in mode='fix' (PrecisionGuardCallback({name!r})), whose boundary "
            f"guard casts the input of {m.module}."
        )
    if cls == "C":
        return (
            f"{m.producer_module} ({m.producer_dtype}) feeds {m.module} "
            f"({m.weight_dtype}): turn on leaf guards, PrecisionPolicy.from_preset({name!r}, "
            f"leaf_guards='on') (or 'auto', which guards groups that mix dtypes), so inputs "
            f"follow {m.module}'s weights; or cast its output: .to(torch.{m.weight_dtype})."
        )
    if cls == "F":
        return (
            f"the {m.input_dtype} tensor is {m.producer}: build it with "
            f"dtype=/device= of the tensor it meets (e.g. torch.from_numpy(pos).to(x.dtype)) "
            f"or let the leaf guard cast it: PrecisionPolicy.from_preset({name!r}, "
            f"leaf_guards='on')."
        )
    return (
        f"{m.module} holds its weights on {m.weight_device} but received {m.input} on "
        f"{m.input_device}: move the group with enforce_policy(model, {name!r}) "
        "(move_devices=True keeps groups on the model's device) or model.to(device), and "
        "send batches to that device."
    )
