"""OneTrainer under the launcher: ``hf-precision run -- python scripts/train.py --config-path
cfg.json``, with no edit to OneTrainer.

OneTrainer runs its own loop. It builds an ``Accelerator`` only to read its device (never
``prepare``, ``backward`` or ``accumulate``), so neither the Trainer patch nor the accelerate
hook reaches its models. The start-up hook (:mod:`.autostart`) hands
``modules.trainer.GenericTrainer`` to :func:`patch_generic_trainer_module` when OneTrainer
imports it, which wraps ``GenericTrainer.start``. Once OneTrainer has loaded and set up its
model (weights in their ``weight_dtype``, optimizer built), :func:`guard_trainer`:

* finds the parts (``unet``/``transformer``, ``text_encoder``/``text_encoder_1``..``_3``,
  ``vae``) on OneTrainer's model and runs :func:`~hf_precision.guard_diffusion` on them, with
  the policy OneTrainer's own config words say (:func:`policy_from_config`):
  ``train_dtype`` ``FLOAT_16`` is the ``fp16`` preset (frozen weights fp16, trained weights fp32,
  as ``fp16=True`` is for the Trainer: AdamW's ``eps`` of 1e-8 is 0 in float16, and a pure-fp16
  fine-tune turns NaN at its second step), ``BFLOAT_16`` the ``bf16`` preset, ``FLOAT_32``
  ``fp32``; each part's ``weight_dtype`` is its group's dtype (an fp32 VAE stays fp32);
  quantized weight dtypes (``FLOAT_8``, ``NFLOAT_4``, ...) are left as loaded;
* writes the reports in OneTrainer's workspace (``<workspace_dir>/precision``), watches the
  first optimizer steps for lost updates and arms the non-finite blame on a NaN loss, as the
  Trainer path does;
* wraps the model sampler's ``sample``: modules OneTrainer builds *inside* a sampling call (the
  inpainting sampler's erode ``Conv2d``, fp32, made anew on every call) are reached through
  torch's global forward pre-hook, registered for that call only (:func:`reach_new_modules`);
* prints one line: the policy, in OneTrainer's words where it came from them, what the fp32
  trained weights cost in memory, how to opt out, and where the reports go.

>>> from types import SimpleNamespace as NS
>>> fp16, fp32 = NS(name="FLOAT_16"), NS(name="FLOAT_32")  # OneTrainer's DataType members
>>> cfg = NS(train_dtype=fp16, unet=NS(weight_dtype=fp16), vae=NS(weight_dtype=fp32))
>>> p = policy_from_config(cfg, ("unet", "vae"))
>>> p.name, p.trainable_dtype, p.group_dtypes["vae"]
('fp16', torch.float32, torch.float32)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import autostart
from ._patching import patch_class_in, wrap_method

logger = logging.getLogger("hf_precision")

#: the module the start-up hook waits for (:data:`.autostart.HOOKS`)
TARGET = "modules.trainer.GenericTrainer"
GUARD_ATTR = "_hf_precision_onetrainer"
TOOL = "OneTrainer"

#: OneTrainer's ``DataType`` names -> torch dtypes the guard may hold weights in (the others,
#: FLOAT_8, NFLOAT_4, GGUF..., belong to a quantization library: left as loaded)
DATA_TYPES: dict[str, torch.dtype] = {
    "FLOAT_32": torch.float32,
    "FLOAT_16": torch.float16,
    "BFLOAT_16": torch.bfloat16,
}
#: ``train_dtype`` -> the preset that means the same for a training run
TRAIN_PRESETS: dict[str, str] = {"FLOAT_16": "fp16", "BFLOAT_16": "bf16", "FLOAT_32": "fp32"}
#: OneTrainer model attribute -> (diffusion group, the config part holding its weight_dtype)
PARTS: dict[str, tuple[str, str]] = {
    "unet": ("unet", "unet"),
    "transformer": ("transformer", "transformer"),
    "text_encoder": ("text_encoder", "text_encoder"),
    "text_encoder_1": ("text_encoder", "text_encoder"),
    "text_encoder_2": ("text_encoder_2", "text_encoder_2"),
    "text_encoder_3": ("text_encoder_3", "text_encoder_3"),
    "vae": ("vae", "vae"),
}


# ----------------------------------------------------------------------- policy from words
def _words(value: Any) -> str:
    """``DataType.FLOAT_16`` (or its name) -> ``"FLOAT_16"``."""
    return str(getattr(value, "name", value)).rsplit(".", 1)[-1]


def parts_of(model: Any) -> dict[str, nn.Module]:
    """OneTrainer's model -> {diffusion group: module}, for the parts it holds."""
    found: dict[str, nn.Module] = {}
    for attr, (group, _) in PARTS.items():
        module = getattr(model, attr, None)
        if isinstance(module, nn.Module) and group not in found:
            found[group] = module
    return found


def _config_part(group: str) -> str:
    return next(part for g, part in PARTS.values() if g == group)


def policy_from_config(config: Any, groups: Any) -> Any:
    """The policy OneTrainer's config says: the preset of ``train_dtype`` (``fallback_train_dtype``
    when the first is no float type), each of ``groups``' ``weight_dtype`` as its group dtype."""
    from ..rules.policy.precision_policy import PrecisionPolicy

    train = _words(getattr(config, "train_dtype", "FLOAT_32"))
    if train not in TRAIN_PRESETS:
        train = _words(getattr(config, "fallback_train_dtype", "FLOAT_32"))
    preset = TRAIN_PRESETS.get(train, "fp32")
    dtypes = {}
    for group in groups:
        part = getattr(config, _config_part(group), None)
        dtype = DATA_TYPES.get(_words(getattr(part, "weight_dtype", None)))
        if dtype is not None:
            dtypes[group] = dtype
    return PrecisionPolicy.from_preset(preset).replace(group_dtypes=dtypes)


def _origin(config: Any) -> str:
    return f'from OneTrainer\'s "train_dtype": "{_words(config.train_dtype)}"'


# ----------------------------------------------------------------------- sampling scope
@contextlib.contextmanager
def reach_new_modules(known: Any, said: set[str]) -> Iterator[None]:
    """For the ``with`` body only: a module not in ``known`` (ids of the guarded models'
    modules) whose own weights have one floating dtype gets its floating positional inputs in
    that dtype (widened always; narrowed only when the values fit). Torch's global forward
    pre-hook is the one place that sees a module built inside the body (OneTrainer's erode
    conv). Each module kind bridged is said once (``said``)."""
    from ..rules.dtypes import dtype_name, narrows_range

    def hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
        if id(module) in known:
            return None
        own = {t.dtype for t in module.parameters(recurse=False) if t.is_floating_point()}
        if len(own) != 1:
            return None
        want = next(iter(own))
        out, changed = [], None
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != want:
                if narrows_range(a.dtype, want) and not _fits(a, want):
                    out.append(a)
                    continue
                changed = changed or a.dtype
                a = a.to(want)
            out.append(a)
        if changed is None:
            return None
        what = f"{type(module).__name__} ({dtype_name(want)} weights)"
        if what not in said:
            said.add(what)
            found(
                f"OneTrainer's sampler built a {what} during sampling and fed it "
                f"{dtype_name(changed)} input: the input was cast to {dtype_name(want)} "
                "(the guard's sampling hook; the module was built after the guard was set up)"
            )
        return tuple(out)

    handle = nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _fits(t: torch.Tensor, dtype: torch.dtype) -> bool:
    finite = t[torch.isfinite(t)]
    return finite.numel() == 0 or bool(finite.abs().max() <= torch.finfo(dtype).max)


def found(line: str) -> None:
    """Where this integration's findings go (one place: the findings channel takes it)."""
    logger.warning("hf-precision: %s", line)


# ----------------------------------------------------------------------- the trainer
def _trained_dtypes(parts: dict[str, nn.Module]) -> dict[int, torch.dtype]:
    return {id(p): p.dtype for m in parts.values() for p in m.parameters() if p.requires_grad}


def _cost_line(before: dict[int, torch.dtype], parts: dict[str, nn.Module]) -> str:
    """What holding the trained weights in float32 costs, and the opt-out in OneTrainer's words."""
    grown = 0
    for m in parts.values():
        for p in m.parameters():
            old = before.get(id(p))
            if old is not None and old.itemsize < p.dtype.itemsize:
                grown += p.numel() * (p.dtype.itemsize - old.itemsize)
    if not grown:
        return ""
    return (
        f"; trained weights held in float32 (+{grown / 2**20:.1f} MiB over their weight_dtype: "
        "AdamW's eps 1e-8 is 0 in float16 and a float16 fine-tune turns NaN); opt out: "
        '"train_dtype": "BFLOAT_16" (bf16, no overflow), train fewer parts ("unet": {"train": '
        'false}) or a LoRA ("training_method": "LORA"); keep float16 anyway: '
        "hf-precision run --policy fp16-true"
    )


def guard_trainer(trainer: Any) -> Any:
    """Guard a started ``GenericTrainer``'s models (see the module docstring); returns the
    :class:`~hf_precision.frontends.diffusion.DiffusionGuard`, also kept on the trainer."""
    from ..frontends.diffusion import guard_diffusion
    from ..report.reporter import PrecisionReporter
    from ..watch.blame import NonFiniteBlame
    from ..watch.lost_updates import watch
    from .launch_config import ENV_TOOL, LaunchConfig

    config = LaunchConfig.from_env()
    os.environ.setdefault(ENV_TOOL, TOOL)
    call = f"{autostart.ENV_GUARD}={config.policy!r}"
    config.check_blame(call=call)
    model, words = trainer.model, trainer.config
    parts = parts_of(model)
    if not parts:
        return None
    policy = config.resolved_policy(call=call)
    origin = None
    if policy is None:
        policy, origin = policy_from_config(words, parts), _origin(words)
    where = config.report_dir or os.path.join(
        getattr(words, "workspace_dir", None) or ".", "precision"
    )
    reporter = PrecisionReporter(where)
    before = _trained_dtypes(parts)
    optimizer = getattr(model, "optimizer", None)
    guard = guard_diffusion(
        parts,
        policy,
        mode=config.mode,  # type: ignore[arg-type]  # checked by LaunchConfig
        optimizer=optimizer,
        reporter=reporter,
    )
    setattr(trainer, GUARD_ATTR, guard)
    lead = next((g for g in ("unet", "transformer") if g in guard.guards), None)
    if optimizer is not None and lead is not None:
        watch(guard.guards[lead], optimizer, tool=TOOL)
    blames = [NonFiniteBlame(m, config.blame) for m in parts.values()]  # type: ignore[arg-type]
    _wrap_loss(trainer, blames, reporter)
    known = weakref.WeakValueDictionary(
        {id(sub): sub for m in parts.values() for sub in m.modules()}
    )
    _wrap_sampler(trainer, known)
    said = f", {origin}" if origin else ""
    print(
        f"hf-precision: precision guard on for OneTrainer's {type(model).__name__} "
        f"({', '.join(parts)}; launched by {config.tool or TOOL}, via {config.via}): policy "
        f"{policy.describe()}{said}{_cost_line(before, parts)}; reports in "
        f"{os.path.abspath(where)}{os.sep}; off: unset {autostart.ENV_GUARD}",
        file=sys.stderr,
        flush=True,
    )
    return guard


def _wrap_loss(trainer: Any, blames: list[Any], reporter: Any) -> None:
    """``model_setup.calculate_loss``: an armed blame reports the forward that just ran; a
    non-finite loss arms ``auto`` for the next step (one read of the loss, which OneTrainer
    reads itself right after)."""
    setup: Any = getattr(trainer, "model_setup", None)
    calc = getattr(setup, "calculate_loss", None)
    if calc is None:
        return
    steps = [0]

    @functools.wraps(calc)
    def calculate_loss(*args: Any, **kwargs: Any) -> Any:
        loss = calc(*args, **kwargs)
        steps[0] += 1
        for b in blames:
            if b.armed:
                finding = b.collect(step=steps[0])
                if finding is not None:
                    reporter.log_nonfinite(finding, step=steps[0])
        if any(b.mode == "auto" and not b.armed for b in blames):
            value = float(loss.detach().float().sum()) if isinstance(loss, torch.Tensor) else loss
            for b in blames:
                b.observe({"loss": value}, step=steps[0])
        return loss

    setup.calculate_loss = calculate_loss


def _wrap_sampler(trainer: Any, known: Any) -> None:
    sampler: Any = getattr(trainer, "model_sampler", None)
    sample = getattr(sampler, "sample", None)
    if sample is None:
        return
    said: set[str] = set()

    @functools.wraps(sample)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with reach_new_modules(known, said):
            return sample(*args, **kwargs)

    sampler.sample = wrapped


# ----------------------------------------------------------------------- the patch
def _wrap_start(start: Any) -> Any:
    @functools.wraps(start)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = start(self, *args, **kwargs)
        if autostart.enabled() and getattr(self, GUARD_ATTR, None) is None:
            guard_trainer(self)
        return result

    return wrapped


def patch_generic_trainer(cls: Any) -> bool:
    """Wrap ``GenericTrainer.start`` (idempotent); returns whether it patched."""
    return wrap_method(cls, "start", _wrap_start)


def patch_generic_trainer_module(module: Any) -> None:
    """What the import hook calls once ``modules.trainer.GenericTrainer`` is executed."""
    patch_class_in(module, "GenericTrainer", patch_generic_trainer)


__all__ = [
    "DATA_TYPES",
    "PARTS",
    "TARGET",
    "TRAIN_PRESETS",
    "guard_trainer",
    "parts_of",
    "patch_generic_trainer",
    "patch_generic_trainer_module",
    "policy_from_config",
    "reach_new_modules",
]
