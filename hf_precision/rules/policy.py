"""The precision policy: one object that says which dtype every part of the model is in.

>>> from hf_precision import PrecisionPolicy
>>> policy = PrecisionPolicy.from_preset("bf16", group_dtypes={"vision_encoder": "fp32"})
>>> policy.compute_dtype, policy.trainable_dtype
(torch.bfloat16, torch.float32)
>>> PrecisionPolicy.from_json(policy.to_json()) == policy
True

Precedence for one parameter (first that applies):

1. rotary tables (any ``*inv_freq*`` buffer, every floating buffer of a rotary-embedding
   module: :func:`tensor_role`) -> float32 (rule ``rotary``); ``keep_fp32`` patterns -> float32
   (rule ``keep_fp32``); the model's ``_keep_in_fp32_modules_strict`` -> float32 under every
   preset (rule ``keep_fp32_strict``, :mod:`hf_precision.rules.keep_rules`); the model's
   ``_keep_in_fp32_modules`` -> float32 where the rules below would give float16 (rule
   ``keep_fp32``: transformers' loader keeps them for fp16 loads only);
2. trainable parameter in the half dtype of a DeepSpeed ZeRO-3 run (the engine, its
   ``TrainingArguments``/accelerate config) -> left in that dtype (rule ``wrapper_master_fp32``:
   DeepSpeed keeps fp32 master copies in its optimizer, and TRL passes PEFT
   ``autocast_adapter_dtype=False`` under ZeRO-3 because fp32 adapters beside bf16 weights in one
   all-gather bucket raised ``TypeError: output tensor must have the same type as input tensor``);
   else float32 if it is float32 and ``keep_trainable_fp32`` (set when the policy is inferred
   with no precision flag), else ``trainable_dtype`` (fp32 under mixed presets: the optimizer and
   the fp16 GradScaler need fp32 weights and gradients);
3. its group has an override in ``group_dtypes`` -> that dtype;
4. a frozen fp32 weight of a normalization layer (recognised by module type) whose group's
   other weights are in a half dtype -> stays float32 (rule ``deliberate_fp32``: LLaMA-Factory's
   ``upcast_layernorm``, PEFT's ``prepare_model_for_kbit_training``, axolotl's norm upcasts
   chose it); ``keep_fp32_norms=False`` or naming the group in ``group_dtypes`` casts it; so does
   an fp32 ``lm_head`` when ``keep_fp32_head`` is set (TRL's ``cast_lm_head_to_fp32``, read from
   the trainer's arguments);
5. otherwise -> ``frozen_dtype``.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

from ..base.names import PRESET_MISNAMES
from ..errors import PrecisionError, did_you_mean
from . import inference, policy_json
from .dtypes import dtype_name, parse_dtype
from .groups import group_names
from .inference import infer_preset, loaded_dtype
from .policy_json import POLICY_VERSION, as_kwargs, reject_unknown_fields
from .presets import PRESET_DEFAULTS, PRESET_HELP, PRESETS, preset_name
from .roles import Role, is_norm_module, is_rotary_module, tensor_role

#: Names that moved to their own modules, still importable from here.
__all__ = [
    "DEFAULT_KEEP_FP32_BUFFERS",
    "DEFAULT_KEY_GROUPS",
    "DEFAULT_SKIP_KEYS",
    "KEEP_RULES",
    "KEPT_RULES",
    "LEAF_GUARDS",
    "MODES",
    "POLICY_VERSION",
    "PRESETS",
    "PRESET_DEFAULTS",
    "PRESET_HELP",
    "Decision",
    "LeafGuards",
    "Mode",
    "PrecisionPolicy",
    "Role",
    "Rule",
    "infer_preset",
    "is_norm_module",
    "is_rotary_module",
    "loaded_dtype",
    "match_pattern",
    "policy_call",
    "preset_name",
    "register_preset",
    "tensor_role",
]

#: What an event does with drift: report it, fix it, or raise.
Mode = Literal["audit", "fix", "raise"]
MODES: tuple[Mode, ...] = get_args(Mode)
LeafGuards = Literal["auto", "on", "off"]
LEAF_GUARDS: tuple[LeafGuards, ...] = get_args(LeafGuards)
#: Which precedence rule decided a tensor's dtype (see :class:`Decision`).
Rule = Literal[
    "rotary",
    "keep_fp32",
    "keep_fp32_strict",
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
#: the keep-fp32 rules and a wrapper's half-precision trainable weights (``wrapper_master_fp32``).
KEPT_RULES: tuple[Rule, ...] = (*KEEP_RULES, "wrapper_master_fp32")
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


#: Batch keys never cast (targets are compared, not computed with).
DEFAULT_SKIP_KEYS: tuple[str, ...] = (
    "labels",
    "label",
    "label_ids",
    "targets",
    "target",
    # made by the model itself and handed back by generate(): not batch data
    "mm_encoder_outputs",
    "encoder_outputs",
    "past_key_values",
)
#: Batch keys that follow a group's dtype rather than the compute dtype.
DEFAULT_KEY_GROUPS: dict[str, str] = {
    "pixel_values": "vision_encoder",
    "pixel_values_videos": "vision_encoder",
    "images": "vision_encoder",
    "image": "vision_encoder",
}


def _parse_mapping(value: Mapping[str, Any] | None, *, call: str) -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    known = group_names()
    for group, dt in (value or {}).items():
        if group not in known:
            hint = did_you_mean(group, known)
            raise PrecisionError(
                f"{call}: unknown group {group!r}.{hint}\nAllowed: {', '.join(known)}.\n"
                "Fix: use one of these, or hf_precision.rules.groups.register_group(name) first."
            )
        out[group] = parse_dtype(dt, call=f"{call}[{group!r}]")
    return out


def _choice(value: str, allowed: Iterable[str], *, call: str, what: str) -> str:
    allowed = tuple(allowed)
    if value in allowed:
        return value
    hint = did_you_mean(value, allowed)
    raise PrecisionError(
        f"{call}: unknown {what} {value!r}.{hint}\nAllowed: {', '.join(allowed)}.\n"
        f"Fix: pass one of these."
    )


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


def _keep_fp32_reason(
    self: PrecisionPolicy,
    name: str,
    *,
    is_buffer: bool,
    model_patterns: Iterable[str] = (),
    role: Role | None = None,
    strict_patterns: Iterable[str] = (),
) -> str | None:
    """Why ``name`` must stay fp32 whatever its group (a rotary table, a ``keep_fp32``
    pattern, the model's ``_keep_in_fp32_modules_strict`` (``strict_patterns``) or
    ``_keep_in_fp32_modules`` (``model_patterns``; :meth:`decide` holds those in fp32 only
    where the weight would be fp16)), or ``None``. ``role`` is :func:`tensor_role`'s answer
    where the caller knows the module."""
    if is_buffer:
        for pat in DEFAULT_KEEP_FP32_BUFFERS:
            if match_pattern(pat, name):
                return "rotary inv_freq buffer"
        if role == "rotary":
            return "rotary table (buffer of a rotary-embedding module)"
    for pat in self.keep_fp32:
        if match_pattern(pat, name):
            return f"keep_fp32 {pat!r}"
    if self.honour_model_keep_fp32:
        for pat in strict_patterns:
            if match_pattern(pat, name):
                return f"{_STRICT} {pat!r}"
        for pat in model_patterns:
            if match_pattern(pat, name):
                return f"model._keep_in_fp32_modules {pat!r}"
    return None


def _decide(
    self: PrecisionPolicy,
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
    rule that decided (the precedence at the top of this module). ``role`` is what the
    tensor is (:func:`tensor_role`), ``group_dtype`` the dtype the other weights of its
    group are in (the plan's first pass): together they tell a deliberate fp32 norm from
    one left in fp32 with its whole group. ``strict_patterns`` and ``model_patterns`` are
    the model's ``_keep_in_fp32_modules_strict`` and ``_keep_in_fp32_modules``
    (:func:`hf_precision.rules.keep_rules.model_keep_lists`). ``master_fp32`` is the half dtype of
    a DeepSpeed ZeRO-3 run, which keeps fp32 master copies of trainable weights held in it."""
    reason = self.keep_fp32_reason(
        name, is_buffer=is_buffer, role=role, strict_patterns=strict_patterns
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
    if trainable and master_fp32 is not None and self.trainable_dtype not in (None, master_fp32):
        how = "left as is" if current == master_fp32 else "joins the others"
        return Decision(
            master_fp32,
            "wrapper_master_fp32",
            f"trainable {dtype_name(master_fp32)} under DeepSpeed ZeRO-3, which keeps fp32 "
            f"master copies and flattens every trainable partition into one "
            f"{dtype_name(master_fp32)} buffer: {how} (TRL's autocast_adapter_dtype=False)",
        )
    decision = _decide_unkept(self, name, group, trainable, current, role, group_dtype)
    if decision.dtype == torch.float16 and self.honour_model_keep_fp32:
        for pat in model_patterns:  # the loader keeps them fp32 for fp16 loads
            if match_pattern(pat, name):
                why = f"model._keep_in_fp32_modules {pat!r} (fp32 where fp16 would be)"
                return Decision(torch.float32, "keep_fp32", why)
    return decision


@dataclass(frozen=True)
class PrecisionPolicy:
    """One precision policy for the whole model, its batches and its eval/generate paths.

    Build one from a preset (:meth:`from_preset`), from ``TrainingArguments``
    (:meth:`from_training_args`) or an ``Accelerator`` (:meth:`from_accelerator`). A policy is a
    value: it cannot be changed in place; :meth:`replace` returns a new one.

    >>> p = PrecisionPolicy.from_preset("bf16")
    >>> q = p.replace(mode="audit")
    >>> p.mode, q.mode
    ('fix', 'audit')
    """

    compute_dtype: torch.dtype = field(
        default=torch.bfloat16, metadata={"help": "dtype activations and batches run in"}
    )
    frozen_dtype: torch.dtype | None = field(
        default=None, metadata={"help": "dtype of frozen weights (None: compute_dtype)"}
    )
    trainable_dtype: torch.dtype | None = field(
        default=torch.float32,
        metadata={"help": "dtype of trainable weights (None: same as frozen weights)"},
    )
    group_dtypes: dict[str, torch.dtype] = field(
        default_factory=dict, metadata={"help": "per-group override of the frozen dtype"}
    )
    keep_fp32: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "patterns (exact, path prefix, component, 're:' regex) "
            "of parameters/buffers that stay fp32"
        },
    )
    keep_trainable_fp32: bool = field(
        default=False,
        metadata={
            "help": "trainable weights loaded in fp32 stay fp32 (set by "
            "inference when no precision flag is given)"
        },
    )
    honour_model_keep_fp32: bool = field(
        default=True,
        metadata={
            "help": "keep model._keep_in_fp32_modules_strict in fp32, and "
            "model._keep_in_fp32_modules where the weight would be fp16 (as transformers loads)"
        },
    )
    keep_fp32_norms: bool = field(
        default=True,
        metadata={
            "help": "frozen fp32 norm weights in a group whose other weights are half stay "
            "fp32 (upcast_layernorm, prepare_model_for_kbit_training); False casts them"
        },
    )
    keep_fp32_head: bool = field(
        default=False,
        metadata={
            "help": "an fp32 lm_head beside half weights stays fp32 (TRL's "
            "cast_lm_head_to_fp32; set from the trainer's arguments)"
        },
    )
    mode: Mode = field(default="fix", metadata={"help": "audit | fix | raise"})
    move_devices: bool = field(
        default=True, metadata={"help": "move groups/inputs to the receiving module's device"}
    )
    leaf_guards: LeafGuards = field(
        default="auto", metadata={"help": "auto (in groups that mix dtypes) | on | off"}
    )
    boundary_guards: bool = field(default=True, metadata={"help": "hooks at group entries"})
    cast_batch: bool = field(default=True, metadata={"help": "cast floating batch tensors"})
    batch_skip_keys: tuple[str, ...] = field(
        default=DEFAULT_SKIP_KEYS, metadata={"help": "batch keys never cast"}
    )
    batch_key_groups: dict[str, str] = field(
        default_factory=lambda: dict(DEFAULT_KEY_GROUPS),
        metadata={"help": "batch key -> group whose dtype it follows"},
    )
    full_eval_dtype: torch.dtype | None = field(
        default=None, metadata={"help": "dtype Trainer's *_full_eval casts the model to"}
    )
    name: str | None = field(default=None, metadata={"help": "preset this policy came from"})

    def __post_init__(self) -> None:
        _normalise(self)

    __hash__ = None  # type: ignore[assignment]  # dict fields: equal by value, not hashable

    def replace(self, **changes: Any) -> PrecisionPolicy:
        """A new policy with ``changes`` applied (this one is unchanged)."""
        reject_unknown_fields(
            changes, _FIELDS, lambda bad: f"PrecisionPolicy.replace({as_kwargs(bad)})"
        )
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> PrecisionPolicy:
        """A named preset, optionally with field overrides.

        Presets: ``bf16``, ``bf16-true``, ``fp16``, ``fp16-true``, ``fp32``
        (see :data:`PRESET_HELP`), and those :func:`register_preset` adds. Names are exact:
        what other tools call them (``bfloat16``, ``bf16-mixed``, ``BF16``) is refused with
        the preset meant (:func:`preset_name`).
        """
        key = preset_name(name)
        compute, frozen, trainable = PRESETS[key]
        reject_unknown_fields(
            overrides,
            _FIELDS,
            lambda bad: f"PrecisionPolicy.from_preset({name!r}, {as_kwargs(bad)})",
        )
        kwargs: dict[str, Any] = dict(
            compute_dtype=compute, frozen_dtype=frozen, trainable_dtype=trainable, name=key
        )
        kwargs.update(copy.deepcopy(PRESET_DEFAULTS.get(key, {})))
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def resolve(
        cls, value: PrecisionPolicy | str | Mapping[str, Any] | None, model: nn.Module | None = None
    ) -> PrecisionPolicy:
        """Accept a policy, a preset name, a dict (JSON form) or ``None`` (infer from model)."""
        if isinstance(value, PrecisionPolicy):
            return value
        if isinstance(value, str):
            return cls.from_preset(value)
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if value is None:
            return cls.from_model(model) if model is not None else cls.from_preset("fp32")
        raise PrecisionError(
            f"PrecisionPolicy.resolve({value!r}): expected a PrecisionPolicy, a preset name "
            f"({', '.join(PRESETS)}), a dict or None."
        )

    @classmethod
    def from_model(cls, model: nn.Module, **overrides: Any) -> PrecisionPolicy:
        """No mixed-precision flag: keep what the model was loaded in.

        Frozen weights follow the dtype the language model was loaded in (:func:`loaded_dtype`:
        ``bf16-true``, ``fp16-true`` or ``fp32``), however many parameters the vision tower
        has. Trainable weights stay in the dtype they were loaded in: fp32 ones stay fp32
        (``keep_trainable_fp32``: PEFT's adapters, a projector trained in fp32; half-precision
        trainable weights lose updates below their resolution, and fp16 cannot even hold
        AdamW's ``eps``), bf16 ones stay bf16 (``trainable_dtype`` is set to it when the
        preset's differs), fp16 ones stay fp16 in an fp16 model (``fp16-true``) and follow the
        preset elsewhere (fp16 cannot hold AdamW's ``eps``: without a GradScaler the update
        divides by zero). Only a named ``*-true`` preset or an explicit ``trainable_dtype``
        lowers an fp32 trainable weight.

        >>> from hf_precision.tiny import tiny_llava
        >>> model = tiny_llava().to(torch.bfloat16)
        >>> _ = model.model.multi_modal_projector.float()       # trained in fp32
        >>> policy = PrecisionPolicy.from_model(model)
        >>> policy.name, policy.keep_trainable_fp32
        ('bf16-true', True)
        >>> policy.target_dtype("model.multi_modal_projector.linear_1.weight", "projector",
        ...                     trainable=True, current=torch.float32)
        (torch.float32, 'keep_trainable_fp32')
        """
        preset, inferred = inference.model_preset(model)
        return cls.from_preset(preset, **{**inferred, **overrides})

    @classmethod
    def from_training_args(
        cls, args: Any, model: nn.Module | None = None, **overrides: Any
    ) -> PrecisionPolicy:
        """Infer from ``TrainingArguments``: ``bf16=True`` -> ``bf16`` (frozen bf16, trainable
        fp32); ``fp16=True`` -> ``fp16`` (frozen fp16, trainable fp32); no flag ->
        :meth:`from_model` (frozen weights in the dtype the language model was loaded in,
        trainable weights kept in the dtype they were loaded in)."""
        preset = inference.training_args_preset(args)
        policy = cls._from_flag(preset, model, overrides)
        eval_dtype = inference.full_eval_dtype(args)
        return policy if eval_dtype is None else policy.replace(full_eval_dtype=eval_dtype)

    @classmethod
    def from_accelerator(
        cls, accelerator: Any, model: nn.Module | None = None, **overrides: Any
    ) -> PrecisionPolicy:
        """Infer from ``accelerator.mixed_precision`` (``bf16``, ``fp16``, ``no``, ``fp8``);
        ``no`` -> :meth:`from_model`, the same no-flag rule as :meth:`from_training_args`."""
        return cls._from_flag(inference.accelerator_preset(accelerator), model, overrides)

    @classmethod
    def _from_flag(
        cls, preset: str | None, model: nn.Module | None, overrides: dict[str, Any]
    ) -> PrecisionPolicy:
        """The preset a flag named, else :meth:`from_model` (else ``fp32`` with no model)."""
        if preset is not None:
            return cls.from_preset(preset, **overrides)
        if model is not None:
            return cls.from_model(model, **overrides)
        return cls.from_preset("fp32", **overrides)

    # ---------------------------------------------------------------- queries

    @property
    def is_mixed(self) -> bool:
        """Trainable weights are kept in another dtype than frozen ones."""
        return self.trainable_dtype is not None and self.trainable_dtype != self.frozen_dtype

    def group_dtype(self, group: str) -> torch.dtype:
        """dtype of the frozen weights of ``group``."""
        return self.group_dtypes.get(group, self.frozen_dtype)  # type: ignore[return-value]

    #: Why ``name`` must stay fp32 whatever its group (:func:`_keep_fp32_reason`).
    keep_fp32_reason = _keep_fp32_reason
    #: The dtype the policy wants for one tensor and the rule that decided (:func:`_decide`).
    decide = _decide

    def target_dtype(self, name: str, group: str, **kwargs: Any) -> tuple[torch.dtype, str]:
        """``(dtype, reason)``: :meth:`decide` (same arguments) as a pair."""
        d = self.decide(name, group, **kwargs)
        return d.dtype, d.reason

    # ---------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        return policy_json.encode_fields(
            {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrecisionPolicy:
        """A policy from :meth:`to_dict`'s output (or a hand-written dict of fields).

        Forward-compatible, as PEFT's configs are: a saved policy (it carries ``"version"``)
        from a newer hf-precision loads with a :class:`PrecisionWarning` for the fields this
        version does not know, which are dropped. A hand-written dict (no ``"version"``) with
        an unknown field is a typo and raises.

        >>> data = PrecisionPolicy.from_preset("bf16").to_dict()
        >>> data.update(version=2, future_field=1)
        >>> import warnings
        >>> with warnings.catch_warnings(record=True):
        ...     warnings.simplefilter("always")
        ...     PrecisionPolicy.from_dict(data).name
        'bf16'
        """
        return cls(**policy_json.decode_fields(data, _FIELDS))

    def to_json(self, **kwargs: Any) -> str:
        return policy_json.to_json_text(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str | bytes) -> PrecisionPolicy:
        """A policy from :meth:`to_json`'s text; text that is not a JSON object raises a
        :class:`PrecisionError` that says where it broke."""
        return cls.from_dict(policy_json.json_object(text))

    def describe(self) -> str:
        """One line for logs: ``bf16 (frozen bfloat16, trainable float32, compute bfloat16)``."""
        train = dtype_name(self.trainable_dtype) if self.trainable_dtype else "as frozen"
        if self.keep_trainable_fp32 and self.trainable_dtype != torch.float32:
            train += " (float32 ones kept)"
        extra = "".join(f", {g}={dtype_name(d)}" for g, d in self.group_dtypes.items())
        frozen = dtype_name(self.frozen_dtype)  # type: ignore[arg-type]
        return (
            f"{self.name or 'custom'} (frozen {frozen}, trainable "
            f"{train}, compute {dtype_name(self.compute_dtype)}{extra}; mode={self.mode})"
        )


_FIELDS = frozenset(f.name for f in dataclasses.fields(PrecisionPolicy))


def _normalise(policy: PrecisionPolicy) -> None:
    """Check and normalise the fields of a new policy (it is frozen: once, here)."""
    call = "PrecisionPolicy(...)" if policy.name is None else f"PrecisionPolicy[{policy.name}]"
    set_ = object.__setattr__  # frozen: normalise once, here
    compute = parse_dtype(policy.compute_dtype, call=f"{call}.compute_dtype")
    set_(policy, "compute_dtype", compute)
    set_(
        policy,
        "frozen_dtype",
        parse_dtype(
            compute if policy.frozen_dtype is None else policy.frozen_dtype,
            call=f"{call}.frozen_dtype",
        ),
    )
    if policy.trainable_dtype is not None:
        set_(
            policy,
            "trainable_dtype",
            parse_dtype(policy.trainable_dtype, call=f"{call}.trainable_dtype"),
        )
    if policy.full_eval_dtype is not None:
        set_(
            policy,
            "full_eval_dtype",
            parse_dtype(policy.full_eval_dtype, call=f"{call}.full_eval_dtype"),
        )
    set_(policy, "group_dtypes", _parse_mapping(policy.group_dtypes, call=f"{call}.group_dtypes"))
    keep = (policy.keep_fp32,) if isinstance(policy.keep_fp32, str) else tuple(policy.keep_fp32)
    set_(policy, "keep_fp32", keep)
    for pat in keep:
        if pat.startswith("re:"):
            try:
                re.compile(pat[3:])
            except re.error as err:
                raise PrecisionError(
                    f"{call}.keep_fp32: bad regex {pat!r}: {err}. Fix: escape it or drop "
                    "the 're:' prefix for a plain path."
                ) from err
    set_(policy, "mode", _choice(policy.mode, MODES, call=f"{call}.mode", what="mode"))
    set_(
        policy,
        "leaf_guards",
        _choice(
            policy.leaf_guards, LEAF_GUARDS, call=f"{call}.leaf_guards", what="leaf_guards value"
        ),
    )
    set_(policy, "batch_skip_keys", tuple(policy.batch_skip_keys))
    set_(policy, "batch_key_groups", dict(policy.batch_key_groups))
    known = group_names()
    for key, group in policy.batch_key_groups.items():
        _choice(group, known, call=f"{call}.batch_key_groups[{key!r}]", what="group")


def _decide_unkept(
    policy: PrecisionPolicy,
    name: str,
    group: str,
    trainable: bool,
    current: torch.dtype | None,
    role: Role | None,
    group_dtype: torch.dtype | None,
) -> Decision:
    """:meth:`PrecisionPolicy.decide`'s rules 2 to 5 (no keep pattern selected ``name``)."""
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


def policy_call(owner: str, policy: Any, **kwargs: Any) -> str:
    """How the user called ``owner``, for error messages: ``PrecisionGuardPlugin('bf16',
    mode='rasie')``."""
    args = (
        []
        if policy is None
        else [repr(policy) if isinstance(policy, str) else type(policy).__name__ + "(...)"]
    )
    args += [f"{k}={v!r}" for k, v in kwargs.items() if v is not None]
    return f"{owner}({', '.join(args)})"


_PRESET_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


def register_preset(
    name: str, compute: Any, frozen: Any, trainable: Any, help: str, **defaults: Any
) -> str:
    """Add a named preset for :meth:`PrecisionPolicy.from_preset`, next to what it serves.

    ``compute``/``frozen``/``trainable`` are dtypes (names or ``torch.dtype``); ``defaults`` are
    other :class:`PrecisionPolicy` fields the preset sets (``group_dtypes``, ``leaf_guards``,
    batch rules). Keyword overrides given to ``from_preset`` still win over them.

    >>> from hf_precision.rules.policy import PRESETS
    >>> import hf_precision.rules.diffusion_rules  # registers fp16-vae32 and bf16-vae32 this way
    >>> PRESETS["fp16-vae32"]
    (torch.float16, torch.float16, torch.float32)
    """
    call = f"register_preset({name!r}, ...)"
    if not isinstance(name, str) or not _PRESET_NAME_RE.match(name):
        raise PrecisionError(
            f"{call}: preset names are lowercase ([a-z0-9][a-z0-9.-]*). Fix: e.g. 'fp16-vae32'."
        )
    if name in PRESETS or name in PRESET_MISNAMES:
        raise PrecisionError(
            f"{call}: a preset of that name exists ({', '.join(PRESETS)}). "
            "Fix: choose another name."
        )
    fixed = {"compute_dtype", "frozen_dtype", "trainable_dtype", "name"}
    reject_unknown_fields(defaults, _FIELDS - fixed, lambda bad: call)
    dtypes = tuple(
        parse_dtype(v, call=f"{call}.{k}")
        for k, v in (("compute", compute), ("frozen", frozen), ("trainable", trainable))
    )
    # Build one now so a bad default fails here, not at the user's from_preset call.
    PrecisionPolicy(
        compute_dtype=dtypes[0],
        frozen_dtype=dtypes[1],
        trainable_dtype=dtypes[2],
        name=name,
        **copy.deepcopy(defaults),
    )
    PRESETS[name] = dtypes  # type: ignore[assignment]
    PRESET_HELP[name] = help
    PRESET_DEFAULTS[name] = dict(defaults)
    return name
