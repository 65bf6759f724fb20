"""DeepSpeed config checks, without importing DeepSpeed: the JSON's ``bf16``/``fp16`` sections
against ``--bf16``/``--fp16`` (``TrainingArguments``) or ``accelerator.mixed_precision``.

The LLaVA failure: ``--bf16 True`` with a ``zero2.json`` whose ``fp16`` section says ``true`` (or
whose ``bf16`` section says ``false``). DeepSpeed casts the whole model, vision encoder included,
to the dtype its JSON enables; transformers reports explicit mismatches only once the model is
built, and accelerate's own loop not at all. ``"auto"`` values follow the flags.

>>> from hf_precision.rules.deepspeed_config import check_deepspeed_config
>>> check_deepspeed_config({"bf16": {"enabled": "auto"}}, bf16=True, fp16=False)
torch.bfloat16
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from ..errors import PrecisionError
from .dtypes import zero3_dtype

_SECTIONS = {"bf16": ("bf16", "bfloat16"), "fp16": ("fp16",)}


def load_deepspeed_config(config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A DeepSpeed config as a dict: from a dict, a JSON file, JSON text or base64 JSON (the
    forms ``TrainingArguments(deepspeed=...)`` accepts, read by accelerate's
    ``HfDeepSpeedConfig`` as transformers reads them). A dict is returned as given."""
    if isinstance(config, dict):
        return config
    from accelerate.utils import HfDeepSpeedConfig

    text = os.fspath(config)
    try:
        return dict(HfDeepSpeedConfig(text).config)
    except ValueError as err:  # json.JSONDecodeError included
        what = (
            "not valid JSON"
            if os.path.isfile(text)
            else "no such file, and not JSON text or base64 JSON"
        )
        raise PrecisionError(
            f"load_deepspeed_config({text!r}): {what} ({err}).\n"
            "Fix: pass the path of a valid DeepSpeed JSON, or the config as a dict."
        ) from err


def _enabled(cfg: dict[str, Any], flag: str, source: str) -> tuple[str | None, bool | str | None]:
    """(section key found, its ``enabled`` value normalised to True/False/"auto"/None)."""
    for key in _SECTIONS[flag]:
        if key in cfg:
            section = cfg[key]
            if not isinstance(section, dict):
                raise PrecisionError(
                    f"check_deepspeed_config({source}): {key!r} must be an "
                    f'object like {{"enabled": "auto"}}, got {section!r}.'
                )
            value = section.get("enabled", False)  # DeepSpeed's default when the key is absent
            if isinstance(value, str) and value.lower() in ("true", "false", "auto"):
                value = {"true": True, "false": False, "auto": "auto"}[value.lower()]
            if value not in (True, False, "auto"):
                raise PrecisionError(
                    f"check_deepspeed_config({source}): {key}.enabled={value!r}; allowed: true, "
                    'false, "auto". Fix: use "auto" so it follows --bf16/--fp16.'
                )
            return key, value
    return None, None


def check_deepspeed_config(
    config: dict[str, Any] | str | os.PathLike[str], *, bf16: bool, fp16: bool
) -> torch.dtype:
    """Check that a DeepSpeed config and the ``bf16``/``fp16`` flags (``TrainingArguments`` or
    ``accelerator.mixed_precision``) ask for the same precision; return the dtype DeepSpeed will
    hold the model in.

    ``"auto"`` follows the flags. A missing section is filled by accelerate from the flags. An
    explicit value that contradicts a flag raises :class:`PrecisionError`: transformers would
    report it only after the model is built (accelerate's own loop not at all), and DeepSpeed would
    otherwise cast the whole model, vision encoder included, to the JSON's dtype.

    >>> check_deepspeed_config({"fp16": {"enabled": True}}, bf16=True, fp16=False)
    Traceback (most recent call last):
    ...
    hf_precision.errors.PrecisionError: check_deepspeed_config(...): ...
    """
    source = repr(os.fspath(config)) if not isinstance(config, dict) else "{...}"
    call = f"check_deepspeed_config({source}, bf16={bf16}, fp16={fp16})"
    if bf16 and fp16:
        raise PrecisionError(f"{call}: bf16 and fp16 are both set. Fix: choose one.")
    cfg = load_deepspeed_config(config)
    problems: list[str] = []
    resolved: dict[str, bool] = {}
    for flag, want in (("bf16", bf16), ("fp16", fp16)):
        key, value = _enabled(cfg, flag, source)
        if value is None or value == "auto":
            resolved[flag] = want
        else:
            resolved[flag] = bool(value)
            if bool(value) != want:
                problems.append(
                    f'the JSON says "{key}": {{"enabled": {str(value).lower()}}} but '
                    f"--{flag} is {want}"
                )
    if resolved["bf16"] and resolved["fp16"]:
        problems.append("the JSON enables both bf16 and fp16")
    amp = cfg.get("amp", {})
    if (
        isinstance(amp, dict)
        and str(amp.get("enabled", False)).lower() == "true"
        and (resolved["bf16"])
    ):
        problems.append('the JSON enables apex "amp" together with bf16')
    if problems:
        flags = "--bf16" if bf16 else "--fp16" if fp16 else "no --bf16/--fp16 (fp32)"
        raise PrecisionError(
            f"{call}: the DeepSpeed config contradicts the precision flags ({flags}):\n  "
            + "\n  ".join(problems)
            + "\nDeepSpeed casts the whole model, vision encoder and projector included, to the "
            "dtype its JSON enables, so the run would not train in the precision you asked for.\n"
            'Fix: set "enabled": "auto" in the "bf16" and "fp16" sections (they then follow the '
            "flags), or change the flags to match the JSON."
        )
    if resolved["bf16"]:
        return torch.bfloat16
    if resolved["fp16"]:
        return torch.float16
    return torch.float32


def deepspeed_config_of(accelerator: Any = None, args: Any = None) -> dict[str, Any] | None:
    """The DeepSpeed config an accelerator or ``TrainingArguments`` carries, if any."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    if plugin is not None and isinstance(getattr(plugin, "deepspeed_config", None), dict):
        return plugin.deepspeed_config
    hf = getattr(args, "hf_deepspeed_config", None)
    if hf is not None and isinstance(getattr(hf, "config", None), dict):
        return hf.config
    ds = getattr(args, "deepspeed", None)
    if ds:
        return load_deepspeed_config(ds)
    return None


def zero_stage(accelerator: Any = None, args: Any = None) -> int | None:
    """The ZeRO stage the DeepSpeed config of an accelerator or ``TrainingArguments`` asks for
    (``0`` without a ``zero_optimization`` section), ``None`` without DeepSpeed.

    >>> zero_stage(args=type("Args", (), {"deepspeed": {"zero_optimization": {"stage": 3}}}))
    3
    """
    cfg = deepspeed_config_of(accelerator, args)
    if cfg is None:
        return None
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    return int(stage) if str(stage).isdigit() else None


def check_training_args(args: Any) -> torch.dtype | None:
    """:func:`check_deepspeed_config` on ``args.deepspeed`` against ``args.bf16``/``args.fp16``
    (``*_full_eval`` count as transformers counts them); ``None`` without DeepSpeed."""
    cfg = deepspeed_config_of(args=args)
    if cfg is None:
        return None
    return check_deepspeed_config(
        cfg,
        bf16=bool(getattr(args, "bf16", False) or getattr(args, "bf16_full_eval", False)),
        fp16=bool(getattr(args, "fp16", False) or getattr(args, "fp16_full_eval", False)),
    )


def zero3_master_dtype(
    half: torch.dtype | None, stage: int | None, params: Iterable[torch.Tensor]
) -> torch.dtype | None:
    """The half dtype DeepSpeed ZeRO-3 holds a run's trainable weights in, whose fp32 master
    copies live in its optimizer (rule ``wrapper_master_fp32``), or ``None``. ``half``: the
    dtype the DeepSpeed config holds the model in; ``stage``: its ZeRO stage; ``params``: the
    model's parameters. ZeRO-3 flattens every trainable partition into one buffer of one dtype:
    once some trainable weights are partitioned in the half dtype (``ds_id``: a model built
    under ``deepspeed.zero.Init``), the others join them; before any partition (the stage known
    from the front end's config), only when every trainable weight is in it already (TRL's
    bf16 LoRA) — otherwise DeepSpeed casts the module itself and nothing is kept."""
    if half not in (torch.bfloat16, torch.float16):
        return None
    trainable = [p for p in params if p.requires_grad and p.is_floating_point()]
    parted = [p for p in trainable if hasattr(p, "ds_id")]
    if parted:
        return half if all(zero3_dtype(p) == half for p in parted) else None
    if stage == 3 and all(p.dtype == half for p in trainable):
        return half
    return None
