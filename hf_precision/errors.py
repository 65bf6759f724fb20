"""Errors and warnings raised by hf-precision.

Every message names the module (or call), the dtypes seen and the fix, so that a user can act on
it without reading a traceback. Warnings use :class:`PrecisionWarning` so they can be filtered::

    import warnings
    from hf_precision import PrecisionWarning
    warnings.filterwarnings("ignore", category=PrecisionWarning)
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PrecisionError(ValueError, RuntimeError):
    """A dtype/device problem the guard cannot or may not fix.

    It subclasses both ``ValueError`` (bad policy values) and ``RuntimeError`` (what PyTorch
    raises for dtype mismatches), so existing ``except`` clauses keep working.

    >>> from hf_precision import PrecisionPolicy, PrecisionError
    >>> try:
    ...     PrecisionPolicy.from_preset("bf61")
    ... except PrecisionError as err:
    ...     print(str(err).splitlines()[0])
    PrecisionPolicy.from_preset('bf61'): unknown preset 'bf61'. Did you mean 'bf16'?
    """


class PrecisionWarning(UserWarning):
    """Something was fixed or left alone and the user should know about it."""


def did_you_mean(value: object, choices: Iterable[str], n: int = 1) -> str:
    """``" Did you mean 'x'?"`` for the closest of ``choices`` (up to ``n`` of them), or
    ``""``: the hint every "unknown ..." message carries.

    >>> did_you_mean("bf61", ["bf16", "fp16"]), did_you_mean("zzz", ["bf16"])
    (" Did you mean 'bf16'?", '')
    >>> did_you_mean("lava", ["llava", "llava_next", "java"], n=2)
    " Did you mean 'llava' or 'java'?"
    """
    close = [repr(c) for c in difflib.get_close_matches(str(value), list(choices), n=n)]
    if not close:
        return ""
    listed = f"{', '.join(close[:-1])} or {close[-1]}" if len(close) > 1 else close[0]
    return f" Did you mean {listed}?"


def check_model(model: object, call: str) -> None:
    """Raise a :class:`PrecisionError` that repeats ``call`` when ``model`` is not a
    ``torch.nn.Module`` (a dict of weights, a pipeline, a path), instead of an
    ``AttributeError`` from deep inside.

    >>> check_model({"a": 1}, "dtype_map(model)")
    Traceback (most recent call last):
    ...
    hf_precision.errors.PrecisionError: dtype_map(model): expected a torch.nn.Module (a ...
    """
    from torch import nn

    if isinstance(model, nn.Module):
        return
    shown = repr(model)
    shown = shown if len(shown) <= 40 else shown[:36] + "..."
    hint = (
        " For a diffusers pipeline use hf_precision.frontends.diffusion.guard_diffusion(pipe, ...)."
        if hasattr(model, "components")
        else " For a checkpoint folder or a state dict, load the model first "
        "(AutoModel...from_pretrained(path)) or use the CLI: hf-precision audit PATH."
        if isinstance(model, str | dict)
        else ""
    )
    raise PrecisionError(
        f"{call}: expected a torch.nn.Module (a transformers or PEFT model), got a value of type "
        f"{type(model).__name__}: {shown}. Fix: pass the model itself.{hint}"
    )
