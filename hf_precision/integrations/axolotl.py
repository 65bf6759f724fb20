"""axolotl: the guard as an axolotl plugin with its own config key (read against axolotl 0.21.0).

.. code-block:: yaml

    plugins:
      - hf_precision.integrations.axolotl.PrecisionGuardPlugin
    precision_guard: auto      # or bf16 / fp16 / fp32 / ..., a policy JSON path, false, or
                               # {policy: auto, mode: audit, report_dir: /somewhere}

axolotl loads the plugin by its dotted name and merges the plugin's config model
(:func:`get_input_args` names ``PrecisionGuardArgs``) into its own, so ``precision_guard`` is a
validated key of the YAML. The callback is returned from ``add_callbacks_pre_trainer``: axolotl
passes those to the Trainer's constructor, so ``on_init_end`` (the guard's cast, before the
optimizer and any wrapper) fires; ``add_callbacks_post_trainer`` would use ``add_callback`` and
miss it. The policy is then inferred from the ``TrainingArguments`` axolotl built (``bf16``,
``fp16``) and the model it loaded, unless ``precision_guard`` names one.

This module imports without axolotl (it needs Python >= 3.12); ``AxolotlPrecisionPlugin`` and
``PrecisionGuardArgs`` are built on first access, from axolotl's ``BasePlugin`` and pydantic.
``PrecisionGuardPlugin`` (the path written in YAML files) is the same class under its old name
(not to be confused with accelerate's :class:`hf_precision.PrecisionGuardPlugin`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hf_precision.errors import PrecisionError
from hf_precision.frontends.callback import PrecisionGuardCallback
from hf_precision.integrations.launch_config import LaunchConfig
from hf_precision.watch import provenance

logger = logging.getLogger("hf_precision")

#: what to write under ``plugins:``
PLUGIN = "hf_precision.integrations.axolotl.PrecisionGuardPlugin"
#: the config model axolotl merges into its own (``get_input_args``)
ARGS = "hf_precision.integrations.axolotl.PrecisionGuardArgs"
KEY = "precision_guard"
_OPTIONS = ("policy", "mode", "report_dir")
_OFF = ("off", "none", "false")


def _policy(value: Any, call: str) -> Any:
    """``auto`` / None -> None (inferred); a mapping -> the policy's JSON form; a string -> read
    as ``HF_PRECISION_GUARD`` is (a preset, a policy JSON string or file)."""
    if value is None or value is True:
        return None
    if isinstance(value, Mapping):
        return dict(value)
    if not isinstance(value, str):
        raise PrecisionError(
            f"{call}: expected auto, a preset name, a policy JSON (path or text) or a mapping, "
            f"got {type(value).__name__}. Fix: e.g. `{KEY}: auto` or `{KEY}: bf16`."
        )
    return LaunchConfig(policy=value.strip()).resolved_policy(call=call)


def callback_from_config(value: Any) -> PrecisionGuardCallback | None:
    """The callback the ``precision_guard`` value asks for; ``None`` for ``false``/``off``.

    >>> callback_from_config("auto").policy is None  # inferred at on_init_end
    True
    >>> callback_from_config({"policy": "bf16", "mode": "audit"}).policy.mode
    'audit'
    >>> callback_from_config(False) is None
    True
    """
    call = f"axolotl config `{KEY}: {value!r}`"
    if value is False or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None
    if isinstance(value, Mapping) and ("policy" in value or set(value) <= set(_OPTIONS)):
        unknown = set(value) - set(_OPTIONS)  # {policy:, mode:, report_dir:}
    else:  # a preset, a path, auto, or the policy's own JSON form as a mapping
        value, unknown = {"policy": value}, set()
    if unknown:
        raise PrecisionError(
            f"{call}: unknown key(s) {sorted(unknown)}. Fix: use {', '.join(_OPTIONS)} "
            "(policy: auto, a preset, a policy JSON path or mapping)."
        )
    return PrecisionGuardCallback(
        _policy(value.get("policy"), call),
        mode=value.get("mode"),
        report_dir=value.get("report_dir"),
    )


def flags_set_by_axolotl(raw: Mapping[str, Any], cfg: Any) -> dict[str, bool]:
    """The mixed-precision flags axolotl turned on by itself: on in the resolved ``cfg``, left
    unset (or ``auto``) in the user's ``raw`` YAML. axolotl's ``bf16: auto`` (the default) gives
    ``bf16=True`` on a bf16 GPU and otherwise ``fp16=True`` (and ``torch_dtype`` float16).

    >>> flags_set_by_axolotl({"bf16": "auto"}, {"bf16": False, "fp16": True})
    {'fp16': True}
    >>> flags_set_by_axolotl({"fp16": True}, {"bf16": False, "fp16": True})
    {}
    """
    get = cfg.get if hasattr(cfg, "get") else lambda k: getattr(cfg, k, None)
    return {
        flag: True
        for flag in ("bf16", "fp16")
        if get(flag) is True and raw.get(flag) in (None, "auto")
    }


class AxolotlPrecisionPluginMethods:
    """What :class:`AxolotlPrecisionPlugin` adds to axolotl's ``BasePlugin`` (plain, so it can be
    used and tested without axolotl)."""

    def __init__(self) -> None:
        super().__init__()
        #: the user's own precision keys, as written in the YAML (``register`` sees them)
        self.raw_flags: dict[str, Any] | None = None
        #: the flags axolotl turned on by itself (``add_callbacks_pre_trainer`` fills it)
        self.set_by_axolotl: dict[str, bool] = {}

    def register(self, cfg: Mapping[str, Any]) -> None:
        """axolotl calls this with the raw YAML: a bad ``precision_guard`` fails here, before
        any model is loaded; the user's own ``bf16``/``fp16`` are noted."""
        callback_from_config(cfg.get(KEY, "auto"))
        self.raw_flags = {flag: cfg.get(flag) for flag in ("bf16", "fp16")}

    def get_input_args(self) -> str:
        return ARGS

    def add_callbacks_pre_trainer(self, cfg: Any, model: Any) -> list[PrecisionGuardCallback]:
        """The guard, passed to the Trainer's constructor (so ``on_init_end`` fires)."""
        value = cfg.get(KEY) if hasattr(cfg, "get") else getattr(cfg, KEY, None)
        callback = callback_from_config("auto" if value is None else value)
        if self.raw_flags is not None:
            self.set_by_axolotl = flags_set_by_axolotl(self.raw_flags, cfg)
            provenance.record("axolotl", self.set_by_axolotl, "`bf16: auto` found no bf16 GPU")
        if callback is not None and self.set_by_axolotl and os.environ.get("RANK", "0") == "0":
            named = ", ".join(f"{flag}=True" for flag in self.set_by_axolotl)
            logger.warning(
                "hf-precision: %s was set by axolotl (`bf16: auto` found no bf16 GPU), not in "
                "your YAML; the guard follows it. Fix: `fp16: false` and `bf16: false` keep the "
                "loaded dtypes, `bf16: true` asks for bf16",
                named,
            )
        return [] if callback is None else [callback]


#: the old name of :class:`AxolotlPrecisionPluginMethods`
PrecisionGuardPluginMethods = AxolotlPrecisionPluginMethods

#: old name -> the name it is built under (both give the same object)
_ALIASES = {"PrecisionGuardPlugin": "AxolotlPrecisionPlugin"}


def _build(name: str) -> Any:
    if name == "PrecisionGuardArgs":
        from pydantic import BaseModel

        class PrecisionGuardArgs(BaseModel):
            """axolotl config key of the hf-precision plugin (merged into axolotl's config)."""

            precision_guard: bool | str | dict[str, Any] | None = None

        return PrecisionGuardArgs
    try:
        from axolotl.integrations.base import BasePlugin
    except ImportError as err:
        raise ImportError(
            f"{PLUGIN} needs axolotl (Python >= 3.12; tested against 0.21): {err}. Fix: "
            "`pip install axolotl`, or use `hf-precision run -- axolotl train cfg.yaml`."
        ) from err

    class AxolotlPrecisionPlugin(AxolotlPrecisionPluginMethods, BasePlugin):  # type: ignore[misc, valid-type]
        """hf-precision's guard on axolotl's Trainer, configured by ``precision_guard:``."""

    return AxolotlPrecisionPlugin


def __getattr__(name: str) -> Any:
    """``AxolotlPrecisionPlugin`` (old name ``PrecisionGuardPlugin``) / ``PrecisionGuardArgs``,
    built on first access (PEP 562)."""
    if name in ("AxolotlPrecisionPlugin", "PrecisionGuardPlugin", "PrecisionGuardArgs"):
        built = _ALIASES.get(name, name)
        value = globals().get(built) or _build(built)
        globals()[built] = globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
