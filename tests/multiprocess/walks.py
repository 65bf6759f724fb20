"""Count what hf-precision's code does to a model during one event: the walk passes it starts
(over the whole model or any part of it), the ``unwrap_model`` and the ``check_model`` calls.

Shared by ``tests/engine/test_guard.py`` and the two-rank scenario in ``scenarios.py`` (which
imports it from its own folder). A walk pass is one of

* a ``named_modules()`` pass (``modules()``, ``parameters()``, ``named_parameters()``,
  ``buffers()`` go through it) started on any module of the model;
* a ``named_children()`` pass (``children()`` goes through it) on any module of the model;
* a direct pass over a module's ``_modules`` (``items()``, ``values()``, ``keys()``, iteration):
  a hand-written stack walk such as the dtype map's.

Each is named ``file:function`` after the first hf-precision frame that started it. Passes torch
starts itself (its recursion inside ``named_modules``, ``get_submodule``) are not counted.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

import hf_precision

PKG = str(Path(hf_precision.__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)


@dataclass
class Walks:
    """What one event did to the model (see the module docstring)."""

    walks: list[str] = field(default_factory=list)
    #: ``file:function`` of each ``unwrap_model`` / ``check_model`` call hf-precision made
    unwraps: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"walks": self.walks, "unwraps": self.unwraps, "checks": self.checks}


def _starter(frame: FrameType | None) -> str | None:
    """``file:function`` of the first frame outside torch, when it is hf-precision's."""
    while frame is not None and frame.f_code.co_filename.startswith(TORCH):
        frame = frame.f_back
    if frame is not None and frame.f_code.co_filename.startswith(PKG):
        return f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
    return None


class _CountingModules(dict):  # type: ignore[type-arg]
    """A module's ``_modules``, telling :class:`Walks` of each pass hf-precision's code makes
    over it directly (one per walking frame: a stack walk reads many modules' dicts)."""

    walks: Walks
    frames: list[FrameType]

    def _seen(self) -> None:
        frame = sys._getframe(2)
        if not frame.f_code.co_filename.startswith(PKG):
            return
        if frame.f_back is not None and frame.f_back.f_code is frame.f_code:
            return  # a recursive walk: its outermost frame counted it
        if any(f is frame for f in self.frames):
            return
        self.frames.append(frame)
        self.walks.walks.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")

    def items(self) -> Any:
        self._seen()
        return super().items()

    def values(self) -> Any:
        self._seen()
        return super().values()

    def keys(self) -> Any:
        self._seen()
        return super().keys()

    def __iter__(self) -> Iterator[Any]:
        self._seen()
        return super().__iter__()


@contextmanager
def counting_walks(model: nn.Module) -> Iterator[Walks]:
    """Count, while the block runs, what hf-precision's code does to ``model`` (any wrapper
    around it included) and every module in it."""
    from hf_precision import errors
    from hf_precision.base import wrapper_kinds as wrappers

    out = Walks()
    mods = list(model.modules())
    ids = {id(m) for m in mods}
    frames: list[FrameType] = []
    named_modules, named_children = nn.Module.named_modules, nn.Module.named_children
    unwrap, check = wrappers.unwrap_model, errors.check_model

    def counted_modules(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        if id(self) in ids and caller.f_code is not named_modules.__code__:
            where = _starter(caller)
            if where is not None:
                out.walks.append(where)
        return named_modules(self, *args, **kwargs)

    def counted_children(self: nn.Module) -> Any:
        if id(self) in ids:
            where = _starter(sys._getframe(1))
            if where is not None:
                out.walks.append(where)
        return named_children(self)

    def counted_unwrap(m: nn.Module) -> Any:
        out.unwraps.append(_starter(sys._getframe(1)) or "?")
        return unwrap(m)

    def counted_check(m: object, call: str) -> None:
        out.checks.append(_starter(sys._getframe(1)) or "?")
        check(m, call)

    patched: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("hf_precision") or module is None:
            continue
        for attr, original, new in (
            ("unwrap_model", unwrap, counted_unwrap),
            ("check_model", check, counted_check),
        ):
            if getattr(module, attr, None) is original:
                patched.append((module, attr, original))
                setattr(module, attr, new)
    plain = {}
    for m in mods:
        counting = _CountingModules(m._modules)
        counting.walks, counting.frames = out, frames
        plain[id(m)] = m._modules
        m.__dict__["_modules"] = counting
    nn.Module.named_modules = counted_modules  # type: ignore[method-assign]
    nn.Module.named_children = counted_children  # type: ignore[method-assign]
    try:
        yield out
    finally:
        nn.Module.named_modules = named_modules  # type: ignore[method-assign]
        nn.Module.named_children = named_children  # type: ignore[method-assign]
        for module, attr, original in patched:
            setattr(module, attr, original)
        for m in mods:
            now = m.__dict__["_modules"]
            plain[id(m)].clear()
            plain[id(m)].update(now)
            m.__dict__["_modules"] = plain[id(m)]
