"""Who chose the precision: what each component of the stack set, against what the script asked.

The components read here, without importing any of them:

* ``ACCELERATE_MIXED_PRECISION`` (``accelerate launch --mixed_precision``, ``accelerate config``):
  transformers 5's ``TrainingArguments.__post_init__`` sets ``args.mixed_precision`` from it and
  then lets the script's own ``bf16=True``/``fp16=True`` win; the Trainer hands
  ``args.mixed_precision`` to its ``Accelerator``, which autocasts in it. So the variable decides
  exactly when the script sets neither flag, and then ``args.bf16``/``args.fp16`` stay ``False``
  while the run computes in half precision;
* ``HF_PRECISION_*`` (``hf-precision run --policy``, the launcher's variables): the guard's own;
* a DeepSpeed JSON's ``bf16``/``fp16`` sections: DeepSpeed holds the whole model in the dtype
  its JSON enables;
* what a framework set by itself and :func:`record`\\ ed (axolotl's ``bf16: auto`` falling back
  to ``fp16``, ms-swift turning ``fp16`` on for a float32 checkpoint);
* PEFT's ``autocast_adapter_dtype`` (adapter weights in float32 beside half base weights);
* unsloth's ``UNSLOTH_FORCE_FLOAT32``.

:func:`precision_provenance` returns the ``provenance`` section of the event JSON; its ``line``
names the winner, e.g. ``precision: bf16 autocast — ACCELERATE_MIXED_PRECISION=bf16 chose
it; the script set neither bf16 nor fp16``.

>>> from types import SimpleNamespace
>>> args = SimpleNamespace(bf16=False, fp16=True, mixed_precision="fp16")
>>> found = precision_provenance(args, environ={"ACCELERATE_MIXED_PRECISION": "bf16"})
>>> found["chosen_by"], found["line"][:60]
('script', "precision: fp16 — the script's fp16=True overrode ACCELERATE")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..rules.dtypes import dtype_name
from .finding import Finding

ENV_ACCELERATE = "ACCELERATE_MIXED_PRECISION"
ENV_UNSLOTH = "UNSLOTH_FORCE_FLOAT32"
_HF_PRECISION = "HF_PRECISION_"
#: what frameworks set by themselves in this process: component -> (settings, note)
_RECORDED: dict[str, tuple[dict[str, Any], str]] = {}
#: the components of :data:`_RECORDED` whose settings the user typed (a tool's own flags)
_TYPED: set[str] = set()


def record(
    component: str, settings: Mapping[str, Any], note: str = "", *, typed: bool = False
) -> None:
    """A framework adapter says what its tool set by itself (``record("axolotl", {"fp16":
    True}, "bf16: auto found no bf16 GPU")``), or with ``typed=True`` the precision flags its
    user typed in the tool's own words (``record("train_network.py", {"--mixed_precision":
    "bf16", "--full_bf16": True}, typed=True)``: a loop that has no ``TrainingArguments``); the
    next :func:`precision_provenance` names it."""
    if settings:
        _RECORDED[component] = (dict(settings), note)
        _TYPED.discard(component)
        if typed:
            _TYPED.add(component)
    else:
        forget(component)


def forget(component: str) -> None:
    _RECORDED.pop(component, None)
    _TYPED.discard(component)


def typed_words(settings: Mapping[str, Any]) -> str:
    """Flags as typed: ``--mixed_precision bf16 --full_bf16``."""
    return " ".join(k if v is True else f"{k} {v}" for k, v in settings.items())


def _script_flag(args: Any) -> str | None:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return None


def _deepspeed(args: Any) -> dict[str, Any] | None:
    from ..rules.deepspeed_config import deepspeed_config_of

    try:
        cfg = deepspeed_config_of(args=args)
    except Exception:  # a bad JSON is said by the flag check; here it is only not read
        return None
    if not cfg:
        return None
    out = {}
    for key in ("bf16", "fp16"):
        section = cfg.get(key)
        if isinstance(section, dict) and "enabled" in section:
            out[key] = section["enabled"]
    return out or None


def _peft(model: nn.Module | None) -> dict[str, Any] | None:
    """Adapter weights (``lora_*``, ``modules_to_save``) in another dtype than the base's."""
    if model is None or not hasattr(model, "peft_config"):
        return None
    adapter: dict[str, int] = {}
    base: dict[str, int] = {}
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        into = adapter if ("lora_" in name or "modules_to_save" in name) else base
        into[dtype_name(p.dtype)] = into.get(dtype_name(p.dtype), 0) + 1
    if not adapter or set(adapter) == set(base):
        return None
    return {"adapter_dtypes": adapter, "base_dtypes": base}


def _components(args: Any, model: Any, env: Mapping[str, str]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    accel = env.get(ENV_ACCELERATE, "")
    # transformers 4.x's TrainingArguments writes the script's own choice back into the
    # variable: only a value other than the script's flags is another component's choice
    if accel and accel.lower() != (_script_flag(args) or "no"):
        found.append({"component": ENV_ACCELERATE, "set": accel})
    for var in sorted(v for v in env if v.startswith(_HF_PRECISION)):
        found.append({"component": var, "set": env[var]})
    ds = _deepspeed(args)
    if ds:
        found.append({"component": "DeepSpeed JSON", "set": ds})
    for name, (settings, note) in sorted(_RECORDED.items()):
        flags = {k: v for k, v in settings.items() if getattr(args, k, v) == v}
        if flags:
            found.append({"component": name, "set": flags, "note": note})
    peft = _peft(model)
    if peft:
        found.append({"component": "PEFT autocast_adapter_dtype", "set": peft})
    if env.get(ENV_UNSLOTH):
        found.append({"component": ENV_UNSLOTH, "set": env[ENV_UNSLOTH]})
    return found


def _flag_words(args: Any, flag: str) -> str:
    """``the script's bf16=True``; a config class whose ``bf16`` defaults to ``None`` (TRL's
    ``SFTConfig``: its ``__post_init__`` turns bf16 on unless fp16 is set) is named, since the
    script may not have set it at all."""
    fields = getattr(type(args), "__dataclass_fields__", {})
    lib = type(args).__module__.split(".", 1)[0]
    if flag in fields and fields[flag].default is None and lib != "transformers":
        return (
            f"{type(args).__name__}'s {flag}=True ({lib} turns it on when neither bf16 nor "
            "fp16 is given)"
        )
    return f"the script's {flag}=True"


def requested_fp8(found: Mapping[str, Any]) -> str | None:
    """Who asked for fp8 in a :func:`precision_provenance` section (``"ACCELERATE_MIXED_PRECISION
    =fp8"``, a framework's recorded setting), ``None`` when nobody did."""
    for c in found.get("components", ()):
        said = c.get("set")
        if said == "fp8" or (isinstance(said, Mapping) and "fp8" in map(str, said.values())):
            return f"{c['component']}=fp8" if said == "fp8" else str(c["component"])
    return None


def _winner(args: Any, found: list[dict[str, Any]], env: Mapping[str, str]) -> tuple[str, str]:
    """(component that decided the compute precision, the line)."""
    script = _script_flag(args)
    # transformers: the script's flag wins, else args.mixed_precision (read from the variable)
    resolved = str(script or getattr(args, "mixed_precision", None) or "no")
    said = _flag_words(args, script) if script else "the script set neither bf16 nor fp16"
    framework = next((c for c in found if c["component"] in _RECORDED), None)
    if framework is not None:
        flags = ", ".join(f"{k}={v}" for k, v in framework["set"].items())
        note = f" ({framework['note']})" if framework.get("note") else ""
        if framework["component"] in _TYPED:
            return framework["component"], (
                f"precision: {resolved} — {framework['component']}'s "
                f"{typed_words(framework['set'])}{note}"
            )
        return framework["component"], (
            f"precision: {resolved} — {framework['component']} set {flags} by itself{note}, "
            "not the user"
        )
    ds = next((c for c in found if c["component"] == "DeepSpeed JSON"), None)
    held = [k for k, v in (ds or {}).get("set", {}).items() if v is True]
    if held and held[0] != script:
        return "DeepSpeed JSON", (
            f"precision: {held[0]} — the DeepSpeed JSON's {held[0]} section enabled it "
            f"({said}); DeepSpeed holds the whole model in it"
        )
    accel = env.get(ENV_ACCELERATE, "").lower()
    if accel and accel != "no" and not script:
        return ENV_ACCELERATE, (
            f"precision: {accel} autocast — {ENV_ACCELERATE}={accel} chose it; {said} "
            f"(TrainingArguments.mixed_precision reads the variable, the Trainer's Accelerator "
            f"autocasts in it, and args.bf16/args.fp16 stay False)"
        )
    if accel and script and accel != script:
        return "script", (
            f"precision: {script} — {said} overrode {ENV_ACCELERATE}={accel} (TrainingArguments "
            "reads the variable only when neither bf16 nor fp16 is set)"
        )
    return ("script" if script else "loaded dtypes"), (
        f"precision: {resolved} — {said}" + ("" if script else "; the loaded dtypes stand")
    )


def precision_provenance(
    args: Any, model: nn.Module | None = None, *, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The ``provenance`` section: ``asked`` (the script's flags as passed to
    ``TrainingArguments``), ``resolved`` (``args.mixed_precision``), ``components`` (what each
    set), ``chosen_by`` (who decided the compute precision), ``line`` (the console line) and
    ``notable`` (something beside the script set a precision: the line is worth saying)."""
    env = os.environ if environ is None else environ
    found = _components(args, model, env)
    chosen_by, line = _winner(args, found, env)
    asked = {k: bool(getattr(args, k, False)) for k in ("bf16", "fp16")}
    return {
        "asked": asked,
        "resolved": getattr(args, "mixed_precision", None),
        "components": found,
        "chosen_by": chosen_by,
        "line": line,
        "notable": any(not c["component"].startswith(_HF_PRECISION) for c in found),
    }


def provenance_finding(found: Mapping[str, Any]) -> Finding:
    """A notable :func:`precision_provenance` (something beside the script set a precision) as
    a :class:`~hf_precision.watch.finding.Finding`: its line on the console and in
    ``precision.log``, the section in ``<step>-provenance.json``."""
    return Finding("provenance", "warning", f"hf-precision: {found['line']}", numbers=found)
