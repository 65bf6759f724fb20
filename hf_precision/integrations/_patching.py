"""Wrapping a class's own methods once, and putting them back: the patches the start-up hook
applies to ``Trainer`` (:mod:`.launcher`), ``Accelerator`` (:mod:`.accelerate_hook`) and
OneTrainer's ``GenericTrainer`` (:mod:`.onetrainer`). Not an adapter: it imports nothing of
the package, and the adapters that patch a class import it.

A wrapper is marked (:data:`WRAPPED_ATTR`), so a second patch of the same class is a no-op
and an unpatch undoes only what was wrapped here (``functools.wraps`` keeps the original in
``__wrapped__``).

>>> import functools
>>> class Loop:
...     def start(self):
...         return "ran"
>>> def guarded(start):
...     @functools.wraps(start)
...     def wrapped(self):
...         return start(self) + ", guarded"
...     return wrapped
>>> wrap_method(Loop, "start", guarded), wrap_method(Loop, "start", guarded)
(True, False)
>>> Loop().start()
'ran, guarded'
>>> unwrap_methods(Loop, "start"), Loop().start()
(True, 'ran')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: set on every wrapper these patches install
WRAPPED_ATTR = "_hf_precision_wrapped"


def is_wrapped(fn: Any) -> bool:
    """Whether ``fn`` is a wrapper installed here."""
    return bool(getattr(fn, WRAPPED_ATTR, False))


def wrap_method(cls: type, name: str, wrap: Callable[[Any], Any]) -> bool:
    """Replace ``cls.name`` by ``wrap(original)``, marked, when ``cls`` itself defines it (an
    inherited method is left to its own class) and it is not wrapped yet; returns whether it
    wrapped. ``wrap`` should keep the original in ``__wrapped__`` (``functools.wraps``)."""
    fn = cls.__dict__.get(name)
    if fn is None or is_wrapped(fn):
        return False
    wrapped = wrap(fn)
    setattr(wrapped, WRAPPED_ATTR, True)
    setattr(cls, name, wrapped)
    return True


def unwrap_methods(cls: type, *names: str) -> bool:
    """Put back the originals of the methods of ``cls`` that :func:`wrap_method` wrapped;
    returns whether any was."""
    undone = False
    for name in names:
        fn = cls.__dict__.get(name)
        if fn is not None and is_wrapped(fn):
            setattr(cls, name, fn.__wrapped__)
            undone = True
    return undone


def patch_class_in(module: Any, name: str, patch: Callable[[type], Any]) -> None:
    """What the start-up hook calls on an executed module: ``patch(module.name)`` when the
    module defines that class."""
    cls = getattr(module, name, None)
    if cls is not None:
        patch(cls)


__all__ = ["WRAPPED_ATTR", "is_wrapped", "patch_class_in", "unwrap_methods", "wrap_method"]
