"""The precision policy: one object that says which dtype every part of the model is in.

>>> from hf_precision import PrecisionPolicy
>>> policy = PrecisionPolicy.from_preset("bf16", group_dtypes={"vision_encoder": "fp32"})
>>> policy.compute_dtype, policy.trainable_dtype
(torch.bfloat16, torch.float32)
>>> PrecisionPolicy.from_json(policy.to_json()) == policy
True

Which dtype it wants for one tensor, and the rule that decided, is the precedence of
:mod:`~.precedence`; the check of its fields is
:mod:`~.fields`, the preset tables :mod:`~.presets`,
tensor roles :mod:`~hf_precision.rules.roles`, inference from a model or a flag
:mod:`~.inference`, the JSON form :mod:`~.json_form`,, the
batch defaults :mod:`~hf_precision.rules.batch_keys`.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...base.names import PRESET_MISNAMES
from ...base.registry import add_entry
from ...errors import PrecisionError
from ..batch_keys import DEFAULT_KEY_GROUPS, DEFAULT_SKIP_KEYS
from ..dtypes import dtype_name, parse_dtype
from ..fp8_rules import DEFAULT_KEEP_OUT_OF_FP8
from . import fields as policy_fields
from . import inference, precedence
from . import json_form as policy_json
from .fields import LeafGuards, Mode
from .json_form import as_kwargs, reject_unknown_fields
from .presets import PRESET_DEFAULTS, PRESET_HELP, PRESETS, preset_name

__all__ = ["PrecisionPolicy", "policy_call", "register_preset"]


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
    keep_out_of_fp8: tuple[str, ...] = field(
        default=DEFAULT_KEEP_OUT_OF_FP8,
        metadata={
            "help": "groups, words (embeddings, norms, routers, adapters, first_last_blocks) "
            "and path patterns whose matmuls never run fp8 (docs/fp8.md)"
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
        policy_fields.normalise(self)

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
        cls,
        value: PrecisionPolicy | str | Path | Mapping[str, Any] | None,
        model: nn.Module | None = None,
    ) -> PrecisionPolicy:
        """The one reading of a policy: a policy (as is), a preset name, JSON text, the path
        of a JSON file :meth:`to_json` wrote, a dict (JSON form), or ``None`` (inferred from
        ``model``, else ``fp32``). :func:`hf_precision.rules.policy.parse.parse_policy` adds
        overrides and the caller's name to it."""
        if isinstance(value, PrecisionPolicy):
            return value
        if isinstance(value, str | Path):
            data = policy_json.spec_object(value, PRESETS)
            return cls.from_preset(str(value)) if data is None else cls.from_dict(data)
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if value is None:
            return cls.from_model(model) if model is not None else cls.from_preset("fp32")
        raise PrecisionError(
            f"PrecisionPolicy.resolve({value!r}): expected a PrecisionPolicy, a preset name "
            f"({', '.join(PRESETS)}), JSON text, a JSON file, a dict or None."
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

    #: Why ``name`` must stay fp32 whatever its group
    #: (:func:`hf_precision.rules.policy.precedence.keep_fp32_reason`).
    keep_fp32_reason = precedence.keep_fp32_reason
    #: The dtype the policy wants for one tensor and the rule that decided
    #: (:func:`hf_precision.rules.policy.precedence.decide`).
    decide = precedence.decide

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

    >>> from hf_precision.rules.policy.presets import PRESETS
    >>> import hf_precision.rules.groups.diffusion  # registers fp16-vae32 and bf16-vae32 this way
    >>> PRESETS["fp16-vae32"]
    (torch.float16, torch.float16, torch.float32)
    """
    call = f"register_preset({name!r}, ...)"

    def add(preset: str) -> str:
        dtypes = _preset_dtypes(call, compute, frozen, trainable)
        _check_preset_defaults(call, preset, dtypes, defaults)
        PRESETS[preset] = dtypes  # type: ignore[assignment]
        PRESET_HELP[preset] = help
        PRESET_DEFAULTS[preset] = dict(defaults)
        return preset

    return add_entry(
        call,
        name,
        pattern=_PRESET_NAME_RE,
        example="'fp16-vae32'",
        exists=lambda n: n in PRESETS or n in PRESET_MISNAMES,
        add=add,
        rule="preset names are lowercase ([a-z0-9][a-z0-9.-]*)",
        taken=f"a preset of that name exists ({', '.join(PRESETS)}). Fix: choose another name",
    )


def _preset_dtypes(call: str, compute: Any, frozen: Any, trainable: Any) -> tuple[Any, ...]:
    """A preset's compute, frozen and trainable dtypes, parsed."""
    return tuple(
        parse_dtype(v, call=f"{call}.{k}")
        for k, v in (("compute", compute), ("frozen", frozen), ("trainable", trainable))
    )


def _check_preset_defaults(
    call: str, name: str, dtypes: tuple[Any, ...], defaults: dict[str, Any]
) -> None:
    """A preset's other fields are policy fields, and a policy builds from them now, so a bad
    default fails at ``register_preset``, not at the user's ``from_preset`` call."""
    fixed = {"compute_dtype", "frozen_dtype", "trainable_dtype", "name"}
    reject_unknown_fields(defaults, _FIELDS - fixed, lambda bad: call)
    PrecisionPolicy(
        compute_dtype=dtypes[0],
        frozen_dtype=dtypes[1],
        trainable_dtype=dtypes[2],
        name=name,
        **copy.deepcopy(defaults),
    )
