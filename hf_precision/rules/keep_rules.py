"""What a model and the tools around it keep in float32 on purpose, read from the model.

transformers declares two lists on a model class (``PreTrainedModel``):

- ``_keep_in_fp32_modules_strict``: kept float32 by the loader for bf16 *and* fp16 loads (MoE
  router weights and ``e_score_correction_bias``, attention sinks, audio position tables). The
  guard keeps them float32 under every preset and mode (rule ``keep_fp32_strict``) and puts no
  leaf guard on the modules that hold them: a router computes in float32 on purpose.
- ``_keep_in_fp32_modules``: kept float32 by the loader for fp16 loads only (transformers >= 5,
  ``PreTrainedModel._get_dtype_plan``; 4.57 does the same). The guard never rounds such a
  tensor found in float32, under every preset (rule ``keep_fp32``: a BLIP-2 Q-Former loaded
  with ``dtype=torch.float16`` stays float32 under ``Trainer(bf16=True)``), keeps it float32
  where the policy would put it in float16, and lets the other rules decide a tensor found in
  bfloat16 (a bf16 load under a bf16 policy stays bf16). So the guard never rounds what the
  loader kept, and never upcasts what the loader left in bfloat16.

Patterns match as :func:`~.policy.precedence.match_pattern` does (exact name, path prefix,
whole path components: ``"gate.weight"`` selects ``model.layers.0.mlp.gate.weight``).
A composite model (a VLM holding a text and a vision model) declares them on its parts too;
transformers' ``post_init`` merges them into the top model's lists, which
:func:`model_keep_lists` reads (no walk of the model).

>>> from torch import nn
>>> m = nn.Module()
>>> m._keep_in_fp32_modules_strict = ["e_score_correction_bias"]
>>> model_keep_lists(m)
((), ('e_score_correction_bias',))
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .dtypes import dtype_name

__all__ = ["first_parameter_kept", "model_dtype_note", "model_keep_lists", "strict_modules"]

#: the rule of a tensor held in float32 by a model's ``_keep_in_fp32_modules_strict``
STRICT_RULE = "keep_fp32_strict"


def _declared(mod: nn.Module, attr: str) -> tuple[str, ...]:
    value = getattr(mod, attr, None)
    if not value or isinstance(value, str):
        return (value,) if isinstance(value, str) and value else ()
    return tuple(str(v) for v in value)


def model_keep_lists(root: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(non_strict, strict)``: the ``_keep_in_fp32_modules`` and
    ``_keep_in_fp32_modules_strict`` patterns ``root`` declares (sorted: transformers keeps
    them in sets)."""
    return (
        tuple(sorted(_declared(root, "_keep_in_fp32_modules"))),
        tuple(sorted(_declared(root, "_keep_in_fp32_modules_strict"))),
    )


def strict_modules(kept: Sequence[tuple[str, str, str, str]]) -> set[str]:
    """The module paths holding a tensor the plan kept by ``_keep_in_fp32_modules_strict``
    (``EnforceReport.kept`` rows): no leaf guard goes there."""
    return {name.rpartition(".")[0] for name, _, rule, _ in kept if rule == STRICT_RULE}


#: transformers models whose forward casts an input to ``self.dtype`` (the first floating
#: parameter), as ``pixel_values.to(self.dtype)``
DTYPE_CONSUMERS = "Idefics2/Idefics3/SmolVLM/InternVL (`pixel_values.to(self.dtype)`)"


def _floating(walk: list[tuple[str, str, nn.Module]]) -> Iterator[tuple[str, nn.Module, Any]]:
    for path, _, mod in walk:
        for key, p in mod._parameters.items():
            if p is not None and p.is_floating_point():
                yield (f"{path}.{key}" if path else key), mod, p


def first_parameter_kept(
    walk: list[tuple[str, str, nn.Module]], kept: Sequence[tuple[str, str, str, str]]
) -> tuple[str, str, nn.Module, tuple[str, torch.Tensor] | None] | None:
    """``(name, rule, module, next)`` when a keep rule holds the model's first floating
    parameter (what ``model.dtype`` reads) in float32: its module, and ``(name, tensor)`` of the
    first weight of the next module (the layer its output feeds), or ``None``."""
    params = _floating(walk)
    first = next(params, None)
    if first is None:
        return None
    rule = next((r for name, _, r, _ in kept if name == first[0]), None)
    if rule is None:
        return None
    # the first weight of the next module: the layer its output feeds (a whole tower kept in
    # fp32, as an audio tower on a strict list, feeds fp32 layers: nothing to bridge there)
    after = next(((n, p) for n, mod, p in params if mod is not first[1]), None)
    return first[0], rule, first[1], after


def model_dtype_note(
    root: nn.Module,
    walk: list[tuple[str, str, nn.Module]],
    kept: Sequence[tuple[str, str, str, str]],
    half: torch.dtype | None,
) -> str | None:
    """What to say when a keep rule holds the model's first floating parameter in float32 while
    the policy puts the rest in ``half``: ``model.dtype`` (transformers reads the first floating
    parameter) then says float32, and code that casts its inputs to it feeds float32 into the
    half layers after that parameter. The guard bridges it (:func:`first_parameter_kept`: the
    module holding it hands its outputs over in the dtype of the next half weight); the message
    names the parameter, the rule and the consumers. ``walk`` is the event's
    :class:`~hf_precision.model.view.ModelView` modules, in ``named_parameters`` order."""
    if half is None or not half.is_floating_point or half.itemsize >= 4:
        return None
    found = first_parameter_kept(walk, kept)
    if found is None:
        return None
    after = found[3]
    kept_names = {name for name, _, _, _ in kept}
    first, rule, bridged = found[0], found[1], after is not None and after[0] not in kept_names
    how = (
        f"the guard hands its outputs on in {dtype_name(half)}, so the {dtype_name(half)} layers "
        "after it get their own dtype"
        if bridged
        else "the layers after it are kept in float32 too; the guards bridge at the group "
        "boundaries"
    )
    return (
        f"{type(root).__name__}.dtype reads float32: its first floating parameter {first} is "
        f"kept in float32 (rule {rule}) while the other weights are {dtype_name(half)}. Code "
        f"that casts inputs to model.dtype ({DTYPE_CONSUMERS}) feeds float32 to it; {how}. "
        "Fix, to silence this: keep a parameter other than the first in float32."
    )
