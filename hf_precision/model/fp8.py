"""The three precision facts of a module: the **storage** dtype of its weights, the **compute**
dtype of its activations, and the **matmul format** (fp8 e4m3/e5m2, its scaling recipe, the
library that runs it).

A dtype map alone tells the wrong story under fp8, in opposite ways:

- torchao's ``Float8Linear`` (``convert_to_float8_training``, accelerate's ``AORecipeKwargs``)
  stores fp32/bf16 weights and multiplies in fp8;
- layerwise casting (diffusers' ``enable_layerwise_casting``, accelerate's
  ``attach_layerwise_casting_hooks``) stores fp8 and computes in bf16;
- kohya's ``--fp8_base`` stores fp8 with no hook: autocast gives the compute dtype;
- TransformerEngine's modules multiply in fp8 under its autocast, with a recipe they learn at
  their first forward.

Everything here reads attributes: no library is imported (TransformerEngine is found by its class
and module names), nothing is cast. Read by the dtype map, the reports and the fp8 checks::

    facts(module, compute=None) -> Facts       # one module
    matmul_format(module) -> MatmulFormat|None  # how its matmuls run, None: in the compute dtype
    layerwise_cast(module) -> (storage, compute, library) | None
    manifest(named_modules) -> Manifest         # the fp8 modules of a model, counted
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..rules.dtypes import SHORT_NAMES, dtype_name

#: Every fp8 dtype this torch knows.
FP8_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)
#: TransformerEngine modules whose matmuls run in fp8 inside its autocast.
_TE_MATMUL_CLASSES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "Linear1D")
#: TransformerEngine recipes (class names) -> the scaling recipe in our words.
_TE_RECIPES = {
    "DelayedScaling": "tensorwise (delayed)",
    "Float8CurrentScaling": "tensorwise",
    "MXFP8BlockScaling": "mx",
    "Float8BlockScaling": "blockwise",
}


def is_fp8(dtype: object) -> bool:
    """True for ``torch.float8_e4m3fn`` and the other fp8 dtypes (never for ``e8m0`` scales)."""
    return dtype in FP8_DTYPES


def fp8_name(dtype: object) -> str:
    """``torch.float8_e4m3fn`` -> ``"e4m3"``, ``torch.float8_e5m2fnuz`` -> ``"e5m2fnuz"``."""
    name = dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    name = name.removeprefix("float8_")
    return "e4m3" if name == "e4m3fn" else name


def short(dtype: torch.dtype | None) -> str:
    """``fp32``, ``bf16``, ``fp8 e4m3``; ``unknown`` for ``None``."""
    if dtype is None:
        return "unknown"
    if is_fp8(dtype):
        return f"fp8 {fp8_name(dtype)}"
    return SHORT_NAMES.get(dtype, dtype_name(dtype))


@dataclass(frozen=True)
class MatmulFormat:
    """How a module's matmuls run when not in its compute dtype.

    ``fp8``: the format of the forward operands (``"e4m3"``); ``grads``: the gradients' format
    in backward (``"e5m2"`` for torchao's tensorwise default, ``None`` when the same or unknown);
    ``recipe``: ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``, ``blockwise``, ``mx``,
    ``tensorwise (delayed)`` or ``unknown``; ``backend``: ``torchao``, ``transformer_engine``,
    or the library of another fp8 class; ``block``: the scaling block (32 for MX, 128
    blockwise); ``pad_inner_dim``: torchao pads the inner dimension to 16 (its kernels' rule
    is then met for K); ``emulate``: torchao's CPU emulation (no fp8 kernel runs)."""

    fp8: str
    recipe: str
    backend: str
    grads: str | None = None
    block: int | None = None
    pad_inner_dim: bool = False
    emulate: bool = False

    def __str__(self) -> str:
        return f"fp8 {self.fp8} {self.recipe} ({self.backend})"

    def as_dict(self) -> dict[str, object]:
        return {
            "fp8": self.fp8,
            "grads": self.grads,
            "recipe": self.recipe,
            "backend": self.backend,
            "block": self.block,
            "pad_inner_dim": self.pad_inner_dim,
            "emulate": self.emulate,
        }


@dataclass(frozen=True)
class Facts:
    """One module's three facts. ``storage``: its own weights' dtype at rest (``None``: it
    holds none); ``compute``: its activations' dtype (``None``: unknown until it runs);
    ``matmul``: the fp8 format its matmuls run in, ``None`` when they run in ``compute``;
    ``cast_by``: who casts storage to compute at each forward (``"layerwise casting
    (diffusers)"``), or ``None``."""

    storage: torch.dtype | None
    compute: torch.dtype | None
    matmul: MatmulFormat | None = None
    cast_by: str | None = None

    @property
    def fp8(self) -> bool:
        """True when its matmuls or its stored weights are fp8."""
        return self.matmul is not None or is_fp8(self.storage)

    def text(self) -> str:
        """``"weights fp32, matmuls fp8 e4m3 tensorwise (torchao)"``,
        ``"weights fp8 e4m3, compute bf16 (layerwise casting, diffusers)"``."""
        parts = [f"weights {short(self.storage)}"]
        if self.matmul is not None:
            if self.compute is not None and self.compute != self.storage:
                parts.append(f"compute {short(self.compute)}")  # what ran: autocast's
            parts.append(f"matmuls {self.matmul}")
        elif self.compute != self.storage or self.cast_by:
            parts.append(f"compute {short(self.compute)}")
        return ", ".join(parts) + (f" ({self.cast_by})" if self.cast_by else "")

    def as_dict(self) -> dict[str, object]:
        return {
            "storage": dtype_name(self.storage) if self.storage is not None else None,
            "compute": dtype_name(self.compute) if self.compute is not None else None,
            "matmul": self.matmul.as_dict() if self.matmul is not None else None,
            "cast_by": self.cast_by,
            "text": self.text(),
        }


def _library(obj: object) -> str:
    return type(obj).__module__.split(".", 1)[0]


def _mro_names(obj: object) -> list[str]:
    return [c.__name__ for c in type(obj).__mro__]


def _cast_dtype(cast_config: object, default: str) -> str:
    target = getattr(cast_config, "target_dtype", None)
    return fp8_name(target) if isinstance(target, torch.dtype) else default


def _torchao_recipe(config: object) -> str:
    """tensorwise / rowwise / rowwise_with_gw_hp from a ``Float8LinearConfig``'s cast configs."""
    casts = [
        getattr(config, f"cast_config_{n}", None)
        for n in (
            "input",
            "weight",
            "grad_output",
            "input_for_grad_weight",
            "weight_for_grad_input",
            "grad_output_for_grad_weight",
        )
    ]
    kinds = set()
    disabled = False
    for cast in casts:
        if cast is None:
            continue
        if getattr(getattr(cast, "scaling_type", None), "value", "dynamic") == "disabled":
            disabled = True
            continue
        kinds.add(getattr(getattr(cast, "scaling_granularity", None), "value", "tensorwise"))
    names = {"tensorwise": "tensorwise", "axiswise": "rowwise"}
    if disabled or len(kinds) > 1:
        head = "rowwise" if "axiswise" in kinds else "tensorwise"
        return f"{head}_with_gw_hp" if disabled else "mixed"
    return names.get(next(iter(kinds), "tensorwise"), "unknown")


def _torchao_format(config: object) -> MatmulFormat:
    grads = _cast_dtype(getattr(config, "cast_config_grad_output", None), "e5m2")
    fwd = _cast_dtype(getattr(config, "cast_config_input", None), "e4m3")
    return MatmulFormat(
        fp8=fwd,
        grads=grads if grads != fwd else None,
        recipe=_torchao_recipe(config),
        backend="torchao",
        pad_inner_dim=bool(getattr(config, "pad_inner_dim", False)),
        emulate=bool(getattr(config, "emulate", False)),
    )


def _te_format(module: torch.nn.Module) -> MatmulFormat | None:
    cls = type(module)
    if (
        not cls.__module__.startswith("transformer_engine")
        or cls.__name__ not in _TE_MATMUL_CLASSES
    ):
        return None
    meta = getattr(module, "fp8_meta", None)
    recipe = meta.get("recipe") if isinstance(meta, dict) else None
    fmt = str(getattr(getattr(recipe, "fp8_format", None), "name", "HYBRID")).upper()
    name = type(recipe).__name__ if recipe is not None else ""
    return MatmulFormat(
        fp8="e5m2" if fmt == "E5M2" else "e4m3",
        grads="e5m2" if fmt == "HYBRID" else None,
        recipe=_TE_RECIPES.get(name, "set at its first forward" if recipe is None else name),
        backend="transformer_engine",
        block=32
        if name == "MXFP8BlockScaling"
        else (128 if name == "Float8BlockScaling" else None),
    )


def _weight_wrapper_format(module: torch.nn.Module) -> MatmulFormat | None:
    """torchao's training weight wrappers (``Float8TrainingWeightWrapperTensor``,
    ``MXFP8TrainingWeightWrapperTensor``: the weight swaps its matmuls, the module stays
    ``nn.Linear``), and other fp8/MX tensor classes on a module's weight."""
    weight = getattr(module, "_parameters", {}).get("weight")
    if weight is None or type(weight) in (torch.Tensor, torch.nn.Parameter):
        return None
    names = _mro_names(weight)
    config = getattr(weight, "config", None)
    lib = _library(weight)
    if "MXFP8TrainingWeightWrapperTensor" in names:
        return MatmulFormat(fp8="e4m3", recipe="mx", backend=lib, block=32)
    if "Float8TrainingWeightWrapperTensor" in names:
        recipe = str(getattr(config, "float8_linear_recipe", "unknown"))
        return MatmulFormat(fp8="e4m3", recipe=recipe, backend=lib)
    if any(n.startswith("MX") for n in names[:-2]) and lib == "torchao":
        return MatmulFormat(fp8="e4m3", recipe="mx", backend=lib, block=32)
    return None


def _quanto_format(module: torch.nn.Module) -> MatmulFormat | None:
    """optimum-quanto's ``QLinear`` with fp8 activations: both operands fp8."""
    act = getattr(getattr(module, "activation_qtype", None), "dtype", None)
    if is_fp8(act):
        return MatmulFormat(fp8=fp8_name(act), recipe="tensorwise", backend=_library(module))
    return None


def matmul_format(module: torch.nn.Module) -> MatmulFormat | None:
    """How ``module``'s own matmuls run when that is fp8 (``None``: in its compute dtype).

    >>> matmul_format(torch.nn.Linear(2, 2)) is None
    True
    """
    names = _mro_names(module)
    if "Float8Linear" in names and hasattr(module, "config"):
        return _torchao_format(module.config)
    if "Float8BlockwiseLinear" in names:
        return MatmulFormat(
            fp8="e4m3",
            recipe="blockwise",
            backend=_library(module),
            block=getattr(module, "block_size", 128),
        )
    te = _te_format(module)
    if te is not None:
        return te
    found = _weight_wrapper_format(module) or _quanto_format(module)
    if found is not None:
        return found
    if any(
        ("fp8" in n.lower() or "float8" in n.lower()) and "linear" in n.lower() for n in names[:-2]
    ):
        return MatmulFormat(fp8="e4m3", recipe="unknown", backend=_library(module))
    return None


def _layerwise_hooks(module: torch.nn.Module) -> Iterable[tuple[object, str]]:
    hook = module.__dict__.get("_hf_hook")  # accelerate: one hook, or a SequentialHook of them
    for h in (*getattr(hook, "hooks", ()), hook):
        if h is not None and type(h).__name__ == "LayerwiseCastingHook":
            yield h, _library(h)
    registry = module.__dict__.get("_diffusers_hook")  # diffusers: a HookRegistry by name
    hooks = getattr(registry, "hooks", None)
    if isinstance(hooks, dict):
        for h in hooks.values():
            if type(h).__name__ == "LayerwiseCastingHook":
                yield h, _library(h)


def layerwise_cast(module: torch.nn.Module) -> tuple[torch.dtype, torch.dtype, str] | None:
    """``(storage, compute, library)`` when a layerwise-casting hook of diffusers or accelerate
    sits on ``module`` itself (they hook the leaf layers), else ``None``."""
    for hook, lib in _layerwise_hooks(module):
        storage = getattr(hook, "storage_dtype", None)
        compute = getattr(hook, "compute_dtype", None)
        if isinstance(storage, torch.dtype) and isinstance(compute, torch.dtype):
            return storage, compute, lib
    return None


def _own_storage(module: torch.nn.Module) -> torch.dtype | None:
    floating = None
    for p in module._parameters.values():
        if p is None:
            continue
        if is_fp8(p.dtype):
            return p.dtype
        if floating is None and p.is_floating_point():
            floating = p.dtype
    return floating


def facts(module: torch.nn.Module, compute: torch.dtype | None = None) -> Facts:
    """The three facts of ``module`` (its own weights, not its children's).

    ``compute`` is what the caller knows of the activations (the autocast dtype, or what the
    guards saw at the first forward); a layerwise-casting hook's compute dtype wins over it.
    Without either, a floating non-fp8 storage dtype is the compute dtype; fp8 storage with no
    hook (kohya's ``--fp8_base``) leaves it ``None`` until the caller says.

    >>> facts(torch.nn.Linear(2, 2)).text()
    'weights fp32'
    """
    cast = layerwise_cast(module)
    if cast is not None:
        storage, hooked_compute, lib = cast
        return Facts(storage, hooked_compute, matmul_format(module), f"layerwise casting, {lib}")
    own = _own_storage(module)
    if compute is None and own is not None and not is_fp8(own):
        compute = own
    return Facts(own, compute, matmul_format(module))


@dataclass
class Manifest:
    """The fp8 modules of a model: ``modules`` (name -> facts, in walk order), ``linears``:
    how many ``nn.Linear`` (subclasses included) were seen, ``layers``: how many modules hold
    weights of their own (what layerwise casting hooks)."""

    modules: dict[str, Facts] = field(default_factory=dict)
    linears: int = 0
    layers: int = 0

    def groups(self) -> dict[str, list[str]]:
        """Module names by their facts' text, in walk order."""
        out: dict[str, list[str]] = {}
        for name, f in self.modules.items():
            out.setdefault(f.text(), []).append(name)
        return out

    def lines(self) -> list[str]:
        """``"weights fp32, matmuls fp8 e4m3 tensorwise (torchao), 27 of 29 Linears"``."""
        out = []
        for text, names in self.groups().items():
            fmt = self.modules[names[0]].matmul is not None
            total, kind = (self.linears, "Linears") if fmt else (self.layers, "layers")
            out.append(f"{text}, {len(names)} of {total} {kind}")
        return out

    def as_dict(self) -> dict[str, object]:
        return {
            "linears": self.linears,
            "layers": self.layers,
            "fp8_modules": len(self.modules),
            "groups": [
                {"facts": text, "count": len(names), "modules": names}
                for text, names in self.groups().items()
            ],
            "modules": {n: f.as_dict() for n, f in self.modules.items()},
        }


_CLASS_FP8: dict[type, bool] = {}
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _class_fp8(cls: type) -> bool:
    found = _CLASS_FP8.get(cls)
    if found is None:
        names = [c.__name__.lower() for c in cls.__mro__]
        found = _CLASS_FP8[cls] = any(
            "float8" in n or "fp8" in n for n in names
        ) or cls.__module__.startswith(("transformer_engine", "optimum.quanto"))
    return found


def might_be_fp8(module: torch.nn.Module) -> bool:
    """A cheap first look (a class lookup, two dict reads, one weight's type and dtype): only
    modules it lets through can have fp8 facts. The dtype map asks it of every module."""
    if _class_fp8(type(module)):
        return True
    d = module.__dict__
    if "_hf_hook" in d or "_diffusers_hook" in d:
        return True
    w = module._parameters.get("weight")
    return w is not None and (type(w) not in _PLAIN or w.dtype in FP8_DTYPES)


def manifest(
    named_modules: Iterable[tuple[str, torch.nn.Module]],
    compute: torch.dtype | Mapping[str, torch.dtype] | None = None,
) -> Manifest:
    """Walk ``(name, module)`` pairs once (``model.named_modules()`` or a view's list) and keep
    the modules whose matmuls or own weights are fp8. ``compute``: the activations' dtype of
    every module, or by name (what the guard saw them run in at a forward)."""
    out = Manifest()
    by_name = compute if isinstance(compute, Mapping) else {}
    every = compute if isinstance(compute, torch.dtype) else None
    for name, mod in named_modules:
        if isinstance(mod, torch.nn.Linear):
            out.linears += 1
        if any(p is not None for p in mod._parameters.values()):
            out.layers += 1
        if not might_be_fp8(mod):
            continue
        f = facts(mod, by_name.get(name, every))
        if f.fp8:
            out.modules[name] = f
    return out
