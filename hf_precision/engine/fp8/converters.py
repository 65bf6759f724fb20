"""fp8 in the one policy: feed ``keep_out_of_fp8`` to the converters, and check what they did.

- :func:`module_filter` is torchao's ``module_filter_fn`` / accelerate's
  ``AORecipeKwargs(module_filter_func=...)``: ``False`` for what the policy keeps out of fp8
  (and for Linears whose dimensions are not multiples of 16, as accelerate's own filter);
- :func:`skip_modules_pattern` is diffusers' ``enable_layerwise_casting(skip_modules_pattern=)``
  and accelerate's ``attach_layerwise_casting_hooks``;
- :func:`check_fp8` runs at each guard event (:func:`fp8_event`): it builds the fp8 manifest
  (the three facts of every fp8 module, :mod:`hf_precision.model.fp8`), brings a torchao
  ``Float8Linear`` the policy keeps out back to ``nn.Linear`` with the same parameters (never a
  copy), refuses what cannot be brought back, names a ``keep_out_of_fp8`` entry that matched
  nothing, and, when fp8 was asked for and no module runs it, who turned it off (the
  provenance record). :func:`fp8_finding` says it all through the findings channel
  (:mod:`hf_precision.watch.finding`): the console, ``precision.log``, ``<step>-fp8.json``
  and its picture (per group, the share of Linears running fp8), the trackers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import PrecisionError
from ...model import fp8
from ...model.view import ModelView
from ...rules.fp8_rules import DEFAULT_KEEP_OUT_OF_FP8, WORDS, keep_out_reason, language_edge_blocks
from ...watch.finding import Finding

__all__ = [
    "Fp8Check",
    "check_fp8",
    "feed_converters",
    "fp8_event",
    "fp8_finding",
    "keep_out",
    "module_filter",
    "skip_modules_pattern",
]


def _policy(policy: Any) -> Any:
    if policy is None:
        from ...rules.policy.precision_policy import PrecisionPolicy

        return PrecisionPolicy.from_preset("bf16")
    return policy


def keep_out(view: ModelView, policy: Any = None) -> dict[str, tuple[nn.Module, str]]:
    """``path -> (module, reason)`` for every module with weights the policy keeps out of fp8."""
    policy = _policy(policy)
    edges = (
        language_edge_blocks((p, g) for p, g, _ in view.modules)
        if "first_last_blocks" in policy.keep_out_of_fp8
        else set()
    )
    out: dict[str, tuple[nn.Module, str]] = {}
    for path, group, mod in view.modules:
        if not mod._parameters:
            continue
        why = keep_out_reason(
            policy.keep_out_of_fp8, path, group, mod, keep_fp32=policy.keep_fp32, edge_blocks=edges
        )
        if why is not None:
            out[path] = (mod, why)
    return out


def _shape_ok(mod: nn.Module) -> bool:
    if isinstance(mod, nn.Linear):
        return mod.in_features % 16 == 0 and mod.out_features % 16 == 0
    return True


def module_filter(
    model: nn.Module,
    policy: Any = None,
    base: Callable[[nn.Module, str], bool] | None = None,
) -> Callable[[nn.Module, str], bool]:
    """A ``(module, fqn) -> bool`` filter: ``True`` converts. Modules are told apart by
    identity, so any prefix the converter puts on names works; ``base`` (the user's own filter)
    must agree too.

    >>> from hf_precision.tiny import tiny_llava
    >>> model = tiny_llava()
    >>> keep = module_filter(model)
    >>> keep(model.lm_head, "lm_head"), keep(model.model.language_model.layers[0].mlp.up_proj, "x")
    (False, True)
    """
    out = {id(m) for m, _ in keep_out(ModelView.of(model), policy).values()}

    def convert(mod: nn.Module, fqn: str) -> bool:
        if id(mod) in out or not _shape_ok(mod):
            return False
        return base(mod, fqn) if base is not None else True

    convert.hf_precision_keep_out = len(out)  # type: ignore[attr-defined]
    return convert


def skip_modules_pattern(model: nn.Module, policy: Any = None) -> tuple[str, ...]:
    """diffusers' / accelerate's ``skip_modules_pattern`` for layerwise casting: one anchored
    regex per module the policy keeps out (their names as ``model.named_modules()`` has them)."""
    import re

    view = ModelView.of(model)
    names = {id(m): n for n, m in model.named_modules()}
    return tuple(
        f"^{re.escape(names[id(m)])}$" for m, _ in keep_out(view, policy).values() if id(m) in names
    )


@dataclass
class Fp8Check:
    """One event's fp8 result: the manifest and what the check did."""

    manifest: fp8.Manifest
    restored: list[str] = field(default_factory=list)  # Float8Linear -> nn.Linear, same params
    kept_out: dict[str, str] = field(default_factory=dict)  # fp8 modules the policy keeps out
    unused: list[str] = field(default_factory=list)  # keep_out_of_fp8 entries matching nothing
    kept: int = 0  # modules with weights the policy keeps out of fp8

    def section(self) -> dict[str, Any]:
        out = self.manifest.as_dict()
        out["lines"] = self.manifest.lines()
        out["restored"] = list(self.restored)
        out["kept_out_running_fp8"] = dict(self.kept_out)
        out["unused_keep_out"] = list(self.unused)
        return out


def _restore(view: ModelView, path: str, mod: nn.Module) -> nn.Linear | None:
    """``nn.Linear`` holding ``mod``'s own ``Parameter`` objects, put where ``mod`` was."""
    parent_path, _, name = path.rpartition(".")
    parent = next((m for p, _, m in view.modules if p == parent_path), None)
    if parent is None or getattr(parent, name, None) is not mod:
        return None
    lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
    lin.weight = mod.weight
    if mod.bias is not None:
        lin.bias = mod.bias
    lin.train(mod.training)
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
        getattr(lin, attr).update(getattr(mod, attr))
    setattr(parent, name, lin)
    return lin


def _unused(view: ModelView, policy: Any, hits: set[str]) -> list[str]:
    """The user's own ``keep_out_of_fp8`` entries (patterns, not the default words and groups)
    that matched no module."""
    return [
        e
        for e in policy.keep_out_of_fp8
        if e not in DEFAULT_KEEP_OUT_OF_FP8
        and e not in WORDS
        and e not in view.groups.names
        and not any(r.endswith(f" {e}") for r in hits)
    ]


def check_fp8(
    view: ModelView,
    policy: Any,
    *,
    where: str,
    requested: str | None = None,
    compute: Mapping[str, torch.dtype] | None = None,
) -> Fp8Check:
    """The event's fp8 check (see the module docstring). ``requested``: who asked for fp8
    (``"Accelerator(mixed_precision='fp8')"``), ``None`` when nobody did; ``compute``: the
    dtype each fp8 module's activations ran in at the last forward the guard watched."""
    manifest = fp8.manifest(((p, m) for p, _, m in view.modules), compute)
    result = Fp8Check(manifest)
    if not manifest.modules and requested is None:
        return result
    out = keep_out(view, policy)
    result.unused = _unused(view, policy, {why for _, why in out.values()})
    refused = []
    for path, facts in list(manifest.modules.items()):
        if path not in out or facts.matmul is None:
            continue  # layerwise casting stores fp8 and computes high: no fp8 matmul
        mod, why = out[path]
        result.kept_out[path] = why
        torchao = facts.matmul.backend == "torchao" and type(mod).__name__ == "Float8Linear"
        if policy.mode == "fix" and torchao and _restore(view, path, mod) is not None:
            result.restored.append(path)
            del manifest.modules[path]
        elif policy.mode != "audit":
            refused.append(f"{path} ({why}: {facts.text()})")
    if refused:
        raise PrecisionError(
            f"{where}: {len(refused)} module(s) the policy keeps out of fp8 run fp8 matmuls and "
            f"cannot be brought back here: {'; '.join(refused[:3])}. Fix: convert with "
            "hf_precision.engine.fp8.converters.module_filter(model, policy) as the converter's "
            "filter, or drop them from keep_out_of_fp8 (docs/fp8.md)."
        )
    result.kept = len(out)
    return result


def _turned_off(requested: str, provenance: Mapping[str, Any] | None) -> tuple[str, str]:
    """(who decided the precision instead of fp8, the fix), from the provenance record."""
    resolved = str((provenance or {}).get("resolved") or "")
    if provenance and resolved and resolved != "fp8":
        line = str(provenance.get("line", "")).removeprefix("precision: ")
        return (
            f"fp8 was turned off: {provenance.get('chosen_by')} decided the precision ({line})",
            f"drop {resolved} where it was set ({provenance.get('chosen_by')}) so {requested} "
            "reaches accelerate, or convert with torchao's convert_to_float8_training",
        )
    return (
        "no component recorded choosing another precision: the converter converted nothing",
        "check the fp8 backend is installed and its filter converts something "
        "(hf_precision.engine.fp8.converters.module_filter(model, policy))",
    )


def _shares(view: ModelView, manifest: fp8.Manifest) -> dict[str, float]:
    """Per group with Linears: the share of them whose matmuls run fp8 (0: all kept out)."""
    linears: dict[str, int] = {}
    hits: dict[str, int] = {}
    for path, group, mod in view.modules:
        if isinstance(mod, nn.Linear):
            linears[group] = linears.get(group, 0) + 1
            facts = manifest.modules.get(path)
            if facts is not None and facts.matmul is not None:
                hits[group] = hits.get(group, 0) + 1
    return {g: hits.get(g, 0) / n for g, n in linears.items()}


def fp8_finding(
    result: Fp8Check,
    where: str,
    *,
    view: ModelView,
    requested: str | None = None,
    kept: int = 0,
    provenance: Mapping[str, Any] | None = None,
) -> Finding:
    """The event's fp8 :class:`~hf_precision.watch.finding.Finding` (``fp8``): the manifest,
    what was brought back, a ``keep_out_of_fp8`` entry that matched nothing, and fp8 requested
    with nothing converted (naming who turned it off, from the ``provenance`` record), in one
    line; a warning when any of the last three, else what runs (info). Its picture: per group,
    the share of its Linears whose matmuls run fp8."""
    man = result.manifest
    said = [f"hf-precision: {where}: fp8: " + ("; ".join(man.lines()) or "none")]
    if result.restored:
        more = len(result.restored) - 3
        said.append(
            f"{len(result.restored)} module(s) the policy keeps out of fp8 were converted to "
            f"Float8Linear and are back to nn.Linear (same parameters): "
            f"{', '.join(result.restored[:3])}{f' and {more} more' if more > 0 else ''}; "
            "keep_out_of_fp8 decides (docs/fp8.md)"
        )
    if result.unused:
        said.append(
            f"keep_out_of_fp8 entr{'y' if len(result.unused) == 1 else 'ies'} "
            f"{', '.join(map(repr, result.unused))} matched no module: the filter did nothing. "
            "Fix: use a group name, a word (embeddings, norms, routers, adapters, "
            "first_last_blocks) or a module path of this model"
        )
    if requested is not None and not man.modules:
        who, fix = _turned_off(requested, provenance)
        said.append(
            f"fp8 requested ({requested}) but 0 of {man.linears} Linears run fp8 ({kept} kept "
            f"out by the policy): {who}; the run computes in its autocast dtype. Fix: {fix}"
        )
    numbers = {**result.section(), "requested": requested}
    if provenance:
        numbers["chosen_by"] = provenance.get("chosen_by")
    return Finding(
        "fp8",
        "warning" if len(said) > 1 else "info",
        ". ".join(said) + ".",
        numbers=numbers,
        groups=_shares(view, man),
        measure="share of the group's Linears whose matmuls run fp8",
    )


def fp8_event(guard: Any, view: ModelView, policy: Any, where: str) -> ModelView:
    """A :class:`~hf_precision.engine.guard.PrecisionGuard` event's fp8 step: the check, the
    ``fp8`` section of every later event JSON, the finding (each new one once) and the fp8
    modules the guard watches at the next forward (``guard.ran``). A new view when the check
    brought a module back to ``nn.Linear``."""
    requested = guard.fp8_requested
    found = check_fp8(view, policy, where=where, requested=requested, compute=guard.ran.fp8_compute)
    names = found.manifest.modules
    guard.ran.fp8_modules = {p: m for p, _, m in view.modules if p in names}
    if names or requested or found.restored:
        guard.sections["fp8"] = found.section()
        finding = fp8_finding(
            found,
            where,
            view=view,
            requested=requested,
            kept=found.kept,
            provenance=guard.sections.get("provenance"),
        )
        if finding.message.split(": fp8: ", 1)[1] != guard.ran.fp8_said:  # each one once
            guard.ran.fp8_said = finding.message.split(": fp8: ", 1)[1]
            guard.emit(finding)
    if not found.restored:
        return view
    return ModelView.of(view.model, guard.groups, call=guard.call)


def feed_converters(accelerator: Any, models: list[nn.Module], policy: Any) -> bool:
    """Give accelerate's torchao recipe the policy's filter before ``prepare`` converts: the
    accelerator's ``ao_recipe_handler`` is replaced by a copy whose ``module_filter_func`` is
    :func:`module_filter` (the user's own filter must agree too); the user's object is not
    changed. ``False`` when the accelerator converts with another backend."""
    import dataclasses

    handler: Any = getattr(accelerator, "ao_recipe_handler", None)
    backend = str(getattr(accelerator, "fp8_backend", "")).rsplit(".", 1)[-1].upper()
    if (
        handler is None
        or backend != "AO"
        or not hasattr(handler, "__dataclass_fields__")
        or not models
    ):
        return False
    if getattr(handler.module_filter_func, "hf_precision_keep_out", None) is not None:
        return True  # fed already
    filters = [module_filter(m, policy) for m in models]
    base = handler.module_filter_func

    def convert(mod: nn.Module, fqn: str) -> bool:
        return all(f(mod, fqn) for f in filters) and (base is None or base(mod, fqn))

    kept = sum(getattr(f, "hf_precision_keep_out", 0) for f in filters)
    convert.hf_precision_keep_out = kept  # type: ignore[attr-defined]
    accelerator.ao_recipe_handler = dataclasses.replace(handler, module_filter_func=convert)
    return True
