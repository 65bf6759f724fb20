"""``_patching``: a class's own method wrapped once, marked, and put back as the very function it
was; the launcher's patches of the real ``Trainer`` and ``Accelerator`` through it."""

from __future__ import annotations

import functools
import types
from typing import Any

from hf_precision.integrations._patching import (
    WRAPPED_ATTR,
    is_wrapped,
    patch_class_in,
    unwrap_methods,
    wrap_method,
)


def _loud(method: Any) -> Any:
    @functools.wraps(method)
    def wrapped(self: Any) -> str:
        return method(self).upper()

    return wrapped


class Base:
    def name(self) -> str:
        return "base"

    def other(self) -> str:
        return "other"


class Child(Base):
    def own(self) -> str:
        return "own"


def test_a_method_is_wrapped_once_and_put_back_as_it_was() -> None:
    original = Base.__dict__["name"]
    assert wrap_method(Base, "name", _loud)
    try:
        assert not wrap_method(Base, "name", _loud)  # once: not wrapped twice
        assert Base().name() == "BASE" and Child().name() == "BASE"
        assert is_wrapped(Base.__dict__["name"]) and getattr(Base.name, WRAPPED_ATTR)
        assert Base.__dict__["name"].__wrapped__ is original
        assert not is_wrapped(Base.__dict__["other"])
    finally:
        assert unwrap_methods(Base, "name", "other")  # "other" was never wrapped: left alone
    assert Base.__dict__["name"] is original and Base().name() == "base"
    assert not unwrap_methods(Base, "name", "other")


def test_an_inherited_or_missing_method_is_left_to_its_own_class() -> None:
    assert not wrap_method(Child, "name", _loud)  # Base defines it
    assert not wrap_method(Child, "missing", _loud)
    assert "name" not in vars(Child) and not is_wrapped(Base.__dict__["name"])
    assert not unwrap_methods(Child, "name", "missing")
    assert wrap_method(Child, "own", _loud) and Child().own() == "OWN"
    assert unwrap_methods(Child, "own") and Child().own() == "own"


def test_a_replacement_that_is_not_ours_is_not_undone() -> None:
    class Loop:
        def start(self) -> str:
            return "ran"

    def theirs(self: Any) -> str:
        return "theirs"

    Loop.start = theirs  # type: ignore[method-assign]
    assert not unwrap_methods(Loop, "start") and Loop.__dict__["start"] is theirs


def test_patch_class_in_patches_only_a_class_the_module_defines() -> None:
    seen: list[type] = []
    patch_class_in(types.ModuleType("loading"), "Trainer", seen.append)
    assert seen == []
    module = types.ModuleType("done")
    module.Trainer = Base  # type: ignore[attr-defined]
    patch_class_in(module, "Trainer", seen.append)
    assert seen == [Base]


def test_the_launcher_patches_of_the_real_classes_come_off_as_they_were() -> None:
    from accelerate import Accelerator
    from transformers import Trainer
    from transformers.trainer_callback import CallbackHandler

    from hf_precision.integrations import accelerate_hook, launcher

    targets = {
        Accelerator: ("__init__", "prepare", "accumulate", "backward"),
        Trainer: ("__init__",),
        CallbackHandler: ("add_callback",),
    }
    before = {(c, n): c.__dict__[n] for c, names in targets.items() for n in names}
    assert accelerate_hook.patch_accelerator(Accelerator) and launcher.patch_trainer(Trainer)
    try:
        assert not accelerate_hook.patch_accelerator(Accelerator)
        assert not launcher.patch_trainer(Trainer)
        for (cls, name), fn in before.items():
            assert is_wrapped(cls.__dict__[name]) and cls.__dict__[name].__wrapped__ is fn
    finally:
        assert accelerate_hook.unpatch_accelerator(Accelerator)
        assert launcher.unpatch_trainer(Trainer)
    assert all(c.__dict__[n] is fn for (c, n), fn in before.items())
    assert not accelerate_hook.unpatch_accelerator(Accelerator)
    assert not launcher.unpatch_trainer(Trainer)
