"""What ran: the dtype each part of the model computed in at the first forward after an event.

The policy says what a part *should* compute in; what it does depends on the loop. OneTrainer
with fp16 weights runs no autocast: under the ``fp16`` preset its trained UNet holds float32
weights, the guards cast the latents to float16 at the UNet's door, the first Linear casts them
back, and every matmul runs float32. A report that printed the policy's "compute float16" would
say what did not run.

:class:`ComputeWatch` puts one-shot forward hooks on each group's root modules, on the model's
root and on every fp8 module (:mod:`hf_precision.model.fp8`), when an event arms it. Each hook
records, once, its module's first floating input (after the guards' casts), its first floating
output (before any guard casts it: the hook runs first) and the autocast dtype in effect; it
comes off when it has fired. When the root's forward returns (or every hook fired, for parts
called on their own like ``vae.decode``), :class:`ComputeSeen` goes to ``on_done``. A part's
compute dtype is the autocast dtype when autocast is on for its device (its matmuls run in it),
else its output's dtype.

Nothing is cast and nothing stays hooked: one dict lookup per hooked module, once per event.

>>> import torch
>>> from torch import nn
>>> from hf_precision.rules.groups.module_groups import find_module_groups
>>> model = nn.Sequential(nn.Linear(4, 4))
>>> seen = []
>>> watch = ComputeWatch(seen.append)
>>> watch.arm(model, find_module_groups(model), {}, meant={}, after="setup", step=0)
>>> _ = model(torch.ones(1, 4, dtype=torch.float32))
>>> seen[0].groups["other"].compute, watch.armed
('float32', False)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..rules.dtypes import dtype_name
from ..rules.groups.group_rule import OTHER
from .finding import Finding, Severity

__all__ = ["ComputeSeen", "ComputeWatch", "Ran", "WhatRan"]

_BITS = {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16}


@dataclass(frozen=True)
class Ran:
    """One part at its first forward: ``inputs`` (its first floating input, after the guards'
    casts), ``output`` (its first floating output), ``autocast`` (the autocast dtype in effect
    on the output's device, ``None`` when off)."""

    inputs: str | None
    output: str | None
    autocast: str | None

    @property
    def compute(self) -> str | None:
        """The dtype its matmuls ran in: autocast's when on, else its output's."""
        return self.autocast or self.output or self.inputs

    def how(self) -> str:
        """``"float32 (no autocast, inputs float16)"``, ``"bfloat16 (autocast)"``."""
        if self.autocast:
            return f"{self.compute} (autocast)"
        came = f", inputs {self.inputs}" if self.inputs and self.inputs != self.compute else ""
        return f"{self.compute} (no autocast{came})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "compute": self.compute,
            "inputs": self.inputs,
            "output": self.output,
            "autocast": self.autocast,
        }


@dataclass
class ComputeSeen:
    """What ran at the first forward after ``after`` (an event, at ``step``): per group and
    per fp8 module; ``meant``: the dtype the policy means each group to compute in."""

    after: str
    step: int
    groups: dict[str, Ran] = field(default_factory=dict)
    fp8: dict[str, Ran] = field(default_factory=dict)
    meant: dict[str, str] = field(default_factory=dict)
    policy: str = ""

    @property
    def differs(self) -> dict[str, tuple[str, str]]:
        """``group -> (ran, meant)`` where the two differ."""
        return {
            g: (r.compute, self.meant[g])
            for g, r in self.groups.items()
            if r.compute is not None and g in self.meant and r.compute != self.meant[g]
        }

    def key(self) -> tuple[Any, ...]:
        """Equal for two forwards that ran the same dtypes (a finding is said once for them)."""
        return (
            tuple(sorted((g, r.compute, r.autocast) for g, r in self.groups.items())),
            tuple(sorted((n, r.compute) for n, r in self.fp8.items())),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "after": self.after,
            "step": self.step,
            "groups": {
                g: {**r.as_dict(), "meant": self.meant.get(g)} for g, r in self.groups.items()
            },
            "fp8_modules": {n: r.as_dict() for n, r in self.fp8.items()},
        }

    def line(self) -> str:
        """The finding's line: what each group ran, and where that is not what the policy
        means, the fix."""
        head = f"hf-precision: what ran at the first forward after {self.after}: "
        parts = "; ".join(f"{g} {r.how()}" for g, r in self.groups.items())
        differs = self.differs
        if not differs:
            return head + (parts or "no group ran") + ", as the policy means"
        said = ", ".join(f"{g} {ran} where {meant} is meant" for g, (ran, meant) in differs.items())
        wanted = sorted({m for _, m in differs.values()})
        half = next((m for m in wanted if m in ("float16", "bfloat16")), None)
        fix = (
            f"to compute in {half}, run the forward under torch.autocast(device_type, "
            f"dtype=torch.{half}) (the Trainer's {'fp16' if half == 'float16' else 'bf16'}=True "
            "does); the report shows what ran"
            if half is not None
            else "the report shows what ran; hold the weights in the dtype meant or say it in "
            "the policy's group_dtypes"
        )
        return (
            f"{head}{parts}. Not what the policy {self.policy} means: {said} (no autocast: "
            f"the matmuls run in the weights' dtype). Fix: {fix}."
            if any(self.groups[g].autocast is None for g in differs)
            else f"{head}{parts}. Not what the policy {self.policy} means: {said}. Fix: {fix}."
        )

    def finding(self) -> Finding:
        """One :class:`~hf_precision.watch.finding.Finding` (``compute``, at info: what was
        measured; its line says where that is not what the policy means, and the fix). Its
        picture: the bits each group computed in."""
        severity: Severity = "info"
        groups = {
            g: float(_BITS.get(r.compute or "", 8))
            for g, r in self.groups.items()
            if r.compute is not None
        }
        return Finding(
            "compute",
            severity,
            self.line(),
            numbers=self.to_dict(),
            groups=groups,
            measure=f"bits of the dtype each group computed in after {self.after}",
        )


def _floating(obj: Any, depth: int = 0) -> torch.Tensor | None:
    """The first floating tensor in ``obj`` (tensors, lists, tuples, dicts, model outputs)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    if depth >= 3:
        return None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else ()
    for item in items:
        found = _floating(item, depth + 1)
        if found is not None:
            return found
    return None


def _ran(args: Any, kwargs: Any, output: Any) -> Ran:
    out = _floating(output)
    inp = _floating((args, kwargs))
    seen = out if out is not None else inp
    auto = None
    try:
        device = seen.device.type if seen is not None else "cpu"
        if torch.is_autocast_enabled(device):
            auto = dtype_name(torch.get_autocast_dtype(device))
    except RuntimeError:  # a device type autocast does not know (meta)
        pass
    return Ran(
        dtype_name(inp.dtype) if inp is not None else None,
        dtype_name(out.dtype) if out is not None else None,
        auto,
    )


class ComputeWatch:
    """Arms one-shot hooks at an event; calls ``on_done`` with what the next forward ran."""

    def __init__(self, on_done: Callable[[ComputeSeen], None]) -> None:
        self.on_done = on_done
        self._handles: list[Any] = []
        self._pending: set[int] = set()
        self._seen: ComputeSeen | None = None

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(
        self,
        root: nn.Module,
        groups: Any,
        fp8_modules: Mapping[str, nn.Module],
        *,
        meant: Mapping[str, torch.dtype],
        after: str,
        step: int,
        policy: str = "",
    ) -> None:
        """Hook the roots of ``groups`` (a :class:`~hf_precision.ModuleGroups`),
        ``root`` and ``fp8_modules`` (path -> module) for the next forward; a watch still armed
        from the event before reports what it saw first (if anything)."""
        self.finish()
        seen = self._seen = ComputeSeen(
            after, step, meant={g: dtype_name(d) for g, d in meant.items()}, policy=policy
        )
        keys: dict[int, tuple[nn.Module, list[tuple[str, str]]]] = {}

        def add(mod: nn.Module, kind: str, name: str) -> None:
            keys.setdefault(id(mod), (mod, []))[1].append((kind, name))

        for g in groups.names:
            try:
                mods = groups.modules(g)
            except AttributeError:  # a group held outside the module tree
                continue
            for mod in mods:
                add(mod, "group", g)
        if not groups.names:  # no group found: the whole model is "other"
            add(root, "group", OTHER)
        for name, mod in fp8_modules.items():
            add(mod, "fp8", name)
        add(root, "root", "")
        for mod, names in keys.values():
            hook = self._hook(seen, names, is_root=mod is root)
            self._handles.append(mod.register_forward_hook(hook, with_kwargs=True, prepend=True))
        self._pending = {id(h) for h in self._handles}

    def _hook(self, seen: ComputeSeen, names: list[tuple[str, str]], *, is_root: bool) -> Any:
        handle_at = len(self._handles)

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if seen is not self._seen:
                return
            ran = _ran(args, kwargs, output)
            for kind, name in names:
                if kind == "group":
                    seen.groups.setdefault(name, ran)
                elif kind == "fp8":
                    seen.fp8.setdefault(name, ran)
            handle = self._handles[handle_at] if handle_at < len(self._handles) else None
            if handle is not None:
                handle.remove()
                self._pending.discard(id(handle))
            if is_root or not self._pending:
                self.finish()

        return hook

    def finish(self) -> None:
        """Take the hooks off; what was seen (anything) goes to ``on_done``."""
        for h in self._handles:
            h.remove()
        self._handles, self._pending = [], set()
        seen, self._seen = self._seen, None
        if seen is not None and (seen.groups or seen.fp8):
            self.on_done(seen)

    def remove(self) -> None:
        """Take the hooks off and forget what was seen (the guard's teardown)."""
        for h in self._handles:
            h.remove()
        self._handles, self._pending, self._seen = [], set(), None


class WhatRan:
    """A :class:`~hf_precision.engine.guard.PrecisionGuard`'s side of the watch: armed at each
    event (:meth:`arm`); what the next forward ran becomes the ``compute`` section of every
    later event JSON (and the group table's ``compute`` column), the compute fact of the fp8
    manifest (and of the next event's), and, where a group ran another dtype than the policy
    means, one ``compute`` finding per new set of dtypes."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard
        self.watch = ComputeWatch(self._done)
        #: the last fp8 manifest's modules by path (set by the fp8 step of each event)
        self.fp8_modules: dict[str, nn.Module] = {}
        #: the dtype each of them ran in at the last watched forward
        self.fp8_compute: dict[str, torch.dtype] = {}
        #: the fp8 finding said last (each new one once)
        self.fp8_said: str | None = None
        self._said: tuple[Any, ...] | None = None

    def arm(self, view: Any, policy: Any, event: str, step: int) -> None:
        """Watch the next forward of ``view``'s model: what the policy means each group to
        compute in is its ``group_dtypes`` entry, else its ``compute_dtype``."""
        groups = self.guard.groups
        meant = {g: policy.group_dtypes.get(g, policy.compute_dtype) for g in groups.names}
        name = policy.name or "custom"
        self.watch.arm(
            view.root, groups, self.fp8_modules, meant=meant, after=event, step=step, policy=name
        )

    def _done(self, seen: ComputeSeen) -> None:
        from ..model import fp8

        guard = self.guard
        guard.sections["compute"] = seen.to_dict()
        self.fp8_compute = {
            n: getattr(torch, r.compute) for n, r in seen.fp8.items() if r.compute is not None
        }
        section = guard.sections.get("fp8")
        if section is not None and self.fp8_compute:
            found = fp8.manifest(self.fp8_modules.items(), self.fp8_compute)
            found.linears, found.layers = section["linears"], section["layers"]
            section.update(found.as_dict(), lines=found.lines())
        if seen.differs and seen.key() != self._said:  # what ran as meant is only recorded
            self._said = seen.key()
            guard.emit(seen.finding(), step=seen.step)

    def remove(self) -> None:
        self.watch.remove()
