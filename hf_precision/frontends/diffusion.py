"""Diffusion fine-tuning (diffusers, OneTrainer, kohya): text encoders, the denoiser and the VAE
as module groups, presets that keep the VAE in fp32, and batch rules for latents and timesteps.

Groups carry diffusers' component names: ``text_encoder``, ``text_encoder_2``,
``text_encoder_3``, ``unet``, ``transformer``, ``vae``. The registered rules find them with
:func:`~hf_precision.find_module_groups` on

* one model: a diffusers UNet or transformer, or any non-transformers module whose ``forward``
  takes ``timestep(s)`` (OneTrainer-style), is wholly ``unet``/``transformer``; a CLIP/T5 text
  encoder is wholly ``text_encoder``; a VAE is ``vae`` with ``encoder``, ``quant_conv``,
  ``post_quant_conv`` and ``decoder`` as extra roots, because ``vae.encode()``/``vae.decode()``
  never call ``vae.forward``: each entry point needs its own boundary guard;
* a module holding them as children named so (a training wrapper, :class:`DiffusionModules`);
* a ``DiffusionPipeline`` or a dict of components (not ``nn.Module``\\ s): use
  :func:`diffusion_modules` (an ``nn.ModuleDict`` adapter) or :func:`find_diffusion_groups`.

Presets (registered with :func:`~hf_precision.rules.policy.precision_policy.register_preset`):
``fp16-vae32`` / ``bf16-vae32`` — denoiser and text encoders half, trainable (LoRA) weights
fp32, the VAE fp32 (it overflows in fp16) with inputs cast into and out of it, leaf guards on
everywhere (diffusion code builds timestep embeddings and masks in fp32 inside ``forward``).

Batch rules (:data:`DIFFUSION_BATCH_RULES`), expressed with the policy's ``batch_key_groups``
and ``batch_skip_keys``, for batch keys and the denoiser's (named or positional) arguments:

=================================  =========================================================
``latents``, ``noise``,            compute dtype (the denoiser's); float masks keep their
``latent_mask``, ``sample``,       sentinels (``finfo.min``) instead of becoming ``-inf``
``encoder_hidden_states``, ...
``timestep``, ``timesteps``        never cast at the batch: integers stay integers; float
                                   timesteps keep fp32 for the sinusoidal embedding and are
                                   cast by the leaf guard of the first module with weights
                                   that consumes them (where the model expects its dtype)
``pixel_values``, ``images``       the VAE's dtype (fp32 under ``*-vae32``)
``target``, ``labels``             untouched
=================================  =========================================================

>>> from hf_precision import PrecisionPolicy, find_module_groups
>>> from hf_precision.tiny import OneTrainerTiny, onetrainer_batch
>>> model = OneTrainerTiny().requires_grad_(False)  # frozen: half; trainables stay fp32
>>> find_module_groups(model).paths
{'unet': ('',)}
>>> guard = guard_diffusion(model, "bf16-vae32")
>>> model(**onetrainer_batch()).sample.dtype  # fp32 latent_mask and time embedding fixed
torch.bfloat16
>>> guard.remove()
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.guard import PrecisionGuard
from ..engine.hooks import GuardHandle
from ..engine.records import EnforceReport
from ..errors import PrecisionWarning
from ..model.reporter import Reporter
from ..rules.dtypes import dtype_name, narrows_range
from ..rules.groups import diffusion as diffusion_rules
from ..rules.groups.diffusion import (
    component_groups,
    diffusion_batch_rules,
    diffusion_modules,
    pipeline_components,
    vae_overflow,
)
from ..rules.groups.module_groups import ModuleGroups, find_module_groups
from ..rules.policy.fields import Mode
from ..rules.policy.precision_policy import PrecisionPolicy


@dataclass
class DiffusionGuard:
    """What :func:`guard_diffusion` did, per component; :meth:`remove` takes the guards off."""

    policy: PrecisionPolicy
    groups: dict[str, ModuleGroups] = field(default_factory=dict)
    reports: dict[str, EnforceReport] = field(default_factory=dict)
    handles: dict[str, GuardHandle] = field(default_factory=dict)
    vae_overflow: list[tuple[str, float]] = field(default_factory=list)
    guards: dict[str, PrecisionGuard] = field(default_factory=dict)  # the engine per component

    def remove(self) -> None:
        for guard in self.guards.values():
            guard.teardown()

    def summary(self) -> str:
        lines = [f"guard_diffusion[{self.policy.describe()}]"]
        for name, report in self.reports.items():
            dts = {
                g: "/".join(sorted(dtype_name(d) for d in s))
                for g, s in report.group_dtypes.items()
            }
            lines.append(
                f"  {name:<15} {dts} cast {len(report.changes)}, guards {self.handles[name].count}"
            )
        lines += [f"  vae kept fp32: {n} max |value| {v:g}" for n, v in self.vae_overflow[:5]]
        return "\n".join(lines)

    __str__ = summary


def guard_diffusion(
    obj: Any,
    policy: PrecisionPolicy | str | None = None,
    *,
    mode: Mode | None = None,
    optimizer: Any = None,
    vae_images: torch.Tensor | None = None,
    reporter: Reporter | None = None,
    event: str = "setup",
    step: int = 0,
) -> DiffusionGuard:
    """Enforce ``policy`` on every model of a pipeline, dict of components or single model,
    and install the guards, each component as its own root (so the denoiser's guard is the
    key-aware batch guard). The diffusion batch rules are added to ``policy``. The guards send
    inputs to the device each model's weights are on at the call, so offloading (moving a
    model between CPU and GPU between steps) needs no new call.

    When the policy puts the VAE in fp16 and its weights (or, given ``vae_images``, its
    activations) exceed the fp16 range, the VAE is kept in fp32 with a
    :class:`PrecisionWarning`; guards cast into and out of it.

    ``reporter`` (a :class:`~hf_precision.report.reporter.PrecisionReporter`) writes each
    component's
    dtype map as the callback's do (``<report_dir>/<step>-<event>.json``, ``precision.log``,
    W&B); ``event`` names it (the launcher uses ``validation_pipeline``), ``step`` the training
    step it happens at.

    >>> from hf_precision.tiny import OneTrainerTiny
    >>> guard = guard_diffusion({"unet": OneTrainerTiny().requires_grad_(False)}, "fp16-vae32")
    >>> guard.reports["unet"].group_dtypes
    {'unet': {torch.float16}}
    >>> guard.remove()
    """
    comps = pipeline_components(obj, "guard_diffusion")
    if policy is None:
        policy = PrecisionPolicy.resolve(None, diffusion_modules(comps))
    policy = diffusion_batch_rules(PrecisionPolicy.resolve(policy))
    out = DiffusionGuard(policy)
    for name, module in comps.items():
        groups = find_module_groups(module) if name == "model" else component_groups(name, module)
        p = _component_policy(name, groups, policy, mode, vae_images, out)
        # one-shot (no later events): a new guard_diffusion call replaces this one, no claim
        guard = PrecisionGuard(
            module, p, name="guard_diffusion", groups=groups, claim=False, reporter=reporter
        )
        ev = event if len(comps) == 1 else f"{event}-{name}"
        report = guard.verify(ev, optimizer=optimizer, step=step)
        out.guards[name], out.groups[name], out.reports[name] = guard, groups, report
        assert guard.handle is not None
        out.handles[name] = guard.handle
    return out


def _component_policy(
    name: str,
    groups: ModuleGroups,
    policy: PrecisionPolicy,
    mode: Mode | None,
    vae_images: torch.Tensor | None,
    out: DiffusionGuard,
) -> PrecisionPolicy:
    """The pipeline's policy as one component sees it: an overflowing fp16 VAE kept in fp32
    (said in a warning at guard_diffusion's caller), a VAE's compute dtype its own, ``mode``,
    and only the group dtypes of the component's own groups."""
    p = policy
    if "vae" in groups and narrows_range(torch.float32, policy.group_dtype("vae")):
        vae = groups.modules("vae")[0]  # the VAE itself: paths[0] is "" or "vae"
        hits = vae_overflow(vae, vae_images, dtype=policy.group_dtype("vae"))
        if hits:
            out.vae_overflow = hits
            p = dataclasses.replace(
                policy, group_dtypes={**policy.group_dtypes, "vae": torch.float32}
            )
            listed = ", ".join(f"{n} ({v:g})" for n, v in hits[:3])
            warnings.warn(
                f"guard_diffusion: the VAE ({name!r}) leaves the "
                f"{dtype_name(policy.group_dtype('vae'))} range (±"
                f"{torch.finfo(policy.group_dtype('vae')).max:g}) at {len(hits)} place(s): "
                f"{listed}; the VAE is kept in float32 and the guards cast into and out of "
                "it. Fix: use the 'fp16-vae32' preset or group_dtypes={'vae': 'fp32'} to "
                "say so explicitly.",
                PrecisionWarning,
                stacklevel=3,  # guard_diffusion's caller
            )
    if groups.names == ("vae",):
        # vae(x) enters through the batch guard: x follows the VAE, not the denoiser, so an
        # fp32 VAE never sees inputs rounded to half on the way in.
        p = dataclasses.replace(p, compute_dtype=p.group_dtype("vae"))
    if mode is not None:
        p = p.replace(mode=mode)
    # one policy for the pipeline: each component sees the group dtypes of its own groups
    own = {g: d for g, d in p.group_dtypes.items() if g in groups.names}
    if own != p.group_dtypes:
        p = dataclasses.replace(p, group_dtypes=own)
    return p


def _main_dtype(module: torch.nn.Module) -> torch.dtype | None:
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def loaded_policy(mixed_precision: str | None, comps: dict[str, Any]) -> PrecisionPolicy:
    """The policy for pipeline components *as loaded* (validation and inference pipelines):
    each diffusion component's weights keep the dtype they have (a bf16 text encoder under
    bf16 stays bf16, an fp32 VAE beside a bf16 UNet stays fp32: nothing is cast up or down),
    activations run in the denoiser's dtype and the guards make inputs follow each component.
    ``mixed_precision`` (the accelerator's: ``bf16``/``fp16``/``no``) names the preset the
    policy is described by; without one, the denoiser's dtype does.

    >>> import torch
    >>> from hf_precision.tiny import OneTrainerTiny
    >>> p = loaded_policy("bf16", {"unet": OneTrainerTiny(torch.bfloat16), "vae": OneTrainerTiny()})
    >>> p.compute_dtype, p.group_dtype("vae")
    (torch.bfloat16, torch.float32)
    """
    dtypes = {n: d for n, m in comps.items() if (d := _main_dtype(m)) is not None}
    lead = next((dtypes[n] for n in diffusion_rules.DENOISER_GROUPS if n in dtypes), None)
    lead = lead or next(iter(dtypes.values()), torch.float32)
    preset = {"bf16": "bf16", "fp16": "fp16"}.get(str(mixed_precision or "no"))
    if preset is None:
        preset = {torch.bfloat16: "bf16-true", torch.float16: "fp16-true"}.get(lead, "fp32")
    groups = {n: d for n, d in dtypes.items() if n in diffusion_rules.DIFFUSION_GROUPS}
    return PrecisionPolicy.from_preset(preset).replace(
        compute_dtype=lead, frozen_dtype=lead, trainable_dtype=None, group_dtypes=groups
    )


__all__ = ["DiffusionGuard", "guard_diffusion", "loaded_policy"]
