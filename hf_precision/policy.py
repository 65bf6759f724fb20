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
   preset (rule ``keep_fp32_strict``, :mod:`hf_precision.keep_rules`); the model's
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
import json
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

from .dtypes import dtype_name, majority_dtype, parse_dtype
from .errors import PrecisionError, PrecisionWarning, did_you_mean
from .groups import group_names
from .names import PRESET_MISNAMES, preset_hint

POLICY_VERSION = 1
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
#: What a tensor is, beyond its name (:func:`tensor_role`): a normalization layer's weight or a
#: rotary/positional table.
Role = Literal["norm", "rotary"]


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


#: preset -> (compute, frozen, trainable)
PRESETS: dict[str, tuple[torch.dtype, torch.dtype, torch.dtype]] = {
    "bf16": (torch.bfloat16, torch.bfloat16, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16, torch.float32),
    "fp16-true": (torch.float16, torch.float16, torch.float16),
    "fp32": (torch.float32, torch.float32, torch.float32),
}
PRESET_HELP = {
    "bf16": "frozen weights bf16, trainable weights fp32, compute bf16 (Trainer bf16=True)",
    "bf16-true": "everything bf16, trainable weights too (pure bf16 training/inference)",
    "fp16": "frozen weights fp16, trainable weights fp32 for the GradScaler (Trainer fp16=True)",
    "fp16-true": "everything fp16 (inference only: the GradScaler cannot unscale fp16 grads)",
    "fp32": "everything fp32",
}
#: preset -> PrecisionPolicy fields it sets beyond the three dtypes (see :func:`register_preset`)
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {}


def preset_name(name: object, *, call: str = "PrecisionPolicy.from_preset") -> str:
    """``name`` when it is a preset name, else a :class:`PrecisionError` that says which
    preset was probably meant: one vocabulary for Python and the ``hf-precision`` CLI (names
    are exact and lower case; :data:`PRESET_MISNAMES` lists what other tools call them).

    >>> preset_name("bf16-true")
    'bf16-true'
    >>> try:
    ...     preset_name("bfloat16")
    ... except PrecisionError as err:
    ...     print(str(err).splitlines()[0].split(". ", 1)[1])
    Did you mean 'bf16' (frozen bf16, trainable fp32) or 'bf16-true' (all bf16)?
    """
    if isinstance(name, str) and name in PRESETS:
        return name
    hint = preset_hint(name, PRESETS)
    listing = "\n".join(f"  {k:<10} {v}" for k, v in PRESET_HELP.items())
    raise PrecisionError(
        f"{call}({name!r}): unknown preset {name!r}.{hint}\n"
        f"Allowed:\n{listing}\nFix: pass one of these names, or build "
        "PrecisionPolicy(compute_dtype=..., frozen_dtype=..., trainable_dtype=...)."
    )


#: Buffers that always stay fp32 by name (rotary frequencies lose positions when rounded): any
#: ``*inv_freq*`` (``inv_freq``, ``original_inv_freq``, Gemma 3's per-layer-type
#: ``sliding_attention_inv_freq`` ...). Buffers of rotary modules are found by type too
#: (:func:`tensor_role`).
DEFAULT_KEEP_FP32_BUFFERS: tuple[str, ...] = ("re:(.*\\.)?[^.]*inv_freq[^.]*",)
#: Normalization layers by type (subclasses included) and by class name (``*RMSNorm``,
#: ``*LayerNorm``, ``*GroupNorm`` of transformers and remote code).
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.modules.batchnorm._NormBase,
)
_NORM_NAME = re.compile(r"(RMS|Layer|Group|Batch)_?Norm", re.IGNORECASE)
_ROTARY_NAME = re.compile(r"Rotary|RoPE|Rope(Emb|$)")


def is_norm_module(module: nn.Module) -> bool:
    """A normalization layer, by type or class name (``LlamaRMSNorm``, ``Qwen2VLLayerNorm``,
    ``nn.LayerNorm``, remote code's ``InternRMSNorm``)."""
    return isinstance(module, _NORM_TYPES) or bool(_NORM_NAME.search(type(module).__name__))


def is_rotary_module(module: nn.Module) -> bool:
    """A rotary-embedding module: its class name says so (``LlamaRotaryEmbedding``,
    ``Qwen2VisionRotaryEmbedding``), or it keeps rotary state (``inv_freq``,
    ``rope_init_fn``, ``rope_type``)."""
    if _ROTARY_NAME.search(type(module).__name__):
        return True
    d = module.__dict__
    return "inv_freq" in d.get("_buffers", {}) or "rope_init_fn" in d or "rope_type" in d


def _is_head(name: str) -> bool:
    """``name`` is a weight of the language model's output head (``lm_head``, as TRL's
    ``cast_lm_head_to_fp32`` names it)."""
    return "lm_head" in name.split(".")


def tensor_role(
    module: nn.Module, key: str, tensor: torch.Tensor, *, is_buffer: bool
) -> Role | None:
    """What ``module.<key>`` is, by the module that holds it: ``"rotary"`` for a floating
    buffer of a rotary module (or any ``*inv_freq*`` buffer), ``"norm"`` for a 1-D weight or
    bias of a normalization layer, else ``None``."""
    if is_buffer:
        if tensor.is_floating_point() and ("inv_freq" in key or is_rotary_module(module)):
            return "rotary"
        return None
    if tensor.dim() <= 1 and is_norm_module(module):
        return "norm"
    return None


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
                "Fix: use one of these, or hf_precision.groups.register_group(name) first."
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
        call = "PrecisionPolicy(...)" if self.name is None else f"PrecisionPolicy[{self.name}]"
        set_ = object.__setattr__  # frozen: normalise once, here
        compute = parse_dtype(self.compute_dtype, call=f"{call}.compute_dtype")
        set_(self, "compute_dtype", compute)
        set_(
            self,
            "frozen_dtype",
            parse_dtype(
                compute if self.frozen_dtype is None else self.frozen_dtype,
                call=f"{call}.frozen_dtype",
            ),
        )
        if self.trainable_dtype is not None:
            set_(
                self,
                "trainable_dtype",
                parse_dtype(self.trainable_dtype, call=f"{call}.trainable_dtype"),
            )
        if self.full_eval_dtype is not None:
            set_(
                self,
                "full_eval_dtype",
                parse_dtype(self.full_eval_dtype, call=f"{call}.full_eval_dtype"),
            )
        set_(self, "group_dtypes", _parse_mapping(self.group_dtypes, call=f"{call}.group_dtypes"))
        keep = (self.keep_fp32,) if isinstance(self.keep_fp32, str) else tuple(self.keep_fp32)
        set_(self, "keep_fp32", keep)
        for pat in keep:
            if pat.startswith("re:"):
                try:
                    re.compile(pat[3:])
                except re.error as err:
                    raise PrecisionError(
                        f"{call}.keep_fp32: bad regex {pat!r}: {err}. Fix: escape it or drop "
                        "the 're:' prefix for a plain path."
                    ) from err
        set_(self, "mode", _choice(self.mode, MODES, call=f"{call}.mode", what="mode"))
        set_(
            self,
            "leaf_guards",
            _choice(
                self.leaf_guards, LEAF_GUARDS, call=f"{call}.leaf_guards", what="leaf_guards value"
            ),
        )
        set_(self, "batch_skip_keys", tuple(self.batch_skip_keys))
        set_(self, "batch_key_groups", dict(self.batch_key_groups))
        known = group_names()
        for key, group in self.batch_key_groups.items():
            _choice(group, known, call=f"{call}.batch_key_groups[{key!r}]", what="group")

    __hash__ = None  # type: ignore[assignment]  # dict fields: equal by value, not hashable

    def replace(self, **changes: Any) -> PrecisionPolicy:
        """A new policy with ``changes`` applied (this one is unchanged)."""
        _reject_unknown_fields(
            changes, _FIELDS, lambda bad: f"PrecisionPolicy.replace({_as_kwargs(bad)})"
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
        _reject_unknown_fields(
            overrides,
            _FIELDS,
            lambda bad: f"PrecisionPolicy.from_preset({name!r}, {_as_kwargs(bad)})",
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
        preset = infer_preset(model)
        inferred: dict[str, Any] = {"keep_trainable_fp32": True}
        half = _trainable_half_dtype(model)
        if half == torch.bfloat16 and half != PRESETS[preset][2]:
            # trained in bf16 as loaded (pure-bf16 training is a choice); fp16 trainables
            # outside an fp16 model are not kept: fp16 cannot hold AdamW's eps
            inferred["trainable_dtype"] = half
        return cls.from_preset(preset, **{**inferred, **overrides})

    @classmethod
    def from_training_args(
        cls, args: Any, model: nn.Module | None = None, **overrides: Any
    ) -> PrecisionPolicy:
        """Infer from ``TrainingArguments``: ``bf16=True`` -> ``bf16`` (frozen bf16, trainable
        fp32); ``fp16=True`` -> ``fp16`` (frozen fp16, trainable fp32); no flag ->
        :meth:`from_model` (frozen weights in the dtype the language model was loaded in,
        trainable weights kept in the dtype they were loaded in)."""
        if getattr(args, "bf16", False) and getattr(args, "fp16", False):
            raise PrecisionError(
                "PrecisionPolicy.from_training_args(args): bf16=True and fp16=True together. "
                "Fix: choose one."
            )
        if getattr(args, "bf16", False):
            policy = cls.from_preset("bf16", **overrides)
        elif getattr(args, "fp16", False):
            policy = cls.from_preset("fp16", **overrides)
        elif model is not None:
            policy = cls.from_model(model, **overrides)
        else:
            policy = cls.from_preset("fp32", **overrides)
        if getattr(args, "bf16_full_eval", False):
            return policy.replace(full_eval_dtype=torch.bfloat16)
        if getattr(args, "fp16_full_eval", False):
            return policy.replace(full_eval_dtype=torch.float16)
        return policy

    @classmethod
    def from_accelerator(
        cls, accelerator: Any, model: nn.Module | None = None, **overrides: Any
    ) -> PrecisionPolicy:
        """Infer from ``accelerator.mixed_precision`` (``bf16``, ``fp16``, ``no``, ``fp8``);
        ``no`` -> :meth:`from_model`, the same no-flag rule as :meth:`from_training_args`."""
        mp = str(getattr(accelerator, "mixed_precision", "no") or "no")
        if mp == "bf16":
            return cls.from_preset("bf16", **overrides)
        if mp == "fp16":
            return cls.from_preset("fp16", **overrides)
        if mp == "fp8":
            warnings.warn(
                "PrecisionPolicy.from_accelerator: mixed_precision='fp8' is handled by its own "
                "recipe; the guard uses the 'bf16' policy around it.",
                PrecisionWarning,
                stacklevel=2,
            )
            return cls.from_preset("bf16", **overrides)
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

    def keep_fp32_reason(
        self,
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

    def decide(
        self,
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
        (:func:`hf_precision.keep_rules.model_keep_lists`). ``master_fp32`` is the half dtype of
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
        if (
            trainable
            and master_fp32 is not None
            and self.trainable_dtype not in (None, master_fp32)
        ):
            how = "left as is" if current == master_fp32 else "joins the others"
            return Decision(
                master_fp32,
                "wrapper_master_fp32",
                f"trainable {dtype_name(master_fp32)} under DeepSpeed ZeRO-3, which keeps fp32 "
                f"master copies and flattens every trainable partition into one "
                f"{dtype_name(master_fp32)} buffer: {how} (TRL's autocast_adapter_dtype=False)",
            )
        decision = self._decide_unkept(name, group, trainable, current, role, group_dtype)
        if decision.dtype == torch.float16 and self.honour_model_keep_fp32:
            for pat in model_patterns:  # the loader keeps them fp32 for fp16 loads
                if match_pattern(pat, name):
                    why = f"model._keep_in_fp32_modules {pat!r} (fp32 where fp16 would be)"
                    return Decision(torch.float32, "keep_fp32", why)
        return decision

    def _decide_unkept(
        self,
        name: str,
        group: str,
        trainable: bool,
        current: torch.dtype | None,
        role: Role | None,
        group_dtype: torch.dtype | None,
    ) -> Decision:
        """:meth:`decide`'s rules 2 to 5 (no keep pattern selected ``name``)."""
        if trainable and self.keep_trainable_fp32 and current == torch.float32:
            return Decision(torch.float32, "keep_trainable_fp32", "keep_trainable_fp32")
        half_group = (
            group_dtype is not None and group_dtype.is_floating_point and group_dtype.itemsize < 4
        )
        if self.keep_fp32_head and current == torch.float32 and _is_head(name):
            return Decision(
                torch.float32,
                "deliberate_fp32",
                "fp32 lm_head kept as chosen (TRL's cast_lm_head_to_fp32=True); "
                "cast_lm_head_to_fp32=False casts it",
            )
        if trainable and self.trainable_dtype is not None:
            return Decision(self.trainable_dtype, "trainable", "trainable")
        if group in self.group_dtypes:
            return Decision(self.group_dtypes[group], "group_dtypes", f"group_dtypes[{group!r}]")
        if role == "norm" and self.keep_fp32_norms and current == torch.float32 and half_group:
            assert group_dtype is not None
            return Decision(
                torch.float32,
                "deliberate_fp32",
                f"fp32 norm weight in a {dtype_name(group_dtype)} group: kept as chosen "
                "(upcast_layernorm / prepare_model_for_kbit_training); keep_fp32_norms=False "
                "casts it",
            )
        return Decision(self.frozen_dtype, "frozen", "frozen")  # type: ignore[arg-type]

    def target_dtype(self, name: str, group: str, **kwargs: Any) -> tuple[torch.dtype, str]:
        """``(dtype, reason)``: :meth:`decide` (same arguments) as a pair."""
        d = self.decide(name, group, **kwargs)
        return d.dtype, d.reason

    # ---------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        def enc(v: Any) -> Any:
            if isinstance(v, torch.dtype):
                return dtype_name(v)
            if isinstance(v, dict):
                return {k: enc(x) for k, x in v.items()}
            if isinstance(v, tuple):
                return list(v)
            return v

        out = {f.name: enc(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["version"] = POLICY_VERSION
        return out

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
        if not isinstance(data, Mapping):
            raise PrecisionError(
                f"PrecisionPolicy.from_dict({_shorten(data)}): expected a dict of policy fields "
                f"(PrecisionPolicy.to_dict()), got a value of type {type(data).__name__}. "
                "Fix: pass that dict, or use PrecisionPolicy.from_json(text) / "
                "PrecisionPolicy.from_preset(name)."
            )
        data = dict(data)
        saved = "version" in data
        version = data.pop("version", POLICY_VERSION)
        if not isinstance(version, int) or version < 1:
            raise PrecisionError(
                f"PrecisionPolicy.from_dict(version={version!r}): policy versions are integers "
                f">= 1 (this hf-precision writes {POLICY_VERSION}). Fix: re-save the policy with "
                "PrecisionPolicy.to_json()."
            )
        unknown = sorted(set(data) - set(_FIELDS))
        if saved and unknown:
            newer = (
                f" (saved as policy version {version}, this hf-precision reads {POLICY_VERSION})"
            )
            warnings.warn(
                f"PrecisionPolicy.from_dict(...): ignoring field(s) {unknown} this hf-precision "
                f"does not know{newer if version > POLICY_VERSION else ''}. Fix: upgrade "
                "hf-precision to honour them, or drop them from the saved policy.",
                PrecisionWarning,
                stacklevel=2,
            )
            data = {k: v for k, v in data.items() if k in _FIELDS}
        _reject_unknown_fields(data, _FIELDS, lambda bad: "PrecisionPolicy.from_dict(...)")
        return cls(**data)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), indent=kwargs.pop("indent", 2), **kwargs)

    @classmethod
    def from_json(cls, text: str | bytes) -> PrecisionPolicy:
        """A policy from :meth:`to_json`'s text; text that is not a JSON object raises a
        :class:`PrecisionError` that says where it broke."""
        shown = _shorten(text)
        if not isinstance(text, str | bytes | bytearray):
            raise PrecisionError(
                f"PrecisionPolicy.from_json({shown}): expected the JSON text of a policy, got a "
                f"value of type {type(text).__name__}. Fix: pass policy.to_json() output; for a "
                "dict use PrecisionPolicy.from_dict(...), for a file PrecisionPolicy.from_json("
                "Path(...).read_text())."
            )
        try:
            data = json.loads(text)
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise PrecisionError(
                f"PrecisionPolicy.from_json({shown}): not valid JSON ({err}). Fix: pass the text "
                "PrecisionPolicy.to_json() wrote (a saved policy.json), not a preset name or a "
                "path: PrecisionPolicy.from_preset('bf16'), PrecisionPolicy.from_json("
                "Path(...).read_text())."
            ) from None
        if not isinstance(data, dict):
            raise PrecisionError(
                f"PrecisionPolicy.from_json({shown}): the JSON is a {type(data).__name__}, not "
                "an object of policy fields. Fix: pass the text PrecisionPolicy.to_json() wrote."
            )
        return cls.from_dict(data)

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


def _shorten(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters for a message that repeats a call."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _as_kwargs(names: Iterable[str]) -> str:
    return ", ".join(f"{n}=..." for n in names)


def _reject_unknown_fields(
    given: Iterable[str], known: Iterable[str], call: Callable[[list[str]], str]
) -> None:
    """The one check of field names: ``call(bad)`` is how the user called us."""
    known = set(known)
    bad = sorted(set(given) - known)
    if bad:
        raise PrecisionError(
            f"{call(bad)}: unknown field(s) {bad}.\nAllowed: {', '.join(sorted(known))}."
        )


def _as_call(err: PrecisionError, call: str) -> PrecisionError:
    """``err`` said as the user's own ``call`` (a front end's), not the inner one."""
    return PrecisionError(f"{call}: {str(err).split(': ', 1)[-1]}")


def loaded_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype the user loaded ``model`` in (``from_pretrained(..., dtype=...)``): the one
    most of the language model's frozen weights have, else most of its weights, else the
    whole model's (frozen first). ``None`` when no weight is floating.

    The language model decides, not a count over the whole model: a vision tower larger than
    the language model (or kept fp32 on purpose), PEFT's fp32 adapters on a tiny model, or a
    projector trained in fp32 would otherwise tip the count.
    """
    from .dtypes import is_castable
    from .groups import find_module_groups
    from .wrappers import unwrap_model

    root, _ = unwrap_model(model)
    params = [(n, p) for n, p in root.named_parameters() if is_castable(p)]
    with warnings.catch_warnings():  # the guard says what it finds when it runs; quiet here
        warnings.simplefilter("ignore")
        groups = find_module_groups(root)
    lm = [p for n, p in params if groups.group_of(n) == "language_model"]
    for pool in (lm, [p for _, p in params]):
        frozen = [p for p in pool if not p.requires_grad]
        for chosen in (frozen, pool):
            dt = majority_dtype((p.dtype, p.numel()) for p in chosen)
            if dt is not None:
                return dt
    return None


def infer_preset(model: nn.Module) -> str:
    """The preset :meth:`PrecisionPolicy.from_model` starts from: ``bf16-true`` /
    ``fp16-true`` when the language model was loaded in that half dtype
    (:func:`loaded_dtype`), else ``fp32``."""
    dt = loaded_dtype(model)
    if dt == torch.bfloat16:
        return "bf16-true"
    if dt == torch.float16:
        return "fp16-true"
    return "fp32"


def _trainable_half_dtype(model: nn.Module) -> torch.dtype | None:
    """The half dtype most trainable weights not in fp32 were loaded in (or ``None``)."""
    from .dtypes import is_castable
    from .wrappers import unwrap_model

    root, _ = unwrap_model(model)
    return majority_dtype(
        (p.dtype, p.numel())
        for p in root.parameters()
        if p.requires_grad and is_castable(p) and p.dtype in (torch.bfloat16, torch.float16)
    )


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


def with_overrides(policy: PrecisionPolicy, *, call: str, **overrides: Any) -> PrecisionPolicy:
    """``policy`` with the non-``None`` ``overrides`` applied, as a new policy; a bad value
    raises a :class:`PrecisionError` that repeats ``call`` (the user's own call)."""
    changes = {k: v for k, v in overrides.items() if v is not None}
    if not changes:
        return policy
    try:
        return policy.replace(**changes)
    except PrecisionError as err:
        raise _as_call(err, call) from None


def resolve_policy(
    value: PrecisionPolicy | str | Mapping[str, Any] | None, *, call: str
) -> PrecisionPolicy:
    """:meth:`PrecisionPolicy.resolve` for a front end: errors repeat ``call``; ``None`` gives
    the ``fp32`` preset (a stand-in, to validate overrides before the model is known)."""
    try:
        return PrecisionPolicy.resolve("fp32" if value is None else value)
    except PrecisionError as err:
        raise _as_call(err, call) from None


_PRESET_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


def register_preset(
    name: str, compute: Any, frozen: Any, trainable: Any, help: str, **defaults: Any
) -> str:
    """Add a named preset for :meth:`PrecisionPolicy.from_preset`, next to what it serves.

    ``compute``/``frozen``/``trainable`` are dtypes (names or ``torch.dtype``); ``defaults`` are
    other :class:`PrecisionPolicy` fields the preset sets (``group_dtypes``, ``leaf_guards``,
    batch rules). Keyword overrides given to ``from_preset`` still win over them.

    >>> from hf_precision.policy import PRESETS
    >>> import hf_precision.diffusion_rules  # registers fp16-vae32 and bf16-vae32 this way
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
    _reject_unknown_fields(defaults, _FIELDS - fixed, lambda bad: call)
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
