"""The plan: what a policy wants changed in a model, tensor by tensor; changes nothing.

The third step of the data walk (model -> view -> **plan** -> apply -> guards -> report,
``docs/architecture.md``). :func:`plan_policy` reads the event's walk of the model
(:class:`~hf_precision.model.view.ModelView`) and returns a frozen :class:`Plan` whose ``changes``
say what would be cast and why, and whose ``planned`` :class:`PlannedCast` records
:func:`~hf_precision.engine.enforce.apply_plan` carries out (returning an :class:`EnforceReport`).
Quantized storage, tensors a wrapper owns (FSDP2 shards, ZeRO-3 partitions) and integer buffers
are never planned for a cast; before a downcast to fp16 the plan checks the value range, so
nothing becomes ``inf``.

>>> from hf_precision import PrecisionPolicy
>>> from hf_precision.tiny import tiny_llava
>>> from hf_precision.model.view import ModelView
>>> model = tiny_llava()
>>> plan = plan_policy(ModelView.of(model), PrecisionPolicy.from_preset("bf16-true"))
>>> {c.after for c in plan.changes}, len(plan.planned) == len(plan.changes)
({'bfloat16'}, True)
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ..base.wrapper_kinds import WRAPPERS, WrapperKind
from ..errors import did_you_mean
from ..model.view import ModelView
from ..rules import flags
from ..rules.dtypes import (
    dtype_name,
    is_castable,
    narrows_range,
    zero3_dtype,
)
from ..rules.groups.module_groups import ModuleGroups, hidden_module
from ..rules.keep_rules import model_dtype_note, model_keep_lists
from ..rules.policy.precision_policy import PrecisionPolicy
from ..rules.roles import Role, tensor_role
from .fp8.storage import fp8_model_dtype_note, stored_compute, stored_format
from .records import Change, Decided, EnforceReport, Plan, PlannedCast, TensorKind
from .rotary import rounded_rotary

__all__ = ["group_compute_dtypes", "plan_policy"]

#: Adapter weights whose layers cast their own input to the adapter dtype and the result back
#: (peft LoRA's ``_cast_input_dtype``): fp32 LoRA beside bf16 base weights does not make a group
#: "mixed", so a LoRA model gets no leaf guard on every Linear of its language model.
_SELF_CASTING = re.compile(r"(^|\.)lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


def _unmatched_patterns(
    view: ModelView, policy: PrecisionPolicy, report: EnforceReport
) -> list[str]:
    """One message per ``keep_fp32`` pattern that selects nothing and per ``group_dtypes``
    group the model does not have (a typo such as ``model.vison_tower`` is silent otherwise)."""

    from ..rules.policy.presets import PRESET_DEFAULTS

    root, groups = view.root, view.groups
    preset = PRESET_DEFAULTS.get(policy.name or "", {})  # a preset's own rules (vae32) are general
    used = {reason for _, reason in report.kept_fp32}
    out = []
    names: list[str] = []  # module paths for "did you mean", walked once if a pattern misses
    for pat in policy.keep_fp32:
        if f"keep_fp32 {pat!r}" in used or pat in preset.get("keep_fp32", ()):
            continue
        names = names or [n for n, _, _ in view.modules if n]
        hint = did_you_mean(pat.removeprefix("re:"), names)
        out.append(
            f"keep_fp32 pattern {pat!r} selects no parameter or buffer of "
            f"{type(root).__name__}.{hint} Fix: use an exact name, a module path prefix, one "
            "path component, or 're:<regex>' (see PrecisionPolicy.keep_fp32)."
        )
    for group in policy.group_dtypes:
        if group not in groups and group not in preset.get("group_dtypes", {}):
            now = groups.renamed.get(group)
            fix = (
                f"Fix: name {now!r}: rule {groups.rule!r} calls that group {now!r} now."
                if now
                else "Fix: drop it, or register a group rule that finds it."
            )
            out.append(
                f"group_dtypes[{group!r}] names a group {type(root).__name__} does not have "
                f"(found: {', '.join(groups.names) or 'none'}). {fix}"
            )
    return out


def plan_policy(
    view: ModelView, policy: PrecisionPolicy, *, master_fp32: torch.dtype | None = None
) -> Plan:
    """What ``policy`` wants changed in the model of the walk ``view``; changes nothing.
    ``master_fp32``: the half dtype of a DeepSpeed ZeRO-3 run (trainable weights in it are left
    as they are, rule ``wrapper_master_fp32``)."""
    root, groups = view.root, view.groups
    model_keep, strict = model_keep_lists(root)
    device_mapped = bool(getattr(root, "hf_device_map", None))
    device = view.model_device() if policy.move_devices and not device_mapped else None
    found = EnforceReport(policy, groups, applied=False, device=device)
    planner = _Planner(found, policy, model_keep, device, strict=strict, master_fp32=master_fp32)
    planner.walk(root, groups, view.modules)
    if found.overflow:
        planner.keep_with_overflowed(view)
    found.warnings += _unmatched_patterns(view, policy, found)
    note = model_dtype_note(root, view.modules, found.kept, policy.frozen_dtype)
    if note is not None:  # a keep rule on the first floating parameter: model.dtype says fp32
        found.warnings.append(note)
    fp8_note = fp8_model_dtype_note(view)  # fp8 storage there: model.dtype says fp8
    if fp8_note is not None:
        found.warnings.append(fp8_note)
    return Plan(
        view,
        policy,
        device,
        changes=tuple(found.changes),
        planned=tuple(planner.todo),
        kept_fp32=tuple(found.kept_fp32),
        kept=tuple(found.kept),
        overflow=tuple(found.overflow),
        skipped=tuple(found.skipped),
        warnings=tuple(found.warnings),
        group_dtypes=tuple((g, frozenset(d)) for g, d in found.group_dtypes.items()),
        meta=tuple(planner.meta),
        decided=tuple(planner.decided),
    )


def group_compute_dtypes(
    groups: ModuleGroups, walk: list[tuple[str, str, nn.Module]]
) -> dict[str, torch.dtype]:
    """The dtype each group computes in, as loaded: the majority (by elements) of its weights
    other than normalization layers and self-casting adapters (LoRA) (the plan adds: a group
    holding quantized layers computes in their compute dtype). A frozen fp32 norm in a group
    computing in half was put there on purpose (:meth:`PrecisionPolicy.decide`, rule
    ``deliberate_fp32``); one in an fp32 group follows its group."""
    counts: dict[str, dict[torch.dtype, int]] = {}
    seen: set[int] = set()
    for path, group, mod in walk:
        for pname, p in mod._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{path}.{pname}" if path else pname
            if _SELF_CASTING.search(full) or tensor_role(mod, pname, p, is_buffer=False):
                continue
            if is_castable(p):
                dt = zero3_dtype(p) or p.dtype
                per = counts.setdefault(groups.by_path.get(full, group), {})
                per[dt] = per.get(dt, 0) + p.numel()
    return {g: max(c, key=lambda d: c[d]) for g, c in counts.items() if c}


def _range_checked(src: torch.dtype, dst: torch.dtype, kind: TensorKind) -> bool:
    """Downcasts worth a range check (a read pass over the tensor): every one to a narrower
    exponent range (fp16); to bf16, which keeps fp32's range short of its top 0.4%, only buffers,
    where sentinels such as ``finfo(float32).min`` live (a weight that large overflows anyway)."""
    if not narrows_range(src, dst):
        return False
    return kind == "buffer" or torch.finfo(dst).max < torch.finfo(src).max / 2


def _amax(t: torch.Tensor) -> float:
    """max |t| without a ``|t|`` temporary, so the check adds no memory to the cast."""
    lo, hi = torch.aminmax(t.detach())
    return float(torch.maximum(lo.neg(), hi))


@dataclass
class _Planner:
    """Decides, tensor by tensor, what the policy wants (:meth:`plan`); collects the casts
    (``todo``), the tensors left on the meta device and, in the report, the rest."""

    report: EnforceReport
    policy: PrecisionPolicy
    model_keep: tuple[str, ...]
    device: torch.device | None
    #: the half dtype of a DeepSpeed ZeRO-3 run (:meth:`PrecisionPolicy.decide`)
    master_fp32: torch.dtype | None = None
    #: the model's ``_keep_in_fp32_modules_strict`` (``model_keep``: its non-strict list)
    strict: tuple[str, ...] = ()
    todo: list[PlannedCast] = field(default_factory=list)
    meta: list[str] = field(default_factory=list)
    #: group -> (dtype its quantized layers compute in, their format), from a first pass
    quantized: dict[str, tuple[torch.dtype, str]] = field(default_factory=dict)
    #: groups holding quantized storage (compute dtype known or not)
    quantized_groups: set[str] = field(default_factory=set)
    #: group -> the dtype most of its weights other than norms and adapters are in (first pass)
    group_dtype: dict[str, torch.dtype] = field(default_factory=dict)
    #: every floating parameter of the tree as decided, for the wrapper check
    decided: list[Decided] = field(default_factory=list)
    #: ``id`` of the parameters of modules held outside the module tree
    unseen: set[int] = field(default_factory=set)
    #: the wrapper kinds that own tensors one by one (FSDP2's shards, ZeRO-3's partitions)
    owners: tuple[WrapperKind, ...] = field(
        default_factory=lambda: tuple(k for k in WRAPPERS.values() if k.owned_test is not None)
    )

    def walk(
        self, root: nn.Module, groups: ModuleGroups, walk: list[tuple[str, str, nn.Module]]
    ) -> None:
        """Plan every parameter and buffer of the walk, once per tensor (tied weights: the
        first name decides, the tie holds)."""
        # Parameters of modules held outside the module tree are frozen by construction: the
        # optimizer (built from model.parameters()) never sees them, whatever requires_grad says.
        self.unseen = unseen = {
            id(p)
            for hp in groups.hidden.values()
            if (m := hidden_module(root, hp)) is not None
            for p in m.parameters()
        }
        self._find_quantized(groups, walk)
        self._find_group_dtypes(groups, walk)
        first: dict[int, tuple[str, str]] = {}  # id(parameter) -> its first (name, group)
        for path, group, mod in walk:
            for pname, p in mod._parameters.items():
                if p is None:
                    continue
                full = f"{path}.{pname}" if path else pname
                pgroup = groups.by_path.get(full, group)
                trainable = p.requires_grad and id(p) not in unseen
                if id(p) in first:
                    self._check_tie(full, pgroup, first[id(p)], p, trainable)
                    continue
                first[id(p)] = (full, pgroup)
                self.plan(mod, pname, p, full, pgroup, "param", trainable)
            for bname, b in mod._buffers.items():
                if b is None:
                    continue
                full = f"{path}.{bname}" if path else bname
                if is_castable(b):
                    self.plan(mod, bname, b, full, group, "buffer", False)
                else:  # integer buffers (CLIP's position_ids) follow the device only
                    self._plan_move(mod, bname, b, full, group)

    def _find_quantized(self, groups: ModuleGroups, walk: list[tuple[str, str, nn.Module]]) -> None:
        """Groups holding quantized layers that compute in a floating dtype other than the
        policy's: the rest of such a group (embeddings, norms, whatever makes the rotary
        tables' dtype) follows that dtype, or activations of two half dtypes meet inside the
        group and promote to float32 (q/k/v of different dtypes in attention)."""
        for path, group, mod in walk:
            for pname, p in mod._parameters.items():
                if p is None or is_castable(p):
                    continue
                compute = stored_compute(p, mod)
                full = f"{path}.{pname}" if path else pname
                self.quantized_groups.add(groups.by_path.get(full, group))
                if compute is None or group in self.quantized:
                    continue
                self.quantized[groups.by_path.get(full, group)] = (compute, stored_format(p, mod))
        for group, (compute, fmt) in self.quantized.items():
            wanted = self.policy.group_dtype(group)
            if wanted != compute:
                tool = flags.detect_tool()
                half = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compute)
                theirs = f" ({flags.flag(half, tool=tool)})" if half else ""
                theirs_fix = (  # layerwise casting: its hook's compute_dtype decides
                    f"compute_dtype=torch.{dtype_name(wanted)} in the layerwise cast"
                    if " layerwise:" in fmt
                    else flags.quantized_compute(wanted, tool=tool)
                )
                self.report.warnings.append(
                    f"{group}: its quantized layers ({fmt}) compute in {dtype_name(compute)}, "
                    f"not the policy's {dtype_name(wanted)}; the group's other frozen weights "
                    f"follow them, so its activations keep one dtype. Fix: "
                    f"{theirs_fix} so they compute in "
                    f"{dtype_name(wanted)}, or train in {dtype_name(compute)}{theirs}."
                )

    def _find_group_dtypes(
        self, groups: ModuleGroups, walk: list[tuple[str, str, nn.Module]]
    ) -> None:
        self.group_dtype = group_compute_dtypes(groups, walk)
        # quantized layers compute in half whatever fp32 weights sit beside them
        # (prepare_model_for_kbit_training casts everything else to fp32): their compute dtype
        # where the library says it, else the dtype the policy gives the group
        for g in self.quantized_groups:
            self.group_dtype[g] = self.policy.group_dtype(g)
        self.group_dtype.update({g: compute for g, (compute, _) in self.quantized.items()})

    def _check_tie(
        self, full: str, group: str, first: tuple[str, str], p: torch.Tensor, trainable: bool
    ) -> None:
        def want(name: str, group: str) -> torch.dtype:
            return self.policy.decide(
                name,
                group,
                trainable=trainable,
                model_patterns=self.model_keep,
                current=p.dtype,
                strict_patterns=self.strict,
            ).dtype

        mine, theirs = want(full, group), want(*first)
        if mine != theirs:
            self.report.warnings.append(
                f"{full} [{group}] is tied to {first[0]} [{first[1]}]: the policy wants "
                f"{dtype_name(mine)} for {full} and {dtype_name(theirs)} for {first[0]}; both "
                f"keep {dtype_name(theirs)} so the tie holds. Fix: give both the same dtype "
                f"(keep_fp32=[{first[0]!r}] keeps the pair in float32)."
            )

    def _plan_move(self, mod: nn.Module, key: str, b: torch.Tensor, full: str, group: str) -> None:
        device = self.device
        if device is None or b.device == device or b.device.type == "meta":
            return
        dt = dtype_name(b.dtype)
        change = Change(full, "buffer", group, dt, dt, "device", str(b.device), str(device))
        self.report.changes.append(change)
        self.todo.append(PlannedCast(mod, key, b, change, b.dtype, device))

    def keep_with_overflowed(self, view: ModelView) -> None:
        """A module computes in one dtype: the parameters beside one kept for its range stay
        in its dtype too (an fp32 weight next to an fp16 bias fails inside F.linear)."""
        report = self.report
        named = view.named_parameters()
        held = {n.rpartition(".")[0]: named[n].dtype for n, _ in report.overflow if n in named}
        for item in list(self.todo):
            change, t = item.change, item.tensor
            owner = change.name.rpartition(".")[0]
            if change.kind != "param" or owner not in held or item.dtype == held[owner]:
                continue
            self.todo.remove(item)
            report.changes.remove(change)
            report.group_dtypes.setdefault(change.group, set()).add(held[owner])
            if held[owner] != t.dtype or item.device != t.device:
                change.after = dtype_name(held[owner])
                change.reason += f", kept with {owner}'s out-of-range tensor"
                self.todo.append(dataclasses.replace(item, dtype=held[owner]))
                report.changes.append(change)

    def plan(
        self,
        mod: nn.Module,
        key: str,
        t: torch.Tensor,
        full: str,
        group: str,
        kind: TensorKind,
        trainable: bool,
    ) -> None:
        """One tensor: what the policy wants (:meth:`_decide`), unless it is quantized or a
        wrapper's, in range, on the model's device; a :class:`PlannedCast` when that differs
        from what it is."""
        if not is_castable(t):
            self._skip_quantized(mod, t, full, group, kind)
            return
        target, reason, rule = self._decide(mod, key, t, full, group, kind, trainable)
        if self._skip_wrapper_owned(t, full, group, kind):
            return
        value = None
        if rule == "rotary" and t.dtype != target and t.device.type != "meta":
            value, reason, warning = rounded_rotary(mod, key, t, full, group)
            self.report.warnings += [warning] if warning else []
        dev = t.device
        target_dev = dev
        if self.device is not None and dev != self.device:
            if dev.type == "meta":
                self.meta.append(full)
            else:
                target_dev = self.device
        final = self._in_range(t, target, full, group, kind)
        if kind == "param" and not _SELF_CASTING.search(full):
            self.report.group_dtypes.setdefault(group, set()).add(final)
        if final == t.dtype and target_dev == dev:
            return
        before, after = dtype_name(t.dtype), dtype_name(final)
        change = Change(full, kind, group, before, after, reason, str(dev), str(target_dev))
        self.report.changes.append(change)
        self.todo.append(PlannedCast(mod, key, t, change, final, target_dev, value))

    def _decide(
        self,
        mod: nn.Module,
        key: str,
        t: torch.Tensor,
        full: str,
        group: str,
        kind: TensorKind,
        trainable: bool,
    ) -> tuple[torch.dtype, str, str]:
        """The dtype the policy wants for one castable tensor (:meth:`PrecisionPolicy.decide`;
        a group's quantized layers lead its frozen weights), the reason and the rule; the keep
        rules reported, and a parameter of the tree recorded in ``decided``."""
        role: Role | None = tensor_role(mod, key, t, is_buffer=kind == "buffer")
        param = kind == "param"
        current = (zero3_dtype(t) or t.dtype) if param else t.dtype
        decision = self.policy.decide(
            full,
            group,
            trainable=trainable,
            is_buffer=not param,
            model_patterns=self.model_keep,
            strict_patterns=self.strict,
            current=current,
            role=role,
            group_dtype=self.group_dtype.get(group),
            master_fp32=self.master_fp32 if param else None,
        )
        target, reason = decision.dtype, decision.reason
        held = self.quantized.get(group)
        if held is not None and decision.rule in ("frozen", "group_dtypes") and target != held[0]:
            target, reason = held[0], f"follows the quantized layers of {group} ({held[1]})"
        if decision.keeps_fp32:
            self.report.kept_fp32.append((full, reason))
        if decision.kept:
            self.report.kept.append((full, group, decision.rule, reason))
        if param and id(t) not in self.unseen:
            keeps, grad = decision.keeps_fp32, t.requires_grad
            self.decided.append(Decided(full, group, t, current, target, reason, keeps, grad))
        return target, reason, decision.rule

    def _skip_quantized(
        self, mod: nn.Module, t: torch.Tensor, full: str, group: str, kind: TensorKind
    ) -> None:
        """Quantized storage is never cast; its layer computes in its compute dtype, which is
        where the leaf guards send inputs."""
        if t.is_floating_point() or kind == "param":
            self.report.skipped.append((full, f"quantized storage ({stored_format(t, mod)})"))
            compute = stored_compute(t, mod)
            if compute is not None:
                self.report.group_dtypes.setdefault(group, set()).add(compute)

    def _skip_wrapper_owned(self, t: torch.Tensor, full: str, group: str, kind: TensorKind) -> bool:
        """A wrapper owns this tensor (:attr:`WrapperKind.owned_test`:
        FSDP2's shards, ZeRO-3's partitions): writing .data would desynchronise it from the wrapper.
        Verified elsewhere, never cast."""
        owner = next((k for k in self.owners if k.owned_test(t, kind)), None)  # type: ignore[misc]
        if owner is None:
            return False
        held = (zero3_dtype(t) if kind == "param" else None) or t.dtype
        self.report.skipped.append((full, f"{owner.owned_words} ({dtype_name(held)}); not cast"))
        if kind == "param":
            self.report.group_dtypes.setdefault(group, set()).add(held)
        return True

    def _in_range(
        self, t: torch.Tensor, target: torch.dtype, full: str, group: str, kind: TensorKind
    ) -> torch.dtype:
        """``target``, or ``t``'s own dtype when its values would overflow ``target`` (never
        turned into inf; reported, and a warning says how to make it explicit)."""
        if (
            target == t.dtype
            or t.device.type == "meta"
            or not _range_checked(t.dtype, target, kind)
        ):
            return target
        amax = _amax(t) if t.numel() else 0.0
        if amax <= torch.finfo(target).max:
            return target
        self.report.overflow.append((full, amax))
        self.report.warnings.append(
            f"{full} [{group}]: max |value| {amax:g} exceeds the "
            f"{dtype_name(target)} range (±{torch.finfo(target).max:g}); kept in "
            f"{dtype_name(t.dtype)} instead of becoming inf. Fix: "
            f"keep_fp32=[{full!r}] to say so explicitly, or use bf16, whose range "
            "matches fp32."
        )
        return t.dtype
