"""Built-in group rules, read from ``group_rules.toml`` beside this file (transformers 5.24
paths, and remote-code layouts matched by attribute names). The table is data: its header says
what each key means. ``hf-precision architectures``
(:func:`hf_precision.rules.groups.architecture_table`)
prints it as docs/api.md's table; register your own rules with
:func:`hf_precision.rules.groups.register_group_rule`, or read a file of them with
:func:`read_rules`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import resources
from typing import Any

from torch import nn

from ..errors import PrecisionError
from .groups import GroupRule, register_group_rule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

RULES_FILE = "group_rules.toml"
_KEYS = ("name", "model_types", "attrs", "note", "paths", "extra", "params", "renamed")


def _attrs(names: tuple[str, ...]) -> Callable[[nn.Module], bool]:
    """A rule's match for a remote-code layout: the model has every named direct submodule."""
    return lambda m: all(isinstance(m._modules.get(n), nn.Module) for n in names)


def _names(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _rule(entry: dict[str, Any], where: str) -> GroupRule:
    unknown = sorted(set(entry) - set(_KEYS))
    if unknown or not isinstance(entry.get("name"), str):
        raise PrecisionError(
            f"{where}: unknown key(s) {unknown} or no name. Allowed keys: {', '.join(_KEYS)}. "
            'Fix: e.g. name = "my_vlm" and paths.vision_encoder = "model.vision_tower".'
        )
    for key in ("paths", "extra", "params", "renamed"):
        if not isinstance(entry.get(key, {}), dict):
            raise PrecisionError(
                f"{where}: {key} must be a table of group = path(s). "
                f'Fix: e.g. {key}.vision_encoder = "model.vision_tower".'
            )
    for key in ("model_types", "attrs"):
        if not all(isinstance(n, str) for n in _names(entry.get(key, ()))):
            raise PrecisionError(f"{where}: {key} must be a string or a list of strings.")
    attrs = _names(entry.get("attrs", ()))
    paths = dict(entry.get("paths", {}))
    paths.setdefault("lm_head", "lm_head")
    try:
        return GroupRule(
            entry["name"],
            paths=paths,
            model_types=_names(entry.get("model_types", ())),
            params=entry.get("params", {}),
            match=_attrs(attrs) if attrs else None,
            extra=entry.get("extra", {}),
            note=entry.get("note", ""),
            renamed=entry.get("renamed", {}),
        )
    except PrecisionError as err:  # GroupRule's own check of the paths, said for the file
        raise PrecisionError(f"{where}: {err}") from err


def read_rules(text: str, source: str = "<string>") -> list[GroupRule]:
    """The ``[[rule]]`` tables of a TOML text, in order, as :class:`GroupRule`\\ s (not yet
    registered). The keys are those of ``group_rules.toml``.

    >>> rules = read_rules('''
    ... [[rule]]
    ... name = "my_vlm"
    ... model_types = "my_vlm"
    ... paths.vision_encoder = "encoder"
    ... paths.language_model = ["decoder", "model.decoder"]
    ... ''')
    >>> rules[0].paths["language_model"], rules[0].paths["lm_head"]
    (('decoder', 'model.decoder'), ('lm_head',))
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise PrecisionError(f"read_rules({source!r}): not valid TOML ({err}).") from err
    entries = data.get("rule", [])
    if set(data) - {"rule"} or not isinstance(entries, list):
        raise PrecisionError(
            f"read_rules({source!r}): expected only [[rule]] tables, found {sorted(data)}."
        )
    return [_rule(e, f"read_rules({source!r}), rule {i + 1}") for i, e in enumerate(entries)]


def _register_built_in() -> None:
    text = resources.files(__package__).joinpath(RULES_FILE).read_text(encoding="utf-8")
    for rule in read_rules(text, RULES_FILE):
        register_group_rule(rule)


_register_built_in()
