"""The headroom probe: one forward in float32 records, per module, the largest ``|activation|``
against the ranges of float16 (±65504) and fp8 (e4m3 ±448, e5m2 ±57344); for modules converted
to fp8 (torchao's ``Float8Linear``), the error of their fp8 output against the same layer in
bf16. It names the worst modules.

The range check before a downcast reads weights; an activation can leave the float16 range with
every weight well inside it: a vision pooler that multiplies its features by ``sqrt(1152)`` (the
Gemma vision pooler of transformers issue 46277) overflows float16 at run time only. The probe
sees the activation itself, in float32, so the value is the one a half-precision run would have
had to hold.

It changes nothing: a model whose floating weights are all float32 runs as it is (no gradient,
eval mode, each module's mode given back); otherwise a float32 copy runs (memory: the model
again, in float32), without the guards' hooks. The largest values are kept on the device and
read once at the end. ``hf-precision doctor --headroom`` runs it on the synthetic batch;
:func:`headroom_event` runs it from any loop and writes a ``headroom`` section into the guard's
next event (precision.log, the event JSON, W&B/TensorBoard).

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
>>> with torch.no_grad():
...     _ = net[0].weight.fill_(100.0)
>>> result = probe_headroom(net, (torch.full((1, 4), 200.0),))
>>> result.worst()[0].path, result.worst()[0].beyond()
('0', ['float16', 'float8_e4m3fn', 'float8_e5m2'])
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..base.names import EXIT_ATTR, GUARD_ATTR
from ..base.wrapper_kinds import unwrap_model
from ..rules.dtypes import is_castable
from .finding import Finding

logger = logging.getLogger("hf_precision")

#: the largest finite value of each narrow format the probe compares with
RANGES: dict[str, float] = {
    "float16": 65504.0,
    "float8_e4m3fn": 448.0,
    "float8_e5m2": 57344.0,
}
#: class names of fp8-compute linear layers (torchao's); read by name, nothing imported
FP8_LINEARS = ("Float8Linear",)


@dataclass
class ModuleHeadroom:
    """One module's largest ``|output|`` in the float32 forward (over all its calls) and, for an
    fp8 layer, the relative error of its fp8 output against bf16 (``||fp8 - bf16|| / ||bf16||``)."""

    path: str
    kind: str
    amax: float
    fp8_error: float | None = None

    def beyond(self) -> list[str]:
        """The formats whose range this module's activations leave."""
        return [name for name, top in RANGES.items() if self.amax > top]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "max_abs": self.amax,
            "headroom": {
                k: round(v / self.amax, 4) if self.amax else None for k, v in RANGES.items()
            },
            "beyond": self.beyond(),
            **({"fp8_vs_bf16_error": self.fp8_error} if self.fp8_error is not None else {}),
        }


@dataclass
class HeadroomResult:
    """What the probe saw; :meth:`worst` names the modules nearest to or beyond the ranges."""

    modules: list[ModuleHeadroom] = field(
        default_factory=list
    )  # in the order the forward made them
    copied: bool = False  # a float32 copy ran (the model held half-precision weights)

    def worst(self, n: int = 5) -> list[ModuleHeadroom]:
        """The ``n`` largest activations, a module named only once for a value its child made
        (a parent returning its last child's output shows the same maximum)."""
        depth = {m.path: m.path.count(".") + 1 if m.path else 0 for m in self.modules}
        ranked = sorted(self.modules, key=lambda m: (-m.amax, -depth[m.path]))
        out: list[ModuleHeadroom] = []
        for m in ranked:
            if any(o.amax == m.amax and o.path.startswith(m.path) for o in out):
                continue  # a parent (or the root, "") of a module already named, same value
            out.append(m)
            if len(out) == n:
                break
        return out

    def beyond(self, fmt: str) -> list[ModuleHeadroom]:
        """The modules whose activations leave ``fmt``, in the order the forward finished them:
        the first is where the values first left the range (what follows inherits them)."""
        return [m for m in self.modules if m.amax > RANGES[fmt]]

    def fp8(self) -> list[ModuleHeadroom]:
        """The fp8 layers, largest error first."""
        found = [m for m in self.modules if m.fp8_error is not None]
        return sorted(found, key=lambda m: -(m.fp8_error or 0.0))

    def line(self) -> str:
        fp16 = self.beyond("float16")
        e4m3 = self.beyond("float8_e4m3fn")
        parts = [
            f"headroom (one float32 forward, {len(self.modules)} modules): "
            + (
                f"{len(fp16)} module(s) beyond float16 (±65504), first "
                + ", ".join(f"{m.path} {m.amax:,.0f}" for m in fp16[:3])
                if fp16
                else "every activation within float16"
            )
            + f"; {len(e4m3)} beyond fp8 e4m3 (±448)"
        ]
        top = self.worst(1)
        if top:
            parts.append(f"largest {top[0].path or '<model>'} {top[0].amax:,.4g}")
        if self.fp8():
            parts.append(
                "fp8 vs bf16 error: "
                + ", ".join(f"{m.path} {m.fp8_error:.2%}" for m in self.fp8()[:3])
            )
        if fp16:
            parts.append(
                "Fix: keep these in float32 (keep_fp32=[...]) or train in bf16; "
                "a float16 run turns these values into inf"
            )
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranges": RANGES,
            "float32_copy": self.copied,
            "worst": [m.to_dict() for m in self.worst()],
            "beyond_float16": [m.path for m in self.beyond("float16")],
            "beyond_float8_e4m3fn": len(self.beyond("float8_e4m3fn")),
            "fp8": [m.to_dict() for m in self.fp8()],
        }


def probe_headroom(model: nn.Module, batch: Any) -> HeadroomResult:
    """One forward of ``model`` on ``batch`` (a dict of keyword inputs, or a tuple of positional
    ones) in float32, recording each module's largest ``|output|`` (see the module docstring)."""
    root, _ = unwrap_model(model)
    half = any(
        is_castable(t) and t.dtype != torch.float32 for t in (*root.parameters(), *root.buffers())
    )
    net = _float32_copy(root) if half else root
    modes = {m: m.training for m in net.modules()}
    seen: dict[str, list[torch.Tensor]] = {}
    errors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    handles = []
    for path, mod in net.named_modules():
        kinds[path] = type(mod).__name__
        fp8 = type(mod).__name__ in FP8_LINEARS
        handles.append(mod.register_forward_hook(_recorder(path, seen, errors if fp8 else None)))
    try:
        net.eval()
        with torch.no_grad():
            batch32 = _to_float32(batch)
            if isinstance(batch32, Mapping):
                net(**batch32)
            else:
                net(*batch32)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    return _result(seen, errors, kinds, copied=half)


def _result(
    seen: dict[str, list[torch.Tensor]],
    errors: dict[str, torch.Tensor],
    kinds: dict[str, str],
    *,
    copied: bool,
) -> HeadroomResult:
    """Read every recorded value at once (one host read per device)."""
    paths = list(seen)
    peaks = [torch.stack(seen[p]).amax() for p in paths]
    values = torch.stack([p.float().cpu() for p in peaks]).tolist() if peaks else []
    errs = {p: float(e) for p, e in errors.items()}
    modules = [
        ModuleHeadroom(p, kinds.get(p, ""), v, errs.get(p))
        for p, v in zip(paths, values, strict=True)
        if not math.isnan(v)
    ]
    return HeadroomResult(modules, copied=copied)


def _float32_copy(root: nn.Module) -> nn.Module:
    """A float32 copy of ``root`` without the guards (quantized tensors are copied as they
    are)."""
    net = copy.deepcopy(root)
    for m in net.modules():
        m.__dict__.pop(GUARD_ATTR, None)  # the hook functions stay, with no state: no-ops
        m.__dict__.pop(EXIT_ATTR, None)
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None and is_castable(t) and t.dtype != torch.float32:
                t.data = t.data.float()
    return net


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if is_castable(value) else value
    if isinstance(value, Mapping):
        return {k: _to_float32(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float32(v) for v in value)
    return value


def _floating(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() and out.numel() else []
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _floating(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _floating(v)]
    return []


def _recorder(
    path: str, seen: dict[str, list[torch.Tensor]], errors: dict[str, torch.Tensor] | None
) -> Any:
    def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if errors is not None and args and isinstance(args[0], torch.Tensor):
            output = _fp8_compare(path, module, args[0], output, errors)
        for t in _floating(output):
            seen.setdefault(path, []).append(torch.linalg.vector_norm(t.detach(), ord=math.inf))
        return output if errors is not None else None

    return record


def _fp8_compare(
    path: str,
    module: nn.Module,
    x: torch.Tensor,
    out_fp8: torch.Tensor,
    errors: dict[str, torch.Tensor],
) -> torch.Tensor:
    """An fp8 layer: its output against the same layer in bf16 (the error recorded), and the
    float32 layer's output handed on, so the layers after it see the float32 forward."""
    w: torch.Tensor = module.weight  # type: ignore[assignment]
    b = getattr(module, "bias", None)
    ref = F.linear(x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()).float()
    err = torch.linalg.vector_norm(out_fp8.float() - ref) / torch.linalg.vector_norm(ref).clamp(
        min=torch.finfo(torch.float32).tiny
    )
    errors[path] = torch.maximum(errors[path], err) if path in errors else err
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def headroom_event(guard: Any, batch: Any, *, step: int = 0) -> HeadroomResult:
    """The opt-in headroom event: :func:`probe_headroom` on the guard's model and ``batch``,
    said through the findings channel (:meth:`PrecisionGuard.emit`: the console through
    ``logging``, a warning when an activation leaves float16; ``<step>-headroom.json`` with the
    per-module numbers; a picture of the largest activations against float16's range)."""
    result = probe_headroom(guard.model, batch)
    beyond = result.beyond("float16")
    guard.emit(
        Finding(
            "headroom",
            "warning" if beyond else "info",
            "hf-precision: " + result.line(),
            numbers=result.to_dict(),
            groups={m.path or "<model>": m.amax / RANGES["float16"] for m in result.worst()},
            measure="largest |activation| ÷ float16's range",
        ),
        step=step,
    )
    return result
