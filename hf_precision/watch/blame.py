"""Who made the NaN: the first module whose output turned non-finite, named with its dtypes.

:class:`NonFiniteBlame` watches one model. Its modes (the same on every front end: the
callback's and the plugin's ``blame=``, ``HF_PRECISION_BLAME``, ``hf-precision doctor
--blame``):

* ``"auto"`` (default): no hook is installed and nothing is checked until a logged loss or
  gradient norm is non-finite (:meth:`NonFiniteBlame.observe`); then it arms itself and inspects
  the next training step (the batch that produced the logged value is gone), reports, and takes
  its hooks off again;
* ``"always"``: armed from the start, every step inspected (the cost is in benchmarks/);
* ``"off"``: never.

Armed, a forward hook on every module checks that module's floating outputs, in execution
order: the first one holding inf/NaN is the finding. Its inputs finite: the **producer**; an
input already non-finite (the batch, or tensor code between modules): a **propagator**. A
float16 output that is inf while the inputs were finite is recomputed once in float32 (weights
and inputs upcast into temporaries, the module untouched): above 65504 it is an **overflow**,
with the largest value the float32 math reached. When the loss was finite but the gradient
norm was not (or in ``"always"`` mode), full backward hooks on the modules that hold
parameters name the first module, in backward order, whose input gradient is non-finite while
its output gradient is finite.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).half()
>>> with torch.no_grad():
...     _ = model[0].weight.fill_(1.0)
...     _ = model[2].weight.fill_(4e4)
>>> blame = NonFiniteBlame(model, mode="always")
>>> _ = model(torch.ones(1, 4, dtype=torch.float16))  # 4e4 * (4 + bias) > 65504
>>> finding = blame.collect(step=0)
>>> finding.module, finding.role, finding.kind, finding.output_dtype
('2', 'producer', 'overflow', 'float16')
>>> blame.disarm(); blame.hooks_installed()
0
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

from ..base.wrapper_kinds import unwrap_model
from ..errors import PrecisionError, did_you_mean
from ..rules import flags
from ..rules.dtypes import dtype_name
from .finding import Finding

logger = logging.getLogger("hf_precision")

#: ``off``: never; ``auto``: armed by a non-finite logged loss/gradient norm; ``always``.
BlameMode = Literal["off", "auto", "always"]
BLAME_MODES: tuple[BlameMode, ...] = get_args(BlameMode)
#: The launcher's variable (``hf-precision run``, ``HF_PRECISION_GUARD``).
ENV_BLAME = "HF_PRECISION_BLAME"
#: The largest finite float16.
FP16_MAX = float(torch.finfo(torch.float16).max)
#: Armed by ``auto``, the hooks stay on for at most this many steps without a finding.
ARMED_STEPS = 4


def check_mode(mode: Any, *, call: str) -> BlameMode:
    """``mode`` if it is one of :data:`BLAME_MODES`, else a :class:`PrecisionError`."""
    if mode in BLAME_MODES:
        return mode  # type: ignore[no-any-return]
    hint = did_you_mean(str(mode), BLAME_MODES)
    raise PrecisionError(
        f"{call}: blame={mode!r} is not a mode.{hint} Fix: blame='auto' (default: armed by a "
        "non-finite loss or gradient norm), 'always' or 'off'."
    )


def is_nonfinite(value: Any) -> bool:
    """A logged number (float, tensor) that is inf or NaN."""
    if isinstance(value, torch.Tensor):
        return value.numel() > 0 and not bool(torch.isfinite(value.detach()).all())
    return isinstance(value, float) and not math.isfinite(value)


@dataclass(frozen=True)
class NonFinite:
    """One finding: the module, what it did, its dtypes, the value, the fix."""

    module: str
    module_type: str
    role: Literal["producer", "propagator"]
    kind: Literal["overflow", "inf", "nan"]
    phase: Literal["forward", "backward"]
    input_dtypes: tuple[str, ...]
    weight_dtypes: tuple[str, ...]
    output_dtype: str
    nonfinite: int  # elements of the output (backward: of the input gradient) that are inf/NaN
    max_abs: float | None  # overflow: the largest |x| of the float32 math; else the finite max
    weights_finite: bool
    step: int
    trigger: str  # what armed the blame
    note: str  # which batch was inspected
    fix: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """The one console line."""
        what = {"inf": "made inf", "nan": "made NaN"}.get(self.kind) or (
            f"overflowed float16 (|x| up to {self.max_abs:.4g} > {FP16_MAX:.0f})"
        )
        where = "output" if self.phase == "forward" else "input gradient"
        role = (
            f"{self.role}: inputs finite, {where} not"
            if self.role == "producer"
            else f"{self.role}: its input was already non-finite"
        )
        ins = "/".join(self.input_dtypes) or "-"
        ws = "/".join(self.weight_dtypes) or "none"
        return (
            f"hf-precision blame ({self.trigger}; {self.note}): {self.module} "
            f"({self.module_type}) {what} in the {self.phase} pass at step {self.step} "
            f"[{role}; {self.nonfinite} non-finite element(s); inputs {ins}, weights {ws}, "
            f"output {self.output_dtype}]. Fix: {self.fix}"
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["line"] = self.line()
        return out

    def finding(self) -> Finding:
        """This finding for :func:`~hf_precision.watch.finding.emit` (the console, the
        reporter's ``<step>-nonfinite.json`` and trackers)."""
        return Finding("nonfinite", "error", self.line(), numbers=self.to_dict(), detail=self)


def _floats(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """The floating tensors in a module's inputs or outputs (tuples, dicts, ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _floats(o, depth + 1)
    elif depth < 3 and isinstance(obj, dict):  # ModelOutput is a dict
        for o in obj.values():
            yield from _floats(o, depth + 1)


def _bad(t: torch.Tensor) -> bool:
    return not bool(torch.isfinite(t.detach()).all())


def _dtypes(tensors: Iterable[torch.Tensor]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(dtype_name(t.dtype) for t in tensors))


def weight_dtypes(module: nn.Module) -> tuple[str, ...]:
    """The dtypes of a module's parameters (its own; a container's: all below it)."""
    own = list(module.parameters(recurse=False)) or list(module.parameters())
    return _dtypes(own)


def _upcast(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().float() if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(_upcast(o) for o in obj)
    if isinstance(obj, list):
        return [_upcast(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _upcast(v) for k, v in obj.items()}
    return obj


def fp32_max_abs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
    """The largest |x| of ``module``'s output computed in float32 (its floating weights,
    buffers and inputs upcast into temporaries; the module is not changed), or ``None`` when
    that forward cannot run."""
    from torch.func import functional_call

    state = {
        k: (v.detach().float() if v.is_floating_point() else v)
        for k, v in [*module.named_parameters(), *module.named_buffers()]
    }
    try:
        with torch.no_grad(), torch.autocast(args_device(args), enabled=False):
            out = functional_call(module, state, _upcast(args), _upcast(kwargs))
    except Exception:  # a forward that needs its own dtypes: the value stays unknown
        return None
    values = [t.abs().max().item() for t in _floats(out) if t.numel()]
    return max(values) if values else None


def args_device(args: Any) -> str:
    for t in _floats(args):
        return t.device.type
    return "cpu"


def fix_for(finding_kind: str, role: str, module: str, *, weights_finite: bool, args: Any) -> str:
    """The fix in the user's tool's words."""
    keep = f"keep_fp32=[{'^' + re.escape(module) + '$'!r}]"
    if not weights_finite:
        return (
            f"{module}'s weights already hold inf/NaN (an earlier step wrote them): resume "
            "from a checkpoint before the first non-finite loss and lower the learning rate, "
            f"or train in bfloat16 ({flags.flag('bf16', True, args=args)})"
        )
    if role == "propagator":
        return (
            f"{module} received non-finite inputs: check the batch (pixel_values, masks) and "
            "the tensor code that runs before it"
        )
    if finding_kind == "overflow":
        return (
            f"train in bfloat16, which has float32's range ({flags.flag('bf16', True, args=args)}"
            f"; a float16 checkpoint: {flags.load_dtype('bfloat16', args=args)}), or keep this "
            f"module in float32: {keep} (PrecisionPolicy, or HF_PRECISION_KEEP_FP32)"
        )
    return (
        f"keep this module in float32 ({keep}) and check its inputs' scale; if it persists, "
        "lower the learning rate"
    )


class NonFiniteBlame:
    """The blame for one model (see the module docstring). ``args`` (``TrainingArguments`` or
    ``None``) picks the spelling of the fix."""

    def __init__(self, model: nn.Module, mode: BlameMode = "auto", *, args: Any = None) -> None:
        self.mode = check_mode(mode, call="NonFiniteBlame")
        self.root, _ = unwrap_model(model)
        self.args = args
        self.findings: list[NonFinite] = []
        self.trigger = ""
        self.backward = False
        self._handles: list[Any] = []
        self._first: dict[str, Any] | None = None  # the forward finding of this step
        self._first_backward: dict[str, Any] | None = None
        self._armed_steps = 0
        self._reported: set[tuple[str, str]] = set()
        if self.mode == "always":
            self.arm("blame='always'", backward=True)

    # ------------------------------------------------------------------ arming
    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def hooks_installed(self) -> int:
        """Hooks this blame has on the model now (0 when idle)."""
        return len(self._handles)

    def observe(self, logs: dict[str, Any] | None, *, step: int = 0) -> bool:
        """A logged ``loss``/``grad_norm``: a non-finite one arms ``auto`` (gradients only:
        with the backward hooks too). Returns whether it armed now."""
        if self.mode != "auto" or self.armed or not logs or self.findings:
            return False
        bad = [k for k in ("loss", "grad_norm") if is_nonfinite(logs.get(k))]
        if not bad:
            return False
        values = ", ".join(f"{k}={logs[k]}" for k in bad)
        self.arm(f"armed by {values} logged at step {step}", backward="loss" not in bad)
        return True

    def arm(self, trigger: str = "on request", *, backward: bool = False) -> None:
        """Install the hooks (forward on every module; backward on those holding parameters
        when ``backward``)."""
        if self.armed or self.mode == "off":
            return
        self.trigger, self.backward, self._armed_steps = trigger, backward, 0
        self._first = self._first_backward = None
        for name, module in self.root.named_modules():
            hook = self._forward_hook(name or type(module).__name__)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
            if backward and any(True for _ in module.parameters(recurse=False)):
                bhook = self._backward_hook(name or type(module).__name__)
                self._handles.append(module.register_full_backward_hook(bhook))
        logger.info("hf-precision blame: armed (%s), %d hook(s)", trigger, len(self._handles))

    def disarm(self) -> None:
        """Take every hook off (idle ``auto`` holds none)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ hooks
    def _forward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self._first is not None:
                return
            outs = [t for t in _floats(output) if _bad(t)]
            if not outs:
                return
            ins = list(_floats((args, kwargs)))
            self._first = {
                "name": name,
                "module": module,
                "args": args,
                "kwargs": kwargs,
                "inputs_bad": any(_bad(t) for t in ins),
                "input_dtypes": _dtypes(ins),
                "out": outs[0],
            }

        return hook

    def _backward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if self._first_backward is not None:
                return
            gin = [t for t in _floats(grad_input) if _bad(t)]
            if not gin:
                return
            gout = list(_floats(grad_output))
            self._first_backward = {
                "name": name,
                "module": module,
                "inputs_bad": any(_bad(t) for t in gout),
                "input_dtypes": _dtypes(gout),
                "out": gin[0],
            }

        return hook

    # ------------------------------------------------------------------ result
    def collect(self, *, step: int, note: str = "") -> NonFinite | None:
        """After a step: the finding (forward first, else backward), or ``None``. ``auto``
        disarms after a finding, or after :data:`ARMED_STEPS` steps without one."""
        if not self.armed:
            return None
        note = note or (
            "inspected the next step's batch: the one that made the logged value is gone"
            if self.mode == "auto"
            else "inspected this step's batch"
        )
        found = self._first or self._first_backward
        phase = "forward" if self._first is not None else "backward"
        self._first = self._first_backward = None
        self._armed_steps += 1
        result = self._finding(found, phase, step, note) if found is not None else None
        if result is not None and (result.module, result.phase) in self._reported:
            result = None  # "always": said once per module and pass
        if result is not None:
            self._reported.add((result.module, result.phase))
            self.findings.append(result)  # said by the caller: emit(result.finding(), ...)
        if self.mode == "auto" and (result is not None or self._armed_steps >= ARMED_STEPS):
            if result is None:
                logger.warning(
                    "hf-precision blame (%s): %d step(s) inspected, every module's output "
                    "finite; disarmed",
                    self.trigger,
                    self._armed_steps,
                )
            self.disarm()
        return result

    def _finding(self, f: dict[str, Any], phase: str, step: int, note: str) -> NonFinite:
        module, out = f["module"], f["out"]
        weights_ok = all(bool(torch.isfinite(p.detach()).all()) for p in module.parameters())
        role = "propagator" if f["inputs_bad"] else "producer"
        has_nan = bool(torch.isnan(out.detach()).any())
        kind = "nan" if has_nan else "inf"
        finite = out.detach()[torch.isfinite(out.detach())]
        max_abs = float(finite.abs().max()) if finite.numel() else None
        if phase == "forward" and role == "producer" and weights_ok and out.dtype == torch.float16:
            full = fp32_max_abs(module, f["args"], f["kwargs"])
            if full is not None and full > FP16_MAX:
                kind, max_abs = "overflow", full
        return NonFinite(
            module=f["name"],
            module_type=type(module).__name__,
            role=role,  # type: ignore[arg-type]
            kind=kind,  # type: ignore[arg-type]
            phase=phase,  # type: ignore[arg-type]
            input_dtypes=f["input_dtypes"],
            weight_dtypes=weight_dtypes(module),
            output_dtype=dtype_name(out.dtype),
            nonfinite=int((~torch.isfinite(out.detach())).sum()),
            max_abs=max_abs,
            weights_finite=weights_ok,
            step=step,
            trigger=self.trigger,
            note=note,
            fix=fix_for(kind, role, f["name"], weights_finite=weights_ok, args=self.args),
        )


def blame_batch(
    model: nn.Module,
    batch: dict[str, Any],
    *,
    backward: bool = True,
    autocast: torch.dtype | None = None,
    args: Any = None,
    trigger: str = "on request",
) -> NonFinite | None:
    """Run ``batch`` through ``model`` once, armed (what ``hf-precision doctor --blame`` does
    when it can re-run the same batch); the hooks are off again afterwards."""
    blame = NonFiniteBlame(model, "off", args=args)
    blame.mode = "always"
    blame.arm(trigger, backward=backward)
    try:
        device = next((p.device.type for p in model.parameters()), "cpu")
        with torch.autocast(device, dtype=autocast or torch.float32, enabled=autocast is not None):
            out = model(**batch)
        loss = out.get("loss") if isinstance(out, dict) else None
        if backward and isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
        return blame.collect(step=0, note="the same batch, re-run")
    finally:
        blame.disarm()
        model.zero_grad(set_to_none=True)


__all__ = [
    "BLAME_MODES",
    "ENV_BLAME",
    "FP16_MAX",
    "BlameMode",
    "NonFinite",
    "NonFiniteBlame",
    "blame_batch",
    "check_mode",
    "is_nonfinite",
]
