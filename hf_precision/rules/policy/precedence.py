"""Which dtype a policy wants for one tensor, and the rule that decided: the precedence the
policy's :meth:`~hf_precision.PrecisionPolicy.decide` applies, the keep-fp32
patterns (:func:`match_pattern`) and the rule names reports print (:data:`Rule`).

Precedence for one parameter (first that applies):

1. rotary tables (any ``*inv_freq*`` buffer, every floating buffer of a rotary-embedding
   module: :func:`tensor_role`) -> float32 (rule ``rotary``); ``keep_fp32`` patterns -> float32
   (rule ``keep_fp32``); the model's ``_keep_in_fp32_modules_strict`` -> float32 under every
   preset (rule ``keep_fp32_strict``, :mod:`hf_precision.rules.keep_rules`); the model's
   ``_keep_in_fp32_modules`` -> float32 where the rules below would give float16 (rule
   ``keep_fp32``: transformers' loader keeps them for fp16 loads only) and, under every preset,
   where the tensor is found in float32 (never rounded); one found in bfloat16 follows the rules
   below (never upcast for the list's sake);
2. a 0-D floating parameter or buffer (a LoRA ``alpha``, a scale, a temperature, CLIP's
   ``logit_scale``: :func:`tensor_role` ``"scalar"``) keeps its dtype under every preset (rule
   ``scalar``): the model computed with it as it is, and a trainer saves it as it is (kohya's
   LoRA computes its scale from ``alpha`` once, in float32; rounding the saved ``alpha`` to
   bf16 would make the file disagree with the run). A trainable half scalar under a policy
   with float32 trainable weights still becomes float32 (the optimizer and the GradScaler need
   it; the value is unchanged). Said in ``kept`` only where a later rule would have cast it;
3. trainable parameter in the half dtype of a DeepSpeed ZeRO-3 run (the engine, its
   ``TrainingArguments``/accelerate config) -> left in that dtype (rule ``wrapper_master_fp32``:
   DeepSpeed keeps fp32 master copies in its optimizer, and TRL passes PEFT
   ``autocast_adapter_dtype=False`` under ZeRO-3 because fp32 adapters beside bf16 weights in one
   all-gather bucket raised ``TypeError: output tensor must have the same type as input tensor``);
   else float32 if it is float32 and ``keep_trainable_fp32`` (set when the policy is inferred
   with no precision flag), else ``trainable_dtype`` (fp32 under mixed presets: the optimizer and
   the fp16 GradScaler need fp32 weights and gradients);
4. its group has an override in ``group_dtypes`` -> that dtype;
5. a frozen fp32 weight of a normalization layer (recognised by module type) whose group's
   other weights are in a half dtype -> stays float32 (rule ``deliberate_fp32``: LLaMA-Factory's
   ``upcast_layernorm``, PEFT's ``prepare_model_for_kbit_training``, axolotl's norm upcasts
   chose it); ``keep_fp32_norms=False`` or naming the group in ``group_dtypes`` casts it; so does
   an fp32 ``lm_head`` when ``keep_fp32_head`` is set (TRL's ``cast_lm_head_to_fp32``, read from
   the trainer's arguments);
6. otherwise -> ``frozen_dtype``.

>>> from hf_precision.rules.policy.precision_policy import PrecisionPolicy
>>> decide(PrecisionPolicy.from_preset("bf16"), "model.rotary_emb.inv_freq", "language_model",
...        trainable=False, is_buffer=True).rule
'rotary'
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ..dtypes import dtype_name
from ..roles import Role

__all__ = [
    "DEFAULT_KEEP_FP32_BUFFERS",
    "KEEP_RULES",
    "KEPT_RULES",
    "Decision",
    "PolicyFields",
    "Rule",
    "decide",
    "keep_fp32_reason",
    "match_pattern",
]

#: Which precedence rule decided a tensor's dtype (see :class:`Decision`).
Rule = Literal[
    "rotary",
    "keep_fp32",
    "keep_fp32_strict",
    "scalar",
    "wrapper_master_fp32",
    "keep_trainable_fp32",
    "trainable",
    "group_dtypes",
    "deliberate_fp32",
    "frozen",
]
#: The rules that keep a tensor in float32 whatever the preset (:attr:`Decision.keeps_fp32`).
KEEP_RULES: tuple[Rule, ...] = ("rotary", "keep_fp32", "keep_fp32_strict", "deliberate_fp32")
#: The rules that keep a tensor in the dtype it has on purpose, said in ``EnforceReport.kept``:
#: the keep-fp32 rules, 0-D scalars (``scalar``) and a wrapper's half-precision trainable
#: weights (``wrapper_master_fp32``).
KEPT_RULES: tuple[Rule, ...] = (*KEEP_RULES, "scalar", "wrapper_master_fp32")
_STRICT = "model._keep_in_fp32_modules_strict"


@dataclass(frozen=True, slots=True)
class Decision:
    """The dtype the policy wants for one tensor, the rule that decided (:data:`Rule`) and the
    reason in words (the pattern or group that matched), as reports print it."""

    dtype: torch.dtype
    rule: Rule
    reason: str

    @property
    def keeps_fp32(self) -> bool:
        """A keep-in-fp32 pattern, the model's ``_keep_in_fp32_modules``, a rotary table or a
        deliberate fp32 norm decided: the tensor must stay float32 whatever the wrapper or the
        preset."""
        return self.rule in KEEP_RULES

    @property
    def kept(self) -> bool:
        """A rule kept the tensor's dtype on purpose (:data:`KEPT_RULES`): reported as kept."""
        return self.rule in KEPT_RULES


#: Buffers that always stay fp32 by name (rotary frequencies lose positions when rounded): any
#: ``*inv_freq*`` (``inv_freq``, ``original_inv_freq``, Gemma 3's per-layer-type
#: ``sliding_attention_inv_freq`` ...). Buffers of rotary modules are found by type too
#: (:func:`tensor_role`).
DEFAULT_KEEP_FP32_BUFFERS: tuple[str, ...] = ("re:(.*\\.)?[^.]*inv_freq[^.]*",)


def _is_head(name: str) -> bool:
    """``name`` is a weight of the language model's output head (``lm_head``, as TRL's
    ``cast_lm_head_to_fp32`` names it)."""
    return "lm_head" in name.split(".")


class PolicyFields(Protocol):
    """The fields of a :class:`~hf_precision.PrecisionPolicy` the precedence reads
    (the policy module imports this one, not the other way round)."""

    @property
    def frozen_dtype(self) -> torch.dtype | None: ...
    @property
    def trainable_dtype(self) -> torch.dtype | None: ...
    @property
    def group_dtypes(self) -> dict[str, torch.dtype]: ...
    @property
    def keep_fp32(self) -> tuple[str, ...]: ...
    @property
    def keep_trainable_fp32(self) -> bool: ...
    @property
    def honour_model_keep_fp32(self) -> bool: ...
    @property
    def keep_fp32_norms(self) -> bool: ...
    @property
    def keep_fp32_head(self) -> bool: ...


def match_pattern(pattern: str, name: str) -> bool:
    """Does a keep-fp32 pattern select ``name`` (a parameter, buffer or module path)?

    Precedence is fixed: ``re:<regex>`` must match the whole name or a whole module path that
    holds it (``re.fullmatch``, as PEFT matches a ``target_modules`` string: ``re:.*norm``
    selects ``model.norm.weight`` but not ``layernorm_proj.weight``); otherwise the pattern
    matches the exact name, a module path prefix (``model.vision_tower`` selects everything
    under it), or one whole path component (transformers' ``_keep_in_fp32_modules`` style,
    ``"wo"`` selects ``encoder.block.0.layer.1.DenseReluDense.wo.weight``).

    >>> match_pattern("re:.*norm", "model.norm.weight"), match_pattern("re:norm", "a.norm.weight")
    (True, False)
    """
    if pattern.startswith("re:"):
        regex = re.compile(pattern[3:])
        parts = name.split(".")
        return any(regex.fullmatch(".".join(parts[:i])) for i in range(len(parts), 0, -1))
    if name == pattern or name.startswith(pattern + "."):
        return True
    return ("." + pattern + ".") in ("." + name + ".")


def keep_fp32_reason(
    policy: PolicyFields,
    name: str,
    *,
    is_buffer: bool,
    model_patterns: Iterable[str] = (),
    role: Role | None = None,
    strict_patterns: Iterable[str] = (),
) -> str | None:
    """Why ``name`` must stay fp32 whatever its group (a rotary table, a ``keep_fp32``
    pattern, the model's ``_keep_in_fp32_modules_strict`` (``strict_patterns``) or
    ``_keep_in_fp32_modules`` (``model_patterns``; :func:`decide` holds those in fp32 where
    the weight would be fp16 or is found in fp32)), or ``None``. ``role`` is
    :func:`tensor_role`'s answer where the caller knows the module."""
    if is_buffer:
        for pat in DEFAULT_KEEP_FP32_BUFFERS:
            if match_pattern(pat, name):
                return "rotary inv_freq buffer"
        if role == "rotary":
            return "rotary table (buffer of a rotary-embedding module)"
    for pat in policy.keep_fp32:
        if match_pattern(pat, name):
            return f"keep_fp32 {pat!r}"
    if policy.honour_model_keep_fp32:
        for pat in strict_patterns:
            if match_pattern(pat, name):
                return f"{_STRICT} {pat!r}"
        for pat in model_patterns:
            if match_pattern(pat, name):
                return f"model._keep_in_fp32_modules {pat!r}"
    return None


def decide(
    policy: PolicyFields,
    name: str,
    group: str,
    *,
    trainable: bool,
    is_buffer: bool = False,
    model_patterns: Iterable[str] = (),
    current: torch.dtype | None = None,
    role: Role | None = None,
    group_dtype: torch.dtype | None = None,
    master_fp32: torch.dtype | None = None,
    strict_patterns: Iterable[str] = (),
) -> Decision:
    """The dtype the policy wants for one parameter/buffer (now in ``current``) and the
    rule that decided (the precedence of this module's docstring). ``role`` is what the
    tensor is (:func:`tensor_role`), ``group_dtype`` the dtype the other weights of its
    group are in (the plan's first pass): together they tell a deliberate fp32 norm from
    one left in fp32 with its whole group. ``strict_patterns`` and ``model_patterns`` are
    the model's ``_keep_in_fp32_modules_strict`` and ``_keep_in_fp32_modules``
    (:func:`hf_precision.rules.keep_rules.model_keep_lists`). ``master_fp32`` is the half dtype of
    a DeepSpeed ZeRO-3 run, which keeps fp32 master copies of trainable weights held in it."""
    reason = keep_fp32_reason(
        policy, name, is_buffer=is_buffer, role=role, strict_patterns=strict_patterns
    )
    if reason is not None:
        rule: Rule = (
            "rotary"
            if reason.startswith("rotary")
            else "keep_fp32_strict"
            if reason.startswith(_STRICT)
            else "keep_fp32"
        )
        return Decision(torch.float32, rule, reason)
    if role == "scalar" and current is not None:
        scalar = _scalar(policy, name, group, trainable, current)
        if scalar is not None:
            return scalar
    if trainable and master_fp32 is not None and policy.trainable_dtype not in (None, master_fp32):
        how = "left as is" if current == master_fp32 else "joins the others"
        return Decision(
            master_fp32,
            "wrapper_master_fp32",
            f"trainable {dtype_name(master_fp32)} under DeepSpeed ZeRO-3, which keeps fp32 "
            f"master copies and flattens every trainable partition into one "
            f"{dtype_name(master_fp32)} buffer: {how} (TRL's autocast_adapter_dtype=False)",
        )
    decision = _decide_unkept(policy, name, group, trainable, current, role, group_dtype)
    return _model_kept(policy, name, current, decision, model_patterns) or decision


def _model_kept(
    policy: PolicyFields,
    name: str,
    current: torch.dtype | None,
    decision: Decision,
    model_patterns: Iterable[str],
) -> Decision | None:
    """The model's ``_keep_in_fp32_modules`` against the other rules' ``decision``: float32
    where that would be float16 (the loader keeps them for fp16 loads), and float32 when found
    in float32 (never rounded, under every preset); one found in bfloat16 follows the rules."""
    if decision.dtype == torch.float32 or not policy.honour_model_keep_fp32:
        return None
    fp16, found_fp32 = decision.dtype == torch.float16, current == torch.float32
    if not (fp16 or found_fp32):
        return None
    for pat in model_patterns:
        if match_pattern(pat, name):
            why = "fp32 where fp16 would be" if fp16 else "found in float32: kept, never rounded"
            return Decision(
                torch.float32, "keep_fp32", f"model._keep_in_fp32_modules {pat!r} ({why})"
            )
    return None


def _scalar(
    policy: PolicyFields, name: str, group: str, trainable: bool, current: torch.dtype
) -> Decision | None:
    """Rule 2: a 0-D scalar keeps ``current``; ``None`` where the later rules give ``current``
    anyway (nothing to say), or raise a trainable half scalar to the float32 trainable dtype."""
    later = _decide_unkept(policy, name, group, trainable, current, None, None)
    if later.dtype == current:
        return None
    if trainable and later.rule == "trainable" and later.dtype.itemsize > current.itemsize:
        return later
    return Decision(
        current,
        "scalar",
        f"0-D scalar kept in {dtype_name(current)} (what the model computes with and what "
        f"a trainer saves; {dtype_name(later.dtype)} would round it)",
    )


def _decide_unkept(
    policy: PolicyFields,
    name: str,
    group: str,
    trainable: bool,
    current: torch.dtype | None,
    role: Role | None,
    group_dtype: torch.dtype | None,
) -> Decision:
    """:func:`decide`'s rules 2 to 5 (no keep pattern selected ``name``)."""
    if trainable and policy.keep_trainable_fp32 and current == torch.float32:
        return Decision(torch.float32, "keep_trainable_fp32", "keep_trainable_fp32")
    half_group = (
        group_dtype is not None and group_dtype.is_floating_point and group_dtype.itemsize < 4
    )
    if policy.keep_fp32_head and current == torch.float32 and _is_head(name):
        return Decision(
            torch.float32,
            "deliberate_fp32",
            "fp32 lm_head kept as chosen (TRL's cast_lm_head_to_fp32=True); "
            "cast_lm_head_to_fp32=False casts it",
        )
    if trainable and policy.trainable_dtype is not None:
        return Decision(policy.trainable_dtype, "trainable", "trainable")
    if group in policy.group_dtypes:
        return Decision(policy.group_dtypes[group], "group_dtypes", f"group_dtypes[{group!r}]")
    if role == "norm" and policy.keep_fp32_norms and current == torch.float32 and half_group:
        assert group_dtype is not None
        return Decision(
            torch.float32,
            "deliberate_fp32",
            f"fp32 norm weight in a {dtype_name(group_dtype)} group: kept as chosen "
            "(upcast_layernorm / prepare_model_for_kbit_training); keep_fp32_norms=False "
            "casts it",
        )
    return Decision(policy.frozen_dtype, "frozen", "frozen")  # type: ignore[arg-type]
