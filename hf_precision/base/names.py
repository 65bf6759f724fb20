"""The names a command line checks before the engine (torch, the registries) loads: the preset
names, what other tools call them, the group names and the ``--trainable`` words. An argument
error is then answered at once, with no torch import.

It also holds the attribute names under which the engine's hooks keep their state on a module
(:data:`GUARD_ATTR`, :data:`EXIT_ATTR`): a watcher that copies a model drops them by name
without importing the engine.

These lists are the registries' contents in a command-line process (nothing there registers
presets or groups of its own); tests/base/test_names.py and tests/tools/test_cli.py check them
against :data:`~hf_precision.rules.policy.presets.PRESETS` and
:func:`~hf_precision.rules.groups.group_rule.group_names` after the engine has loaded.

>>> preset_hint("bf61", PRESET_NAMES), preset_hint("BF16", PRESET_NAMES)
(" Did you mean 'bf16'?", " Did you mean 'bf16'? (preset names are lower case)")
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import did_you_mean

#: where :mod:`hf_precision.engine.cast_hooks` keeps a guard's state on the module it guards
GUARD_ATTR = "_hf_precision_guard"
#: where it keeps an exit guard's state (a group's outputs cast back)
EXIT_ATTR = "_hf_precision_exit"

PRESET_NAMES = ("bf16", "bf16-true", "fp16", "fp16-true", "fp32", "fp16-vae32", "bf16-vae32")
GROUP_NAMES = (
    "vision_encoder",
    "resampler",
    "projector",
    "audio_encoder",
    "language_model",
    "lm_head",
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "unet",
    "transformer",
    "vae",
    "lora_network",
)
#: --trainable words besides group names
TRAINABLE_WORDS = ("all", "none", "other")

_BF16 = "'bf16' (frozen bf16, trainable fp32) or 'bf16-true' (all bf16)"
_FP16 = "'fp16' (frozen fp16, trainable fp32) or 'fp16-true' (all fp16)"
#: Names other tools use that are not preset names, with the preset(s) they may mean. They are
#: refused everywhere (Python and the CLI): ``bfloat16`` alone does not say whether trainable
#: weights stay fp32, so no name is silently read as one preset.
PRESET_MISNAMES: dict[str, str] = {
    "bfloat16": _BF16,
    "bf16-mixed": "'bf16' (Lightning's bf16-mixed: frozen bf16, trainable fp32)",
    "bf16-mixed-fp32": "'bf16'",
    "float16": _FP16,
    "half": _FP16,
    "fp16-mixed": "'fp16' (frozen fp16, trainable fp32)",
    "16-mixed": "'fp16' (Lightning's 16-mixed: frozen fp16, trainable fp32)",
    "16-true": "'fp16-true'",
    "bf16-true-mixed": _BF16,
    "float32": "'fp32'",
    "fp32-true": "'fp32'",
    "32": "'fp32'",
    "32-true": "'fp32'",
    "no": "'fp32' (accelerate's mixed_precision='no')",
}


def preset_hint(name: object, presets: Iterable[str]) -> str:
    """``" Did you mean ...?"`` for a name that is not a preset: another tool's name for one
    (:data:`PRESET_MISNAMES`), a preset in upper case, or the closest preset; else ``""``."""
    presets = list(presets)
    key = str(name).strip().lower()
    if key in PRESET_MISNAMES:
        return f" Did you mean {PRESET_MISNAMES[key]}?"
    if key in presets:
        return f" Did you mean {key!r}? (preset names are lower case)"
    return did_you_mean(key, presets)


def unknown_groups(spec: str, groups: Iterable[str] = GROUP_NAMES) -> str | None:
    """The ``--trainable`` error for ``spec`` (comma-separated groups and words), or ``None``."""
    groups = list(groups)
    for w in (s.strip() for s in spec.split(",") if s.strip()):
        if w not in (*groups, *TRAINABLE_WORDS):
            return (
                f"--trainable: unknown group {w!r}.{did_you_mean(w, groups)} "
                f"Allowed: {', '.join(groups)}, {', '.join(TRAINABLE_WORDS)}"
            )
    return None
