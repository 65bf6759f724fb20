"""What FSDP2's ``MixedPrecisionPolicy.output_dtype`` does to a model's outputs.

``fully_shard(module, mp_policy=MixedPrecisionPolicy(output_dtype=...))`` casts every floating
tensor a unit returns. Two ways that loses or breaks something, both read from the units'
states (``FSDPModule._get_fsdp_state()._mp_policy``), neither a tensor FSDP2 owns:

* a **root unit in a half dtype** (accelerate's default FSDP2 policy for ``bf16`` sets
  ``output_dtype=bfloat16``) rounds what the model returns, transformers' float32 loss
  included: 4.869632 comes back as 4.875000. Said with the fix (``output_dtype=torch.float32``
  in the user's tool's words); the guard cannot give the bits back.
* a **nested unit whose output dtype differs from the dtype its parent unit computes in**
  (``output_dtype=float32`` inside a bf16 parent) hands that dtype to the parent's own layers
  (the final norm and ``lm_head`` after the last decoder layer): ``mat1 and mat2 must have the
  same dtype, but got Float and BFloat16``. The guard bridges: a forward hook after FSDP2's
  casts the unit's outputs to the parent's ``param_dtype`` (activations only; no parameter,
  shard or FSDP2 state is written). Sibling units need nothing: FSDP2 casts their inputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...base.wrapper_kinds import clean_name, fsdp_param_groups, is_fsdp2_module
from ...rules.dtypes import dtype_name

__all__ = [
    "Fsdp2Outputs",
    "OutputBridge",
    "bridge_outputs",
    "fsdp2_outputs",
    "settle_outputs",
    "unit_policy",
]

_HALF = (torch.bfloat16, torch.float16)
#: the fix, in accelerate's words and in torch's
_FIX = (
    "Fix: accelerate: FullyShardedDataParallelPlugin(fsdp_version=2, "
    "mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
    "reduce_dtype=torch.float32, output_dtype=torch.float32)); torch: fully_shard(model, "
    "mp_policy=MixedPrecisionPolicy(..., output_dtype=torch.float32))"
)


def unit_policy(m: nn.Module) -> Any:
    """The ``MixedPrecisionPolicy`` an FSDP2 unit runs under (its state's, else its first
    parameter group's), or ``None``."""
    state = m._get_fsdp_state()  # type: ignore[operator]
    policy = getattr(state, "_mp_policy", None)
    if policy is None:
        policy = next((g.mp_policy for g in fsdp_param_groups(m) if hasattr(g, "mp_policy")), None)
    return policy


@dataclass(frozen=True)
class OutputBridge:
    """A nested unit returning ``output`` into a parent unit that computes in ``parent``."""

    unit: str
    parent: str
    output: torch.dtype
    compute: torch.dtype

    def describe(self, more: int = 0) -> str:
        """What the bridge does and the fix; ``more`` other units of the same kind."""
        also = f" (and {more} more unit(s) like it)" if more else ""
        return (
            f"FSDP2 unit {self.unit}{also} returns {dtype_name(self.output)} "
            f"(MixedPrecisionPolicy(output_dtype={self.output})) into its parent unit "
            f"{self.parent or '<model>'}, which computes in {dtype_name(self.compute)}: the "
            f"parent's own layers would get {dtype_name(self.output)} inputs ('mat1 and mat2 "
            f"must have the same dtype'). The guard casts the unit's outputs to "
            f"{dtype_name(self.compute)} (a forward hook; nothing FSDP2 owns is written). Fix: "
            f"fully_shard(<{self.unit}>, mp_policy=MixedPrecisionPolicy(param_dtype="
            f"{self.compute}, output_dtype=None)), or the same output_dtype on the parent."
        )


@dataclass
class Fsdp2Outputs:
    """What the FSDP2 units' output dtypes do (:func:`fsdp2_outputs`)."""

    #: root units whose half ``output_dtype`` rounds the model's outputs: (path, dtype)
    rounded: list[tuple[str, torch.dtype]] = field(default_factory=list)
    bridges: list[OutputBridge] = field(default_factory=list)

    def messages(self, where: str) -> list[str]:
        """One message per finding, each with its fix."""
        out = [
            f"{where}: the FSDP2 root unit {path or '<model>'} has MixedPrecisionPolicy("
            f"output_dtype={dtype}): what the model returns is cast to {dtype_name(dtype)}, "
            "transformers' float32 loss included (4.869632 comes back as 4.875000), and the "
            f"logged loss and its gradient start from the rounded value. {_FIX}."
            for path, dtype in self.rounded
        ]
        kinds: dict[tuple[str, torch.dtype, torch.dtype], list[OutputBridge]] = {}
        for b in self.bridges:
            kinds.setdefault((b.parent, b.output, b.compute), []).append(b)
        return out + [f"{where}: {bs[0].describe(len(bs) - 1)}" for bs in kinds.values()]


def _units(modules: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module, str | None]]:
    """``(path, unit, parent unit's path or None)`` for every FSDP2 unit, in pre-order."""
    found: list[tuple[str, nn.Module, str | None]] = []
    paths: list[str] = []
    for path, m in modules:
        if not is_fsdp2_module(m):
            continue
        path = clean_name(path)
        parent = max(
            (p for p in paths if p == "" or path.startswith(p + ".")), key=len, default=None
        )
        found.append((path, m, parent))
        paths.append(path)
    return found


def fsdp2_outputs(model: nn.Module) -> Fsdp2Outputs:
    """The root units that round the model's outputs to a half dtype and the nested units whose
    output dtype differs from the dtype their parent unit computes in. Reads the units' mixed
    precision policies only; empty for a model no FSDP2 unit holds."""
    out = Fsdp2Outputs()
    units = _units(model.named_modules())
    policies = {path: unit_policy(m) for path, m, _ in units}
    for path, _, parent in units:
        output = getattr(policies[path], "output_dtype", None)
        if output is None:
            continue
        if parent is None:
            if output in _HALF:
                out.rounded.append((path, output))
            continue
        compute = getattr(policies[parent], "param_dtype", None)
        if compute is not None and compute != output:
            out.bridges.append(OutputBridge(path, parent, output, compute))
    return out


def _cast_output(dtype: torch.dtype, output: Any) -> Any:
    from torch.utils._pytree import tree_map_only

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return tree_map_only(torch.Tensor, cast, output)


def bridge_outputs(model: nn.Module, bridges: Iterable[OutputBridge]) -> list[RemovableHandle]:
    """Forward hooks (after FSDP2's own) that cast each bridged unit's floating outputs to its
    parent's compute dtype; the caller keeps the handles and removes them at teardown."""
    by_path = {clean_name(p): m for p, m in model.named_modules()}
    handles = []
    for b in bridges:
        unit = by_path.get(b.unit)
        if unit is not None:
            handles.append(
                unit.register_forward_hook(lambda _m, _i, o, d=b.compute: _cast_output(d, o))
            )
    return handles


def settle_outputs(
    model: nn.Module, name: str, bridges: dict[str, list[RemovableHandle]]
) -> list[str]:
    """FSDP2's ``output_dtype`` in words for the front end ``name``: a half root output (the
    loss rounded) is said with the fix; a nested unit returning another dtype than its parent
    computes in is bridged by a forward hook on its outputs (once per unit, kept in
    ``bridges``) and said. Returns the messages (none: nothing to say)."""
    outputs = fsdp2_outputs(model)
    messages = outputs.messages(name)
    if messages:
        for b in outputs.bridges:
            if b.unit not in bridges:
                bridges[b.unit] = bridge_outputs(model, [b])
    return messages
