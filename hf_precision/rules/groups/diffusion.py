"""Diffusion groups, recognition, rules, batch rules and presets: what
:mod:`hf_precision.frontends.diffusion` documents, without its guard (so
:mod:`hf_precision.rules` registers them, after the built-in group rules, whenever it is first
imported, with nothing of the engine loaded).

Registers the groups ``text_encoder``, ``text_encoder_2``, ``text_encoder_3``, ``unet``,
``transformer``, ``vae``, the rules that find them, and the ``fp16-vae32`` / ``bf16-vae32``
presets; imports no diffusers.

>>> from hf_precision.rules.groups.diffusion import DIFFUSION_GROUPS, denoiser_kind
>>> DIFFUSION_GROUPS[-1], denoiser_kind(object())
('vae', None)
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...base.wrapper_kinds import unwrap_model
from ...errors import PrecisionError, PrecisionWarning
from ..batch_keys import DEFAULT_KEY_GROUPS, DEFAULT_SKIP_KEYS, TIMESTEP_KEYS
from ..dtypes import is_castable
from ..policy.precision_policy import PrecisionPolicy, register_preset
from ..policy.presets import PRESETS
from .group_rule import GroupRule, register_group
from .module_groups import ModuleGroups, find_module_groups
from .registry import group_rules, register_group_rule

TEXT_ENCODER_GROUPS: tuple[str, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3")
DENOISER_GROUPS: tuple[str, ...] = ("unet", "transformer")
DIFFUSION_GROUPS: tuple[str, ...] = (*TEXT_ENCODER_GROUPS, *DENOISER_GROUPS, "vae")
#: Children of a VAE that ``encode()`` / ``decode()`` call directly.
VAE_ENTRY_POINTS: tuple[str, ...] = ("encoder", "quant_conv", "post_quant_conv", "decoder")
#: Batch keys that follow the VAE's dtype (images are encoded by it).
DIFFUSION_KEY_GROUPS: dict[str, str] = {"pixel_values": "vae", "images": "vae", "image": "vae"}
#: What the diffusion presets do with each batch key (documentation and tests).
DIFFUSION_BATCH_RULES: dict[str, str] = {
    **{
        k: "compute dtype"
        for k in (
            "latents",
            "noisy_latents",
            "sample",
            "noise",
            "latent_mask",
            "encoder_hidden_states",
            "pooled_projections",
            "added_cond_kwargs",
        )
    },
    **{k: "untouched at the batch (leaf guard casts at the consumer)" for k in TIMESTEP_KEYS},
    **{k: "vae dtype" for k in DIFFUSION_KEY_GROUPS},
    **{k: "untouched" for k in DEFAULT_SKIP_KEYS},
}
_TEXT_ENCODER_CLASSES = frozenset(
    {"CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel", "UMT5EncoderModel"}
)

# Denoisers make their sinusoidal timestep embedding in fp32 inside forward: leaf guards there.
for _group in DIFFUSION_GROUPS:
    register_group(_group, leaf_guarded=_group in ("unet", "transformer"))

#: A LoRA network trained as its own module beside a frozen denoiser (kohya sd-scripts'
#: ``networks.lora.LoRANetwork`` and its siblings): its own group, so its weights are reported
#: and kept apart from the UNet's. Built in, so the registries are the same whatever a process
#: imports (the sd-scripts adapter, :mod:`hf_precision.integrations.kohya`, reads it).
LORA_NETWORK = register_group("lora_network")


def is_lora_network(module: Any) -> bool:
    """A network of sd-scripts' ``networks`` package (``LoRANetwork`` and its siblings), read by
    its class's module and name (nothing imported)."""
    cls = type(module)
    return cls.__module__.split(".")[0] == "networks" and cls.__name__.endswith("Network")


# ------------------------------------------------------------------------------ recognition


def _lib(m: object) -> str:
    return type(m).__module__.split(".", 1)[0]


def denoiser_kind(module: object) -> str | None:
    """``"unet"``, ``"transformer"`` or ``None``: diffusers by package path; other modules
    (not transformers models) when ``forward`` takes ``timestep``/``timesteps``."""
    if not isinstance(module, nn.Module):
        return None
    path, cls = type(module).__module__, type(module).__name__
    if path.startswith("diffusers."):
        if ".unets." in path:
            return "unet"
        return "transformer" if ".transformers." in path else None
    if _lib(module) in ("transformers", "torch", "peft"):
        return None
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    if not any(k in params for k in TIMESTEP_KEYS):
        return None
    return "transformer" if re.search(r"Transformer|DiT|transformer", cls) else "unet"


def is_vae(module: object) -> bool:
    """A diffusers autoencoder, or a module with ``encode``/``decode`` methods and
    ``encoder``/``decoder`` children (not a transformers seq2seq model)."""
    if not isinstance(module, nn.Module) or _lib(module) in ("transformers", "torch"):
        return False
    if type(module).__module__.startswith("diffusers.models.autoencoders"):
        return True
    return (
        callable(getattr(module, "encode", None))
        and callable(getattr(module, "decode", None))
        and isinstance(module._modules.get("encoder"), nn.Module)
        and isinstance(module._modules.get("decoder"), nn.Module)
    )


def is_text_encoder(module: nn.Module) -> bool:
    """A text encoder of a diffusion pipeline (CLIP, T5, ... by class name)."""
    return type(module).__name__ in _TEXT_ENCODER_CLASSES


_is_text_encoder = is_text_encoder


class DiffusionModules(nn.ModuleDict):
    """A pipeline's ``nn.Module`` components as one module (no ``forward``), so
    :func:`find_module_groups`, :func:`dtype_map` and :func:`enforce_policy` see them together.
    The modules are shared, not copied: casting here casts the pipeline's.

    >>> from hf_precision.tiny import OneTrainerTiny
    >>> find_module_groups(DiffusionModules({"unet": OneTrainerTiny()})).paths
    {'unet': ('unet',)}
    """


def _is_container(module: nn.Module) -> bool:
    if isinstance(module, DiffusionModules):
        return True
    # A training wrapper may take timesteps itself; a diffusers model is never a container.
    if type(module).__module__.startswith("diffusers.") or is_vae(module):
        return False
    kids = [module._modules.get(k) for k in DENOISER_GROUPS]
    return any(denoiser_kind(unwrap_model(k)[0]) for k in kids if k is not None) or is_vae(
        module._modules.get("vae")
    )


_RULES = (
    GroupRule(
        "diffusion_components",
        required=(),
        match=_is_container,
        paths={**{g: (g,) for g in (*TEXT_ENCODER_GROUPS, *DENOISER_GROUPS)}, "vae": ("vae",)},
        extra={"vae": tuple(f"vae.{p}" for p in VAE_ENTRY_POINTS)},
    ),
    GroupRule(
        "diffusion_unet",
        required=(),
        paths={"unet": ("",)},
        match=lambda m: denoiser_kind(m) == "unet",
    ),
    GroupRule(
        "diffusion_transformer",
        required=(),
        paths={"transformer": ("",)},
        match=lambda m: denoiser_kind(m) == "transformer",
    ),
    GroupRule(
        "diffusion_vae",
        required=(),
        paths={"vae": ("",)},
        extra={"vae": VAE_ENTRY_POINTS},
        match=is_vae,
    ),
    GroupRule(
        "diffusion_text_encoder", required=(), paths={"text_encoder": ("",)}, match=_is_text_encoder
    ),
)
_known = {r.name for r in group_rules()}
for _rule in _RULES:
    if _rule.name not in _known:
        register_group_rule(_rule)
if "diffusion_lora_network" not in _known:  # first: a network matches before any model rule
    register_group_rule(
        GroupRule(
            "diffusion_lora_network",
            required=(LORA_NETWORK,),
            paths={LORA_NETWORK: ("",)},
            match=is_lora_network,
            note="kohya sd-scripts' LoRA networks (networks.lora, lora_flux, lora_sd3, ...)",
        ),
        first=True,
    )


def pipeline_components(obj: Any, call: str = "find_diffusion_groups") -> dict[str, nn.Module]:
    """name -> module for a pipeline (``.components``), a mapping, or a module."""
    if isinstance(obj, nn.Module):
        return dict(obj.items()) if isinstance(obj, DiffusionModules) else {"model": obj}
    comps = getattr(obj, "components", None) if not isinstance(obj, Mapping) else obj
    if not isinstance(comps, Mapping):
        raise PrecisionError(
            f"{call}({type(obj).__name__}): expected a DiffusionPipeline, a dict "
            "of components or an nn.Module. Fix: pass the pipeline itself, "
            "{'unet': unet, 'vae': vae, 'text_encoder': text_encoder}, or one model."
        )
    out = {str(k): v for k, v in comps.items() if isinstance(v, nn.Module)}
    if not out:
        raise PrecisionError(
            f"{call}(...): no nn.Module among the components {sorted(comps)}. "
            "Fix: pass the models (unet/transformer, vae, text encoders)."
        )
    return out


def diffusion_modules(obj: Any) -> DiffusionModules:
    """The ``nn.Module`` components of a pipeline or dict as one :class:`DiffusionModules`
    (schedulers, tokenizers and ``None`` entries are left out)."""
    if isinstance(obj, DiffusionModules):
        return obj
    if isinstance(obj, nn.Module):
        kind = denoiser_kind(unwrap_model(obj)[0])
        name = kind or (
            "vae" if is_vae(obj) else "text_encoder" if _is_text_encoder(obj) else "model"
        )
        return DiffusionModules({name: obj})
    return DiffusionModules(pipeline_components(obj))


def find_diffusion_groups(obj: Any) -> ModuleGroups:
    """Groups of a diffusion model, a dict of components or a ``DiffusionPipeline``.

    A model goes to :func:`find_module_groups`; a pipeline or dict is first gathered into a
    :class:`DiffusionModules` (then ``groups.root``), with paths such as ``unet`` and
    ``vae.decoder``.
    """
    root = obj if isinstance(obj, nn.Module) else diffusion_modules(obj)
    return find_module_groups(root)


def component_groups(name: str, module: nn.Module) -> ModuleGroups:
    """Groups of one pipeline component: a key naming a diffusion group decides the group
    (``text_encoder_2`` is a ``CLIPTextModelWithProjection``); other components (controlnet,
    image_encoder, safety_checker) keep what :func:`find_module_groups` finds, else ``other``."""
    root, prefix = unwrap_model(module)
    if name in DIFFUSION_GROUPS:
        paths: tuple[str, ...] = ("",)
        if name == "vae":
            paths += tuple(
                p for p in VAE_ENTRY_POINTS if isinstance(root._modules.get(p), nn.Module)
            )
        return ModuleGroups(root, {name: paths}, {}, f"diffusion_component({name})", prefix=prefix)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)  # "no groups": fine for extras
        return find_module_groups(module)


# ------------------------------------------------------------------------------ policies


def diffusion_batch_rules(policy: PrecisionPolicy | str) -> PrecisionPolicy:
    """A copy of ``policy`` with the diffusion batch rules added: timesteps skipped at the
    batch, ``pixel_values``/``images`` following the VAE."""
    policy = PrecisionPolicy.resolve(policy)
    skip = policy.batch_skip_keys + tuple(
        k for k in TIMESTEP_KEYS if k not in policy.batch_skip_keys
    )
    keys = {**policy.batch_key_groups}
    for k, g in DIFFUSION_KEY_GROUPS.items():
        if keys.get(k) in (None, DEFAULT_KEY_GROUPS.get(k)):
            keys[k] = g
    return dataclasses.replace(policy, batch_skip_keys=skip, batch_key_groups=keys)


def vae_overflow(
    vae: nn.Module, images: torch.Tensor | None = None, *, dtype: torch.dtype = torch.float16
) -> list[tuple[str, float]]:
    """Where the VAE leaves the ``dtype`` range: parameters beyond it and, given ``images``,
    module outputs of an ``encode -> decode`` round trip (run as the VAE is, without grad).

    Returns ``[(name, max |value|)]`` (parameters, then modules in the order their outputs
    overflowed: the first is where it starts), empty when everything fits.
    """
    limit = torch.finfo(dtype).max
    amax = {
        n: float(p.detach().abs().amax())
        for n, p in vae.named_parameters()
        if is_castable(p) and p.numel()
    }
    hits = [(n, v) for n, v in amax.items() if not v <= limit]  # NaN counts as out of range
    if images is None:
        return hits
    found: dict[str, float] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            t = out if isinstance(out, torch.Tensor) else getattr(out, "sample", None)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                top = float(t.detach().abs().amax())
                if not top <= limit:
                    found.setdefault(name, top)

        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in vae.named_modules() if n]
    try:
        ref = next((p for p in vae.parameters() if is_castable(p)), None)
        x = images if ref is None else images.to(ref.device, ref.dtype)
        encode: Any = vae.encode  # an nn.Module attribute as far as mypy knows
        decode: Any = vae.decode
        with torch.no_grad():
            enc = encode(x)
            dist = getattr(enc, "latent_dist", None)
            z = dist.mode() if dist is not None else getattr(enc, "latents", enc)
            decode(z[0] if isinstance(z, tuple) else z)
    finally:
        for h in handles:
            h.remove()
    return hits + list(found.items())  # forward order: the first module is where it starts


_HALF_HELP = (
    "diffusion: denoiser and text encoders {h}, trainable (LoRA) weights fp32, VAE "
    "fp32 with casts into and out of it; timesteps never cast at the batch"
)
for _name, _half in (("fp16-vae32", torch.float16), ("bf16-vae32", torch.bfloat16)):
    if _name not in PRESETS:
        register_preset(
            _name,
            _half,
            _half,
            torch.float32,
            _HALF_HELP.format(h=_name[:4]),
            group_dtypes={"vae": "fp32"},
            leaf_guards="on",
            batch_skip_keys=DEFAULT_SKIP_KEYS + TIMESTEP_KEYS,
            batch_key_groups={**DEFAULT_KEY_GROUPS, **DIFFUSION_KEY_GROUPS},
        )

__all__ = [
    "DENOISER_GROUPS",
    "DIFFUSION_BATCH_RULES",
    "DIFFUSION_GROUPS",
    "DIFFUSION_KEY_GROUPS",
    "TEXT_ENCODER_GROUPS",
    "VAE_ENTRY_POINTS",
    "DiffusionModules",
    "component_groups",
    "denoiser_kind",
    "diffusion_batch_rules",
    "diffusion_modules",
    "find_diffusion_groups",
    "is_vae",
    "vae_overflow",
]
