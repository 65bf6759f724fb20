"""``base/registry.add_entry``: the one way every ``register_*`` takes an entry (name checked, a
duplicate refused, kept or replacing, the table changed under one lock)."""

from __future__ import annotations

import re
import threading

import pytest

from hf_precision import PrecisionError
from hf_precision.base import registry
from hf_precision.base.registry import add_entry

NAME = re.compile(r"^[a-z]+$")


def _add(table: dict[str, int], name: object, value: int, duplicate: registry.Duplicate) -> int:
    return add_entry(
        f"register_thing({name!r})",
        name,
        pattern=NAME,
        example="'depth'",
        exists=table.__contains__,
        add=lambda n: table.__setitem__(n, value) or table[n],
        duplicate=duplicate,
    )


def test_a_bad_name_is_refused_with_the_users_call_and_an_example() -> None:
    with pytest.raises(
        PrecisionError, match=r"register_thing\('Bad'\): .*got 'Bad'. Fix: e.g. 'depth'"
    ):
        _add({}, "Bad", 1, "refuse")
    with pytest.raises(PrecisionError, match="got 3"):
        _add({}, 3, 1, "refuse")


def test_a_duplicate_is_refused_or_kept_or_replaces_as_the_registry_says() -> None:
    table: dict[str, int] = {}
    assert _add(table, "a", 1, "refuse") == 1
    with pytest.raises(PrecisionError, match="'a' is registered already"):
        _add(table, "a", 2, "refuse")
    assert table == {"a": 1}
    assert _add(table, "a", 3, "replace") == 3 and table == {"a": 3}


def test_entries_added_from_many_threads_are_each_added_once() -> None:
    table: dict[str, int] = {}
    refused: list[str] = []

    def add(i: int) -> None:
        try:
            _add(table, "shared", i, "refuse")
        except PrecisionError:
            refused.append("x")

    threads = [threading.Thread(target=add, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(table) == 1 and len(refused) == 15


def test_every_register_function_goes_through_the_one_helper() -> None:
    """The eight ``register_*`` functions of the package share ``add_entry`` (and so its lock)."""
    import ast
    from pathlib import Path

    pkg = Path(registry.__file__).resolve().parents[1]
    registers = {
        f"{path.relative_to(pkg)}:{node.name}": any(
            isinstance(n, ast.Name) and n.id == "add_entry" for n in ast.walk(node)
        )
        or any(
            isinstance(n, ast.Call) and getattr(n.func, "id", "") == "_add_key"
            for n in ast.walk(node)
        )
        for path in pkg.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name.startswith("register_")
    }
    assert len(registers) >= 7, registers
    assert all(registers.values()), [k for k, v in registers.items() if not v]
