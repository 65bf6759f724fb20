"""The launcher in a plain accelerate loop: ``Accelerator.prepare`` runs through the plugin.

diffusers' example training scripts, kohya-style scripts and custom loops build an
``accelerate.Accelerator`` and never a ``transformers.Trainer``. Under ``hf-precision run`` (or
``HF_PRECISION_GUARD``) the start-up hook (:mod:`.autostart`) hands ``accelerate.accelerator`` to
:func:`patch_accelerator_module` when the script imports it, which wraps:

* ``Accelerator.__init__``: an accelerator built inside a ``Trainer.__init__`` is the Trainer's
  (the Trainer path, :mod:`.launcher`, guards it: one guard, not two); any other becomes the
  process's *current* accelerator, and ``from_pretrained`` of diffusers' ``ModelMixin``,
  transformers' ``PreTrainedModel`` and ``DiffusionPipeline`` is wrapped (once) to track the
  models the process builds;
* ``Accelerator.prepare``: the models passed go through a
  :class:`~hf_precision.PrecisionGuardPlugin` (one per accelerator, policy from its
  ``mixed_precision``: under bf16/fp16 the trainable weights become fp32, so a LoRA trained in
  bf16 no longer rounds its updates away), reports in ``<project_dir>/precision``; an optimizer
  prepared on its own after the model goes through it too. The plugin runs the lost-update check
  (:mod:`hf_precision.watch.lost_updates`) on the optimizer's first steps, as the Trainer path
  does: the ``lost_updates`` section and event give the share of sampled elements each step left
  unchanged, and where the trainable weights stay in half precision (``--mode audit``,
  ``--policy bf16-true``) and lose updates, one warning with the fix in the launcher's flags. A
  prepare with fp16 on a CPU (no fp16 autocast, no GradScaler there) is refused before anything
  is cast, with the fix;
* ``Accelerator.accumulate`` / ``backward``: the first call after a prepare (the loop's start:
  scripts cast their VAE and text encoders to ``weight_dtype`` after prepare) guards the models
  built with ``from_pretrained`` that nothing guards yet (VAE, text and image encoders, EMA
  models), as loaded: :func:`guard_held`, one report event ``held_models`` per model;
* ``DiffusionPipeline.from_pretrained`` (validation and final inference): the pipeline's
  components not already guarded get :func:`~hf_precision.guard_diffusion` with the policy the
  accelerator implies and each component's dtype *as loaded* (nothing is cast up or down; the
  guards make inputs follow each component: an fp32 UNet's latents into a bf16 VAE), one report
  event ``validation_pipeline`` per pipeline. A pipeline loaded before the first prepare (kohya's
  sd-scripts load their models through one) makes the plugin then, and is reported as the first
  events, ``load_pipeline``.

A tool with its own loop (:data:`.framework_runs.DETECTORS`: kohya's sd-scripts) is recognised
when the plugin is made: its output folder takes the reports, its flags are the inferred
policy's source and the flag the guard undoes is named, its batch keys are registered, and a run
that cannot work is refused (:class:`.framework_runs.FrameworkRun`).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import weakref
from typing import Any

from . import autostart, framework_runs
from ._patching import WRAPPED_ATTR, is_wrapped, patch_class_in, unwrap_methods, wrap_method

#: set on an ``Accelerator`` a ``Trainer`` built (its prepare passes straight through)
TRAINER_ATTR = "_hf_precision_trainer_accelerator"
PLUGIN_ATTR = "_hf_precision_plugin"
PIPELINE_EVENT = "validation_pipeline"
LOAD_EVENT = "load_pipeline"
HELD_EVENT = "held_models"
_PENDING_ATTR = "_hf_precision_held_pending"

_state = threading.local()
_current: list[Any] = []  # weakref to the current (non-Trainer) accelerator
#: models built with ``from_pretrained`` in this process (held, prepared or not)
tracked: weakref.WeakSet[Any] = weakref.WeakSet()


def current_accelerator() -> Any:
    """The last ``Accelerator`` built outside a Trainer in this process, or ``None``."""
    return _current[0]() if _current else None


def built_by_trainer() -> bool:
    """Whether the ``Accelerator`` being built is a ``Trainer``'s: inside the launcher's
    ``Trainer.__init__`` wrapper, or called from a Trainer method (its ``__init__`` and its
    hyper-parameter search both build one through ``create_accelerator_and_postprocess``)."""
    from . import launcher

    if getattr(launcher._state, "depth", 0):
        return True
    trainer_mod = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(trainer_mod, "Trainer", None)
    frame: Any = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        owner = frame.f_locals.get("self")
        if trainer_cls is not None and isinstance(owner, trainer_cls):
            return True
        frame = frame.f_back
    return False


# ----------------------------------------------------------------------- Accelerator
def _wrap_init(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if not autostart.enabled():
            return
        if built_by_trainer():
            setattr(self, TRAINER_ATTR, True)
            return
        _current[:] = [weakref.ref(self)]
        track_models()

    return __init__


def _wrap_prepare(prepare: Any) -> Any:
    @functools.wraps(prepare)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            getattr(_state, "depth", 0)
            or not autostart.enabled()
            or getattr(self, TRAINER_ATTR, False)
            or not _guards_any(self, args)
        ):
            return prepare(self, *args, **kwargs)
        plugin = plugin_for(self)
        _state.depth = 1
        try:
            result = plugin.prepare(self, *args, **kwargs)
        finally:
            _state.depth = 0
        # the models the script holds but did not pass (VAE, text encoders, EMA) are guarded
        # when the loop starts: scripts cast them to `weight_dtype` after prepare
        setattr(self, _PENDING_ATTR, True)
        return result

    wrapped.__signature__ = inspect.signature(prepare)  # type: ignore[attr-defined]
    return wrapped


def _guards_any(accelerator: Any, objects: tuple[Any, ...]) -> bool:
    """Whether the plugin takes this prepare: it holds a model, or an optimizer prepared on its
    own after the plugin guards a model (its step hooks and the lost-update check)."""
    import torch
    from torch import nn

    if any(isinstance(o, nn.Module) for o in objects):
        return True
    plugin = getattr(accelerator, PLUGIN_ATTR, None)
    return (
        plugin is not None
        and bool(plugin.guards)
        and any(isinstance(o, torch.optim.Optimizer) for o in objects)
    )


def _wrap_loop_start(method: Any) -> Any:
    """``accumulate`` / ``backward``: the first call after a prepare guards the held models."""

    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, _PENDING_ATTR, False):
            setattr(self, _PENDING_ATTR, False)
            guard_held(self)
        return method(self, *args, **kwargs)

    return wrapped


def plugin_for(accelerator: Any) -> Any:
    """The accelerator's launched :class:`~hf_precision.PrecisionGuardPlugin` (made once)."""
    plugin = getattr(accelerator, PLUGIN_ATTR, None)
    if plugin is not None:
        return plugin
    from ..frontends.accelerate_plugin import PrecisionGuardPlugin
    from .launch_config import ENV_MODE, ENV_TOOL, LaunchConfig, tool_name

    config = LaunchConfig.from_env()
    if config.tool is None:
        os.environ.setdefault(ENV_TOOL, tool_name(sys.argv))
    refuse_cpu_fp16(accelerator, config)
    run = framework_runs.detect(accelerator)  # a tool with its own loop (kohya's sd-scripts)
    if run is not None and run.refusal:
        from ..errors import PrecisionError

        raise PrecisionError(run.refusal)
    call = f"{autostart.ENV_GUARD}={config.policy!r}"
    config.check_blame(call=call)
    policy = config.resolved_policy(call=call)
    report_dir = config.report_dir or (run.report_dir() if run is not None else None)
    plugin = PrecisionGuardPlugin(
        policy,
        mode=config.mode,  # type: ignore[arg-type]  # checked by LaunchConfig.check
        report_dir=report_dir,
        blame=config.blame,  # type: ignore[arg-type]
        # an inferred policy gets the --keep-fp32 patterns at prepare (a given one has them)
        keep_fp32=config.keep_fp32 if policy is None else (),
    )
    plugin.reporter = _reporter(accelerator, report_dir)
    plugin.lost_updates_fix = (
        f"the guard's bf16 policy in mode fix (hf-precision run --policy bf16 --mode fix, or "
        f"{autostart.ENV_GUARD}=bf16 {ENV_MODE}=fix): it holds trainable weights in float32 "
        "and computes in bf16"
    )
    undone = run is not None and _adopt(accelerator, plugin, run, config, policy)
    setattr(accelerator, PLUGIN_ATTR, plugin)
    _announce(accelerator, plugin, config, run, report_dir, undone)
    return plugin


def _adopt(accelerator: Any, plugin: Any, run: Any, config: Any, policy: Any) -> bool:
    """The tool's words for the plugin: its batch keys and flags registered, the flags its
    inferred policy follows, the tool's own fix first; returns whether the guard undoes one of
    the tool's flags (it holds trainable weights in float32, in mode fix)."""
    import torch

    run.register()
    plugin.tool = run.tool
    undone = bool(run.undone) and config.mode != "audit"
    undone = undone and (policy is None or policy.trainable_dtype == torch.float32)
    plugin.said_as = run.said if undone else _without_undone(run)
    if run.own_fix:
        plugin.lost_updates_fix = f"{run.own_fix}; or {plugin.lost_updates_fix}"
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    plugin.sections["provenance"] = run.provenance(mp)
    return undone


def _without_undone(run: Any) -> str:
    """:attr:`FrameworkRun.said` without the flags the guard does not undo here."""
    from dataclasses import replace

    return str(replace(run, undone=()).said)


def has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _reporter(accelerator: Any, report_dir: str | None) -> Any:
    """The plugin's reporter; the picture only where matplotlib is installed: nobody asked the
    launcher for one, so its absence is no warning (a reporter asked for a picture says it once)."""
    from ..report.reporter import PrecisionReporter

    reporter = PrecisionReporter.from_accelerator(accelerator, report_dir=report_dir)
    reporter.picture = reporter.picture and has_matplotlib()
    return reporter


def refuse_cpu_fp16(accelerator: Any, config: Any) -> None:
    """fp16 mixed precision on a CPU: accelerate runs no fp16 autocast and no GradScaler there,
    so half and float weights meet in every layer (``mat1 and mat2 must have the same dtype``),
    fp16 LoRA weights turn NaN and the scripts' ``torch.autocast('cpu')`` validation runs in
    bf16 against fp16 weights. Refused before anything is cast or trained."""
    from ..errors import PrecisionError

    device = str(getattr(accelerator, "device", "cpu"))
    if str(getattr(accelerator, "mixed_precision", "no")) != "fp16" or device != "cpu":
        return
    from .launch_config import tool_name

    tool = config.tool or tool_name(sys.argv)
    raise PrecisionError(
        f"hf-precision ({config.via}): {tool} runs with Accelerator(mixed_precision='fp16') on "
        "a CPU: accelerate has no float16 autocast and no GradScaler there, so float16 and "
        "float32 weights meet unguarded (float16 LoRA weights turn NaN; validation under "
        "torch.autocast('cpu') runs in bfloat16 against float16 weights). Nothing was cast "
        "or trained.\nFix: --mixed_precision bf16 (or --mixed_precision no) on a CPU; fp16 "
        "needs a GPU."
    )


def _announce(
    accelerator: Any,
    plugin: Any,
    config: Any,
    run: Any = None,
    report_dir: str | None = None,
    undone: bool = False,
) -> None:
    if not getattr(accelerator, "is_main_process", True):
        return
    from .launch_config import tool_name

    where = report_dir or os.path.join(
        getattr(accelerator, "project_dir", None) or ".", "precision"
    )
    policy = plugin.policy.describe() if plugin.policy is not None else "inferred at prepare"
    who = (
        f"Accelerator(mixed_precision={accelerator.mixed_precision!r}) (launched by "
        f"{config.tool or tool_name(sys.argv)}, via {config.via})"
    )
    if run is not None:  # the tool's program and its flags, as typed
        from ..watch.provenance import typed_words

        who = f"{run.program} {typed_words(run.settings)} (via {config.via})"
        policy += "".join(f"; {u}" for u in (*run.notes, *(run.undone if undone else ())))
    print(
        f"hf-precision: precision guard on for {who}: policy {policy}; reports in "
        f"{os.path.abspath(where)}{os.sep}; off: unset {autostart.ENV_GUARD}",
        file=sys.stderr,
        flush=True,
    )


# ----------------------------------------------------------------------- models and pipelines
def _wrap_classmethod(cls: Any, after: Any) -> None:
    method = cls.__dict__.get("from_pretrained")
    if method is None or is_wrapped(getattr(method, "__func__", None)):
        return
    func = method.__func__

    @functools.wraps(func)
    def from_pretrained(klass: Any, *args: Any, **kwargs: Any) -> Any:
        obj = func(klass, *args, **kwargs)
        if autostart.enabled():
            after(obj)
        return obj

    setattr(from_pretrained, WRAPPED_ATTR, True)
    cls.from_pretrained = classmethod(from_pretrained)


def track_models() -> None:
    """Wrap ``from_pretrained`` of the model and pipeline classes of the libraries already
    imported (idempotent): models are tracked, pipelines guarded."""
    if "diffusers" in sys.modules:
        from diffusers import DiffusionPipeline, ModelMixin

        _wrap_classmethod(ModelMixin, tracked.add)
        _wrap_classmethod(DiffusionPipeline, guard_pipeline)
    if "transformers" in sys.modules:
        from transformers import PreTrainedModel

        _wrap_classmethod(PreTrainedModel, tracked.add)


def guard_pipeline(pipeline: Any) -> Any:
    """:func:`~hf_precision.guard_diffusion` on the components of ``pipeline`` that no live
    guard holds, with the policy of the current accelerator and each component's dtype as
    loaded; returns the :class:`~hf_precision.frontends.diffusion.DiffusionGuard` (or ``None``)."""
    from ..base.wrapper_kinds import unwrap_model
    from ..engine.claims import claimed_by
    from ..rules.groups.diffusion import pipeline_components

    accelerator = current_accelerator()
    comps = {
        n: m
        for n, m in pipeline_components(pipeline, "hf-precision run").items()
        if claimed_by(unwrap_model(m)[0]) is None
    }
    if not comps:
        return None
    event = PIPELINE_EVENT
    if accelerator is not None and not getattr(plugin_for(accelerator), "guards", ()):
        # loaded before the first prepare (kohya loads its models through a pipeline): the
        # plugin and its reporter exist from now on, so its hooks are in the first events
        event = LOAD_EVENT
    guard = guard_as_loaded(comps, accelerator, event)
    pipeline.__dict__["_hf_precision_guard"] = guard
    return guard


def _component_name(module: Any, taken: dict[str, Any]) -> str:
    from ..rules.groups.diffusion import denoiser_kind, is_text_encoder, is_vae

    base = (
        "vae"
        if is_vae(module)
        else denoiser_kind(module)
        or ("text_encoder" if is_text_encoder(module) else type(module).__name__.lower())
    )
    name, i = base, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name


def guard_held(accelerator: Any) -> Any:
    """:func:`~hf_precision.guard_diffusion` on the models built with ``from_pretrained`` in
    this process that no live guard holds (the VAE, text encoders, image encoders, EMA models
    a script keeps beside what it prepared), each as loaded: inputs follow each model's dtype
    (an fp32 VAE beside a bf16 UNet gets its bf16 pixels in fp32); nothing is cast."""
    from ..base.wrapper_kinds import unwrap_model
    from ..engine.claims import claimed_by

    plugin = getattr(accelerator, PLUGIN_ATTR, None)
    inside = {
        id(m) for g in getattr(plugin, "guards", ()) for m in unwrap_model(g.model)[0].modules()
    }
    comps: dict[str, Any] = {}
    for model in list(tracked):
        root = unwrap_model(model)[0]
        if id(root) in inside or claimed_by(root) is not None:
            continue
        if any(p.is_floating_point() for p in root.parameters()):
            comps[_component_name(root, comps)] = root
    return guard_as_loaded(comps, accelerator, HELD_EVENT) if comps else None


def guard_as_loaded(comps: dict[str, Any], accelerator: Any, event: str) -> Any:
    """:func:`~hf_precision.guard_diffusion` on each component with its own
    :func:`~hf_precision.frontends.diffusion.loaded_policy` (it keeps its dtype; its inputs follow
    it), one report event ``<event>-<name>`` each, through the accelerator's plugin's reporter;
    returns one :class:`~hf_precision.frontends.diffusion.DiffusionGuard` for them all."""
    from ..frontends.diffusion import DiffusionGuard, guard_diffusion, loaded_policy
    from ..rules.groups.diffusion import DIFFUSION_GROUPS

    plugin = getattr(accelerator, PLUGIN_ATTR, None) if accelerator is not None else None
    mp = getattr(accelerator, "mixed_precision", None)
    out: DiffusionGuard | None = None
    for name, module in comps.items():
        group = name.rstrip("_0123456789") if name not in DIFFUSION_GROUPS else name
        key = group if group in DIFFUSION_GROUPS else name
        one = guard_diffusion(
            {key: module},
            loaded_policy(mp, {key: module}),
            reporter=getattr(plugin, "reporter", None),
            event=f"{event}-{name}",
            step=getattr(plugin, "steps", 0),
        )
        if out is None:
            out = DiffusionGuard(one.policy)
        for field in ("groups", "reports", "handles", "guards"):
            getattr(out, field)[name] = getattr(one, field)[key]
    return out


# ----------------------------------------------------------------------- the module patch
def patch_accelerator(accelerator_cls: Any) -> bool:
    """Wrap ``Accelerator.__init__``, ``prepare``, ``accumulate`` and ``backward``;
    idempotent. Returns whether it patched."""
    if not wrap_method(accelerator_cls, "__init__", _wrap_init):
        return False
    wrap_method(accelerator_cls, "prepare", _wrap_prepare)
    wrap_method(accelerator_cls, "accumulate", _wrap_loop_start)
    wrap_method(accelerator_cls, "backward", _wrap_loop_start)
    return True


def unpatch_accelerator(accelerator_cls: Any) -> bool:
    """Undo :func:`patch_accelerator`."""
    return unwrap_methods(accelerator_cls, "__init__", "prepare", "accumulate", "backward")


def patch_accelerator_module(module: Any) -> None:
    """What the import hook calls once ``accelerate.accelerator`` is executed."""
    patch_class_in(module, "Accelerator", patch_accelerator)


__all__ = [
    "built_by_trainer",
    "current_accelerator",
    "guard_held",
    "guard_pipeline",
    "patch_accelerator",
    "patch_accelerator_module",
    "plugin_for",
    "track_models",
    "unpatch_accelerator",
]
