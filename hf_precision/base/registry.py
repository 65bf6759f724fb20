"""The one way every registry of the package takes an entry (``register_group``,
``register_group_rule``, ``register_preset``, ``register_wrapper``, ``register_quantized``,
``register_metadata_key``, ``register_activation_key``): the name is checked, a second entry of
the same name is refused, kept or replaces the first (each registry says which), and the table
changes under one lock, so that registries fill the same whatever thread adds to them.

>>> import re
>>> table: dict[str, int] = {}
>>> add_entry("register_thing('a')", "a", pattern=re.compile(r"^[a-z]+$"), example="'depth'",
...           exists=table.__contains__, add=lambda name: table.setdefault(name, 1))
1
>>> try:
...     add_entry("register_thing('a')", "a", pattern=re.compile(r"^[a-z]+$"), example="'depth'",
...               exists=table.__contains__, add=lambda name: table.setdefault(name, 2))
... except Exception as err:
...     print(err)
register_thing('a'): 'a' is registered already. Fix: choose another name.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Literal, TypeVar

from ..errors import PrecisionError

__all__ = ["LOCK", "Duplicate", "add_entry"]

T = TypeVar("T")
#: What a registry does with a second entry of a name it holds: refuse it (a rule, a preset),
#: keep the first (re-declaring a group or a batch key is harmless), or replace it (a wrapper
#: kind, a quantized class: the newest declaration wins).
Duplicate = Literal["refuse", "keep", "replace"]
#: The one lock every registry changes under (re-entrant: a registry may fill its built-ins
#: while a user's entry is being added).
LOCK = threading.RLock()


def add_entry(
    call: str,
    name: object,
    *,
    pattern: re.Pattern[str] | None,
    example: str,
    exists: Callable[[str], bool],
    add: Callable[[str], T],
    duplicate: Duplicate = "refuse",
    rule: str | None = None,
    taken: str | None = None,
) -> T:
    """Check ``name`` (a string that ``pattern`` matches, when one is given), then, under
    :data:`LOCK`, refuse a duplicate (``duplicate="refuse"``) or call ``add(name)`` and return
    what it returns (``add`` keeps or replaces an entry it holds, as its registry says).
    ``call`` is the user's call as messages repeat it, ``example`` a valid name for the fix,
    ``rule`` what a name looks like and ``taken`` the refusal, in the registry's words."""
    if not isinstance(name, str) or (pattern is not None and not pattern.match(name)):
        rule = rule or (f"names match {pattern.pattern}" if pattern else "names are strings")
        raise PrecisionError(f"{call}: {rule}, got {name!r}. Fix: e.g. {example}.")
    with LOCK:
        if duplicate == "refuse" and exists(name):
            taken = taken or f"{name!r} is registered already. Fix: choose another name"
            raise PrecisionError(f"{call}: {taken}.")
        return add(name)
