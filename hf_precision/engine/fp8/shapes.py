"""The fp8 shape gate: the shapes fp8 kernels refuse, checked on the CPU before step one.

An fp8 ``Linear`` (torchao's ``Float8Linear``, TransformerEngine's, an MX layer;
:func:`~hf_precision.model.fp8.matmul_format`) with ``in_features`` K, ``out_features`` N,
run on M tokens (the input's leading dimensions, flattened) makes three GEMMs ``a (m×k) @
b (k×n)`` (torchao 0.18, ``float8/float8_linear.py``)::

    forward      input (M×K)        @ weightᵀ (K×N)    k = K, n = N
    grad_input   grad_out (M×N)     @ weight (N×K)     k = N, n = K
    grad_weight  grad_outᵀ (N×M)    @ input (M×K)      k = M, n = K

``torch._scaled_mm`` (tensorwise and rowwise scaling) refuses unless ``k`` and ``n`` are
multiples of 16 ("Expected trailing dimension of mat1 to be divisible by 16", "Expected both
dimensions of mat2 to be divisible by 16"); M is free as ``m``. torchao's
``pad_inner_dim=True`` pads every ``k`` to 16 (so the token count stops mattering), never ``n``;
a GEMM whose two casts are disabled (``rowwise_with_gw_hp``: grad_weight) runs in high precision
and has no rule. MX formats scale blocks of 32 (the rule is 32). Hence, per layer:

- K and N multiples of 16 (32 for MX) wherever an fp8 GEMM has them as ``k`` or ``n``;
- under FSDP2, ``out_features`` at least the shard count (the fp8 all-gather of an empty shard
  fails, ao 1938);
- per batch, when ``grad_weight`` runs in fp8 and inner dims are not padded, the token count M a
  multiple of 16: checked by a forward pre-hook on each such layer, when a gradient will flow.

CPU emulation (``Float8LinearConfig(emulate=True)``) multiplies with ``torch.mm`` and accepts
every shape (``Linear(24, 40)`` on 3 tokens runs): the gate refuses what the GPU kernel would,
before it runs (mode ``audit``: a finding instead). It also lists the ``nn.Linear`` layers that
meet the rule but were left in high precision (a converter's filter; accelerate's
TransformerEngine conversion returns at the first Linear with an odd dimension, leaving the
siblings after it unconverted).

>>> from torch import nn
>>> from hf_precision.model.view import ModelView
>>> fp8_layers(ModelView.of(nn.Linear(24, 40)))
[]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import PrecisionError
from ...model.fp8 import MatmulFormat, matmul_format
from ...model.view import ModelView
from ...watch.finding import Finding, Severity
from .storage import check_trainable_fp8

#: the three GEMMs of a Linear, with (k, n) named by the layer's dims ("M": tokens)
GEMMS: dict[str, tuple[str, str]] = {
    "forward": ("K", "N"),
    "grad_input": ("N", "K"),
    "grad_weight": ("M", "K"),
}
#: torchao's cast configs whose two operands make each GEMM (a disabled one: high precision)
_CASTS: dict[str, tuple[str, str]] = {
    "forward": ("cast_config_input", "cast_config_weight"),
    "grad_input": ("cast_config_grad_output", "cast_config_weight_for_grad_input"),
    "grad_weight": ("cast_config_grad_output_for_grad_weight", "cast_config_input_for_grad_weight"),
}
_ATTR = "_hf_precision_fp8_shape"
_LISTED = 3


@dataclass(frozen=True)
class Fp8Layer:
    """One fp8 linear layer and the rule its kernels enforce: ``align`` (16; MX: its block),
    the GEMMs that run in fp8, and whether torchao pads the inner dimension."""

    path: str
    in_features: int
    out_features: int
    fmt: MatmulFormat
    gemms: tuple[str, ...]
    align: int

    @property
    def pads(self) -> bool:
        return self.fmt.pad_inner_dim

    def dims(self, shards: int | None = None) -> list[str]:
        """What the kernels refuse in this layer's own dimensions, in words."""
        size = {"K": self.in_features, "N": self.out_features}
        bad: dict[str, None] = {}
        for gemm in self.gemms:
            k, n = GEMMS[gemm]
            for dim, inner in ((k, True), (n, False)):
                if dim in size and size[dim] % self.align and not (inner and self.pads):
                    bad[dim] = None
        words = {"K": "in_features", "N": "out_features"}
        out = [f"{words[d]} {size[d]} % {self.align} != 0" for d in bad]
        if shards and self.out_features < shards:
            out.append(f"out_features {self.out_features} < {shards} FSDP shards")
        return out

    @property
    def token_multiple(self) -> int | None:
        """What the token count must be a multiple of (``None``: any count runs)."""
        return self.align if "grad_weight" in self.gemms and not self.pads else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "format": str(self.fmt),
            "gemms": list(self.gemms),
            "align": self.align,
            "pad_inner_dim": self.pads,
        }


def _fp8_gemms(mod: nn.Module, fmt: MatmulFormat) -> tuple[str, ...]:
    """The GEMMs that run in fp8: torchao's config says per operand; any other backend all."""
    config = getattr(mod, "config", None) if fmt.backend == "torchao" else None
    if config is None:
        return tuple(GEMMS)
    out = []
    for gemm, casts in _CASTS.items():
        kinds = [getattr(getattr(config, c, None), "scaling_type", None) for c in casts]
        if not any(getattr(k, "value", None) == "disabled" for k in kinds):
            out.append(gemm)
    return tuple(out)


def _dims(mod: nn.Module) -> tuple[int, int] | None:
    k, n = getattr(mod, "in_features", None), getattr(mod, "out_features", None)
    if isinstance(k, int) and isinstance(n, int):
        return k, n
    weight = mod._parameters.get("weight")
    return (weight.shape[1], weight.shape[0]) if weight is not None and weight.dim() == 2 else None


def fp8_layers(view: ModelView) -> list[Fp8Layer]:
    """Every fp8 linear layer of the walk with its rule (formats with no GEMM of their own,
    such as layerwise storage, are not here)."""
    out = []
    for path, _, mod in view.modules:
        fmt = matmul_format(mod)
        dims = _dims(mod) if fmt is not None else None
        if fmt is None or dims is None:
            continue
        align = fmt.block if fmt.recipe == "mx" and fmt.block else 16
        out.append(Fp8Layer(path, dims[0], dims[1], fmt, _fp8_gemms(mod, fmt), align))
    return out


def shard_count(view: ModelView) -> int | None:
    """How many shards FSDP2 splits the weights into (their ``DTensor`` mesh), or ``None``."""
    for p in view.parameters():
        mesh = getattr(p, "device_mesh", None)
        size = getattr(mesh, "size", None)
        if callable(size):
            return int(size())
    return None


def skipped_layers(view: ModelView, layers: list[Fp8Layer]) -> list[tuple[str, str]]:
    """``(path, why)`` of the plain ``nn.Linear`` layers that meet the rule of the model's fp8
    layers but run in high precision. PEFT adapters are left out on purpose and not listed."""
    if not layers:
        return []
    align = layers[0].align
    out: list[tuple[str, str]] = []
    odd_at: dict[str, str] = {}  # parent path -> its first Linear with an odd dimension
    te = layers[0].fmt.backend == "transformer_engine"
    for path, _, mod in view.modules:
        if type(mod) is not nn.Linear or ".lora_" in f".{path}":
            continue
        parent = path.rpartition(".")[0]
        if mod.in_features % 16 or mod.out_features % 16:
            odd_at.setdefault(parent, path)
            continue
        if mod.in_features % align or mod.out_features % align:
            continue
        why = "left out by the converter's filter"
        if te and parent in odd_at:
            why = (
                "accelerate's TransformerEngine conversion returned at "
                f"{odd_at[parent]} (a dimension not a multiple of 16) before reaching it"
            )
        out.append((path, why))
    return out


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return ", ".join(items[:_LISTED]) + more


@dataclass
class _TokenState:
    layer: Fp8Layer
    mode: str
    say: Callable[[Finding], None]
    handle: Any = None
    said: set[int] = field(default_factory=set)  # refused counts said (mode audit)


def token_error(layer: Fp8Layer, tokens: int) -> str:
    """The message for a token count the layer's grad_weight GEMM refuses."""
    m = layer.token_multiple
    return (
        f"{layer.path}: {tokens} tokens reach this fp8 Linear ({layer.fmt}); its backward "
        f"multiplies grad_outputᵀ ({layer.out_features}×{tokens}) by the input "
        f"({tokens}×{layer.in_features}) in fp8, and torch._scaled_mm needs that inner "
        f"dimension to be a multiple of {m} (on a GPU: 'Expected trailing dimension of mat1 to "
        f"be divisible by 16'; emulate=True runs it on the CPU). Fix: pad each batch to a "
        f"token count that is a multiple of {m} (DataCollatorWithPadding(pad_to_multiple_of="
        f"{m}) / --pad_to_multiple_of {m}), or Float8LinearConfig(pad_inner_dim=True)."
    )


def _token_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Before an fp8 layer runs: its token count against its rule. The passing path reads a
    shape and mutates nothing (under ``torch.compile`` it traces to a shape guard, no graph
    break); only a refused count builds a message."""
    state: _TokenState | None = module.__dict__.get(_ATTR)
    x = args[0] if args else None
    if state is None or not isinstance(x, torch.Tensor) or x.dim() == 0:
        return
    m = state.layer.token_multiple
    tokens = x.numel() // max(1, x.shape[-1])
    if m is None or tokens % m == 0 or not torch.is_grad_enabled():
        return
    weight = module._parameters.get("weight")
    if not (x.requires_grad or (weight is not None and weight.requires_grad)):
        return  # no gradient flows through it: its backward GEMMs never run
    message = token_error(state.layer, int(tokens))
    if state.mode != "audit":
        raise PrecisionError(message)
    if torch.compiler.is_compiling() or tokens in state.said:
        return
    state.said.add(int(tokens))  # said once per count
    state.say(Finding("fp8_shapes", "warning", f"hf-precision fp8: {message}"))


def install_token_checks(
    view: ModelView, layers: list[Fp8Layer], mode: str, say: Callable[[Finding], None]
) -> int:
    """One forward pre-hook per fp8 layer whose token count matters (idempotent: a second
    call updates the state); returns how many layers carry one."""
    n = 0
    by_path = {layer.path: layer for layer in layers if layer.token_multiple}
    for path, _, mod in view.modules:
        layer = by_path.get(path)
        if layer is None:
            continue
        old: _TokenState | None = mod.__dict__.get(_ATTR)
        state = _TokenState(layer, mode, say)
        state.handle = old.handle if old is not None else mod.register_forward_pre_hook(_token_hook)
        mod.__dict__[_ATTR] = state
        n += 1
    return n


def uninstall_token_check(mod: nn.Module) -> bool:
    """Take the gate's hook off one module (``remove_guards`` calls it on each)."""
    state = mod.__dict__.pop(_ATTR, None)
    if state is not None:
        state.handle.remove()
    return state is not None


def remove_token_checks(root: nn.Module) -> int:
    """Take the gate's hooks off ``root``; returns how many."""
    return sum(uninstall_token_check(mod) for mod in root.modules())


def gate_shapes(
    view: ModelView,
    where: str,
    mode: str,
    say: Callable[[Finding], None],
    *,
    shards: int | None = None,
) -> list[Fp8Layer]:
    """The gate, before step one: refuse (mode ``audit``: a finding) fp8 layers whose own
    dimensions or FSDP shard count the kernels refuse; put the per-batch token check on the
    others; say which eligible ``nn.Linear`` layers run in high precision. Returns the fp8
    layers (empty: nothing to check, nothing installed)."""
    layers = fp8_layers(view)
    if not layers:
        return layers
    shards = shards if shards is not None else shard_count(view)
    bad = [(layer, problems) for layer in layers if (problems := layer.dims(shards))]
    if bad:
        rows = [f"{layer.path} ({', '.join(p)})" for layer, p in bad]
        message = (
            f"{where}: {len(bad)} of {len(layers)} fp8 Linear layer(s) have dimensions the fp8 "
            f"kernels refuse ({bad[0][0].fmt}: in/out_features multiples of {bad[0][0].align}"
            f"{', out_features ≥ the FSDP shard count' if shards else ''}): {_listed(rows)}. On "
            "a GPU torch._scaled_mm raises at the first step; CPU emulation hides it. Fix: keep "
            "them out of fp8 (convert_to_float8_training(module_filter_fn=...) / "
            "AORecipeKwargs(module_filter_func=...)), or pad the layer to a multiple."
        )
        if mode != "audit":
            raise PrecisionError(message)
        say(Finding("fp8_shapes", "warning", f"hf-precision fp8: {message}"))
    skipped = skipped_layers(view, layers)
    if skipped:
        te = [p for p, why in skipped if why.startswith("accelerate's Transformer")]
        severity: Severity = "warning" if te else "info"
        say(
            Finding(
                "fp8_shapes",
                severity,
                f"hf-precision fp8: {len(skipped)} Linear layer(s) meet the fp8 shape rule but "
                f"run in high precision: {_listed([f'{p} ({w})' for p, w in skipped])}.",
                numbers={"fp8_layers": len(layers), "eligible_skipped": len(skipped)},
            )
        )
    install_token_checks(view, layers, mode, say)
    return layers


def fp8_gates(
    view: ModelView, where: str, mode: str, say: Callable[[Finding], None]
) -> list[Fp8Layer]:
    """What the guard checks of fp8 at every event, before step one and before it casts
    anything: no trainable fp8 tensor
    (:func:`~hf_precision.engine.fp8.storage.check_trainable_fp8`), then the shape gate
    (:func:`gate_shapes`); ``say`` is the engine's findings channel."""
    check_trainable_fp8(view, where, mode, say)
    return gate_shapes(view, where, mode, say)


__all__ = [
    "GEMMS",
    "Fp8Layer",
    "fp8_gates",
    "fp8_layers",
    "gate_shapes",
    "install_token_checks",
    "remove_token_checks",
    "shard_count",
    "skipped_layers",
    "token_error",
    "uninstall_token_check",
]
