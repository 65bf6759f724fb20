"""What a model and the tools around it keep in float32 on purpose, read from the model.

transformers declares two lists on a model class (``PreTrainedModel``):

- ``_keep_in_fp32_modules_strict``: kept float32 by the loader for bf16 *and* fp16 loads (MoE
  router weights and ``e_score_correction_bias``, attention sinks, audio position tables). The
  guard keeps them float32 under every preset and mode (rule ``keep_fp32_strict``) and puts no
  leaf guard on the modules that hold them: a router computes in float32 on purpose.
- ``_keep_in_fp32_modules``: kept float32 by the loader for fp16 loads only (transformers >= 5,
  ``PreTrainedModel._get_dtype_plan``; 4.57 does the same). The guard follows the loader: such a
  tensor stays float32 where the policy would otherwise put it in float16 (rule ``keep_fp32``),
  and follows the other rules where it would be bfloat16. So the guard never rounds what the
  loader kept, and never upcasts what the loader left in bfloat16.

Patterns match as :func:`~hf_precision.policy.match_pattern` does (exact name, path prefix,
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

from torch import nn

__all__ = ["model_keep_lists", "strict_modules"]

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


def strict_modules(kept: list[tuple[str, str, str, str]]) -> set[str]:
    """The module paths holding a tensor the plan kept by ``_keep_in_fp32_modules_strict``
    (``EnforceReport.kept`` rows): no leaf guard goes there."""
    return {name.rpartition(".")[0] for name, _, rule, _ in kept if rule == STRICT_RULE}
