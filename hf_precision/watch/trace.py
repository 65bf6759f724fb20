"""Where the activation dtype changed: one forward recorded module by module.

A parameter dtype map cannot see an fp32 buffer that promotes a bf16 stream (``x *
self.std_bias``), or an RMSNorm that hands fp32 to attention. :func:`trace_forward` (and
:class:`DtypeTrace`, for a forward someone else runs: the callback's ``trace=True`` records the
first training step's) puts a forward hook on every module, records each module's input and
output dtypes in execution order (a module is recorded when its forward returns: the innermost
first), and names the first place the stream's dtype changes (the first floating input against
the first floating output) and what did it, by looking at that module: a buffer of the output's
dtype, a norm, a parameter of the output's dtype, else an op inside it (a kernel: autocast, a
``softmax(dtype=...)``).

>>> import torch
>>> from torch import nn
>>> class Scale(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.lin = nn.Linear(4, 4).to(torch.bfloat16)
...         self.register_buffer("std_bias", torch.ones(4))  # float32
...     def forward(self, x):
...         return self.lin(x) * self.std_bias
>>> trace = trace_forward(nn.Sequential(Scale()), torch.ones(1, 4, dtype=torch.bfloat16))
>>> change = trace.first_change
>>> change.module, change.before, change.after, change.cause, change.detail
('0', 'bfloat16', 'float32', 'buffer', 'std_bias (float32)')
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from ..base.wrapper_kinds import unwrap_model
from ..rules.dtypes import dtype_name
from ..rules.roles import is_norm_module
from .finding import Finding

logger = logging.getLogger("hf_precision")

Cause = Literal["buffer", "norm", "parameter", "op", "kernel"]


@dataclass(frozen=True)
class TraceRecord:
    """One module's forward: its floating input and output dtypes (the first of each is the
    stream), in execution order."""

    index: int
    module: str
    module_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    leaf: bool
    autocast: str | None  # the autocast dtype in effect, if any

    @property
    def changed(self) -> bool:
        return bool(self.inputs and self.outputs and self.inputs[0] != self.outputs[0])


@dataclass(frozen=True)
class DtypeChange:
    """A module whose output stream leaves in another dtype than it came in, and why."""

    index: int
    module: str
    module_type: str
    before: str
    after: str
    cause: Cause
    detail: str

    def line(self) -> str:
        what = {
            "buffer": f"its buffer {self.detail}",
            "norm": f"a norm ({self.detail})",
            "parameter": f"its parameter {self.detail}",
            "op": f"an op inside {self.module} ({self.detail})",
            "kernel": f"a kernel ({self.detail})",
        }[self.cause]
        return f"{self.module} ({self.module_type}): {self.before} -> {self.after}, made by {what}"


@dataclass
class TraceResult:
    """The recorded forward: every module, the changes, the first one."""

    records: list[TraceRecord]
    changes: list[DtypeChange]
    error: str | None = None  # the forward raised: what was recorded until then
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def first_change(self) -> DtypeChange | None:
        return self.changes[0] if self.changes else None

    def line(self) -> str:
        """The one console line."""
        head = f"hf-precision trace: {len(self.records)} module forward(s) recorded"
        if self.error:
            head += f" (the forward raised: {self.error})"
        first = self.first_change
        if first is None:
            streams = sorted({r.outputs[0] for r in self.records if r.outputs})
            return f"{head}; the stream keeps its dtype ({'/'.join(streams) or 'none'})"
        more = len(self.changes) - 1
        return f"{head}; the stream's dtype changes first at {first.line()}" + (
            f"; {more} later change(s) in the report" if more else ""
        )

    def finding(self) -> Finding:
        """This trace for :func:`~hf_precision.watch.finding.emit` (said at INFO: a change of
        the stream's dtype is often chosen; the reporter writes ``<step>-trace.json``)."""
        first = self.first_change
        numbers: dict[str, Any] = {"modules": len(self.records), "changes": len(self.changes)}
        if first is not None:
            numbers["first_change"] = first.line()
        return Finding("trace", "info", self.line(), numbers=numbers, detail=self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "line": self.line(),
            "first_change": asdict(self.first_change) if self.first_change else None,
            "changes": [asdict(c) for c in self.changes],
            "records": [asdict(r) for r in self.records],
            "error": self.error,
        }


def _first_floating(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    out: list[torch.Tensor] = []
    if depth < 3 and isinstance(obj, (list, tuple)):
        for o in obj:
            out += _first_floating(o, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for o in obj.values():
            out += _first_floating(o, depth + 1)
    return out


def _names(tensors: list[torch.Tensor]) -> tuple[str, ...]:
    return tuple(dtype_name(t.dtype) for t in tensors)


def cause_of(module: nn.Module, after: str, autocast: str | None = None) -> tuple[Cause, str]:
    """What in ``module`` made its output ``after``: its own buffers, a norm, autocast (a leaf
    whose output is the autocast dtype), its own parameters, a buffer below it, else an op
    (containers) or a kernel (leaves)."""
    own_buffers = [(n, b) for n, b in module.named_buffers(recurse=False) if b is not None]
    hits = [n for n, b in own_buffers if dtype_name(b.dtype) == after]
    if hits:
        return "buffer", ", ".join(f"{n} ({after})" for n in hits)
    if is_norm_module(module):
        return "norm", f"{type(module).__name__} returning {after}"
    leaf = not any(True for _ in module.children())
    if autocast == after and leaf:
        return "kernel", f"{type(module).__name__} computes in {after} (autocast {autocast})"
    params = [n for n, p in module.named_parameters(recurse=False) if dtype_name(p.dtype) == after]
    if params:
        return "parameter", ", ".join(f"{n} ({after})" for n in params)
    deep = [n for n, b in module.named_buffers() if b is not None and dtype_name(b.dtype) == after]
    if deep:
        return "buffer", ", ".join(f"{n} ({after})" for n in deep[:3])
    if any(True for _ in module.children()):
        return "op", f"tensor code of {type(module).__name__}.forward"
    return "kernel", f"{type(module).__name__} computes in {after}"


class DtypeTrace:
    """Records the next forward of ``model`` (one call of the root); :meth:`result` after it.
    The hooks come off when the root's forward returns, or at :meth:`remove`."""

    def __init__(self, model: nn.Module) -> None:
        self.root, _ = unwrap_model(model)
        self.records: list[TraceRecord] = []
        self._modules: dict[str, nn.Module] = {}
        self._handles: list[Any] = []
        self.done = False
        for name, module in self.root.named_modules():
            self._modules[name] = module
            hook = self._hook(name, module is self.root, not any(True for _ in module.children()))
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def _hook(self, name: str, is_root: bool, leaf: bool) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self.done:
                return
            auto = None
            device = next((t.device.type for t in _first_floating(output)), "cpu")
            if torch.is_autocast_enabled(device):
                auto = dtype_name(torch.get_autocast_dtype(device))
            self.records.append(
                TraceRecord(
                    index=len(self.records),
                    module=name or type(module).__name__,
                    module_type=type(module).__name__,
                    inputs=_names(_first_floating((args, kwargs))),
                    outputs=_names(_first_floating(output)),
                    leaf=leaf,
                    autocast=auto,
                )
            )
            if is_root:
                self.done = True
                self.remove()

        return hook

    def hooks_installed(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def result(self, error: str | None = None) -> TraceResult:
        """The records and the changes (each explained by :func:`cause_of`)."""
        self.remove()
        changes = []
        for r in self.records:
            if not r.changed:
                continue
            module = self._modules.get(r.module, self._modules.get("", self.root))
            cause, detail = cause_of(module, r.outputs[0], r.autocast)
            changes.append(
                DtypeChange(
                    r.index, r.module, r.module_type, r.inputs[0], r.outputs[0], cause, detail
                )
            )
        return TraceResult(list(self.records), changes, error=error)


def trace_forward(
    model: nn.Module, *args: Any, autocast: torch.dtype | None = None, **kwargs: Any
) -> TraceResult:
    """Run ``model(*args, **kwargs)`` once (no gradients; under autocast in ``autocast`` when
    given) and return the trace. A forward that raises is traced up to the error."""
    trace = DtypeTrace(model)
    error = None
    device = next((p.device.type for p in model.parameters()), "cpu")
    try:
        with (
            torch.no_grad(),
            torch.autocast(device, dtype=autocast or torch.float32, enabled=autocast is not None),
        ):
            model(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError) as err:
        error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return trace.result(error)


__all__ = ["DtypeChange", "DtypeTrace", "TraceRecord", "TraceResult", "cause_of", "trace_forward"]
