"""The registry of group rules. The built-in ones are read from ``group_rules.toml`` beside this
file (transformers 5.24 paths, and remote-code layouts matched by attribute names) on first use,
whatever was imported first; the table is data, its header says what each key means.
``hf-precision architectures`` (:func:`architecture_table`) prints it as docs/api.md's table;
register your own rules with :func:`register_group_rule`, or read a file of them with
:func:`read_rules`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any

from torch import nn

from ...base.registry import LOCK, add_entry
from ...errors import PrecisionError
from .group_rule import GROUP_NAMES, NAME_RE, GroupRule

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


_RULES: list[GroupRule] = []
_loaded = False


def _registry() -> list[GroupRule]:
    """The rules in order; the built-in ones (``group_rules.toml``) are read on first use,
    before any other rule, whatever was imported first."""
    global _loaded
    if not _loaded:
        with LOCK:
            if not _loaded:
                text = resources.files(__package__).joinpath(RULES_FILE).read_text(encoding="utf-8")
                for rule in read_rules(text, RULES_FILE):
                    call = f"{RULES_FILE}, rule {rule.name!r}"
                    _check_groups(rule, call)

                    def add(_: str, r: GroupRule = rule) -> None:
                        _RULES.append(r)

                    add_entry(call, rule.name, **_rule_naming(_RULES), add=add)
                _loaded = True
    return _RULES


def register_group_rule(rule: GroupRule, *, first: bool = False) -> GroupRule:
    """Add an architecture rule. Names are unique and lowercase; groups must be known.
    ``first=True`` puts it before the built-in rules (to override one for a model type).

    >>> from hf_precision.rules.groups.group_rule import GroupRule
    >>> from hf_precision.rules.groups.registry import register_group_rule, unregister_group_rule
    >>> _ = register_group_rule(GroupRule(
    ...     name="my_vlm", model_types=("my_vlm",),
    ...     paths={"vision_encoder": ("encoder",), "language_model": ("decoder",)}))
    >>> unregister_group_rule("my_vlm")
    """
    rules = _registry()
    call = f"register_group_rule(GroupRule(name={rule.name!r}))"

    def add(_: str) -> GroupRule:
        _check_groups(rule, call)
        rules.insert(0, rule) if first else rules.append(rule)
        return rule

    return add_entry(call, rule.name, **_rule_naming(rules), add=add)


def _rule_naming(rules: list[GroupRule]) -> dict[str, Any]:
    """How the rule registry names its entries, for :func:`add_entry`."""
    return {
        "pattern": NAME_RE,
        "example": "name='my_vlm'",
        "exists": lambda name: any(r.name == name for r in rules),
        "rule": "rule names are lowercase identifiers ([a-z][a-z0-9_]*)",
        "taken": "a rule of that name exists. Fix: choose another name, "
        "or unregister_group_rule() the old one first",
    }


def _check_groups(rule: GroupRule, call: str) -> None:
    """The groups a rule names are known."""
    used = set(rule.paths) | set(rule.params) | set(rule.extra) | set(rule.required)
    used |= set(rule.renamed) | set(rule.renamed.values())
    unknown = sorted(used - set(GROUP_NAMES))
    if unknown:
        raise PrecisionError(
            f"{call}: unknown group(s) {unknown}. Allowed: "
            f"{', '.join(GROUP_NAMES)}. Fix: register_group(name) first."
        )


def unregister_group_rule(name: str) -> None:
    """Remove a rule by name (no error when absent)."""
    rules = _registry()
    with LOCK:
        rules[:] = [r for r in rules if r.name != name]


def group_rules() -> tuple[GroupRule, ...]:
    """Every registered rule, in the order :func:`~hf_precision.find_module_groups`
    tries them (the built-in ones first, read on first use)."""
    return tuple(_registry())


def architecture_table(rules: Iterable[GroupRule] | None = None) -> str:
    """The supported-architecture table (Markdown), generated from the rule registry: one row
    per rule (model-layout rules only; diffusion rules have their own groups), the model types
    it matches and, per group, its candidate paths (the first that exists wins), ``+`` modules
    it adds when present, and direct parameters.

    >>> llava = next(r for r in group_rules() if r.name == "llava")
    >>> row = architecture_table([llava]).splitlines()[2].split(" | ")
    >>> row[0], row[2]
    ('| llava', '`model.vision_tower`')
    """
    columns = GROUP_NAMES[:6]  # vision, resampler, projector, audio, language model, head
    head = ["rule", "model types", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rule in rules if rules is not None else _registry():
        if not set(rule.paths) | set(rule.extra) | set(rule.params) <= set(columns):
            continue
        types = "; ".join(x for x in (", ".join(rule.model_types), rule.note) if x)
        cells = [_cell(rule, g) for g in columns]
        lines.append("| " + " | ".join([rule.name, types, *cells]) + " |")
    lines.append(
        '| *fallback* | any other model (says what matched) | `get_encoder(modality="image")` '
        'or a tower name | a name pattern | a name pattern | `get_encoder(modality="audio")` '
        "or a tower name | `get_decoder()` or a name | `get_output_embeddings()` or a name |"
    )
    return "\n".join(lines) + "\n"


def _cell(rule: GroupRule, group: str) -> str:
    cell = " / ".join(f"`{p}`" if p else "the model" for p in rule.paths.get(group, ()))
    for p in rule.extra.get(group, ()):
        cell += f" + `{p}`" if cell else f"+ `{p}`"
    for p in rule.params.get(group, ()):
        cell += f", `{p}` (param)" if cell else f"`{p}` (param)"
    return cell or "—"
