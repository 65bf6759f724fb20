"""The range check of a guard's cast to a narrower dtype (float32 -> float16), with no host
sync per cast.

A cast beyond the target's range makes ``inf``; the guard never lets it (values are clamped to
``±finfo.max`` and a :class:`~hf_precision.errors.PrecisionWarning` says so). Deciding whether
to warn means reading a value on the host: on a GPU each such read waits for every kernel
queued before it, and a read per guarded cast per step stalls the launch queue. So inside the
guards' hooks (the hot path) the check runs on the device:

* the cast's largest ``|value|`` is one reduction, the clamp two in-place passes whose bounds
  are device scalars (``±finfo.max``, or ``±inf`` where the input held ``inf`` already: those stay
  as they were, as without the guard);
* the largest value that overflowed is kept per guard and cast site (``where``, ``key``) as a
  device scalar, and **read** at the site's first cast, at every :data:`EVERY`-th cast after
  it, at each event of the guard (:func:`read_deferred`: setup, evaluation, the Trainer's
  logging steps) and at exit.

The values are never ``inf`` at any step; only the warning of an overflow after a site's first
cast can come later than the cast, at the next read (with the Trainer, at the next logging
step). Casts outside the hooks (:class:`~hf_precision.PrecisionCollator`, a direct
:func:`~hf_precision.engine.batch.cast_tensor`) run on the host's data and warn at once.

>>> import torch, warnings
>>> from hf_precision.engine.batch import cast_tensor
>>> sites: dict = {}  # a guard's sites (its GuardState holds them)
>>> with warnings.catch_warnings(record=True) as said:
...     warnings.simplefilter("always")
...     out = cast_tensor(torch.tensor([1.0, 7e4]), torch.float16, where="proj", ranges=sites)
>>> out.tolist(), len(said), sites[""].casts  # the first cast at a site is read at once
([1.0, 65504.0], 1, 1)
"""

from __future__ import annotations

import atexit
import functools
import math
import warnings

import torch

from ..errors import PrecisionWarning
from ..rules.dtypes import dtype_name

#: a site's device-side overflow record is read at its first cast and every EVERY-th after it
EVERY = 64


class Site:
    """One cast site of one guard: the largest ``|value|`` that overflowed since the last read
    (a device scalar, 0 when none), and how many casts it has seen."""

    __slots__ = ("casts", "dtype", "key", "peak", "where")

    def __init__(self, where: str, key: str, dtype: torch.dtype) -> None:
        self.where, self.key, self.dtype = where, key, dtype
        self.peak: torch.Tensor | None = None
        self.casts = 0


#: sites holding a device-side record not read yet (a guard replaced at an event keeps its
#: sites here until they are read)
_UNREAD: list[Site] = []
_AT_EXIT: list[bool] = []


@functools.cache
def _overflow_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude a cast to ``dtype`` rounds to ``inf`` (65520 for float16)."""
    info = torch.finfo(dtype)
    ulp = 2.0 ** math.floor(math.log2(info.max)) * info.eps
    return float(info.max) + ulp / 2


def clamp_on_device(
    t: torch.Tensor, out: torch.Tensor, sites: dict[str, Site], *, key: str, where: str
) -> None:
    """Clamp ``out`` (``t`` cast to a narrower dtype) so the cast made no ``inf``, and record
    the overflow at its site, all on ``out``'s device; the record is read at the site's first
    cast and every :data:`EVERY`-th (see the module docstring)."""
    dtype = out.dtype
    info = torch.finfo(dtype)
    lo, hi = torch.aminmax(t.detach())  # one reduction (vector_norm(inf) is 15x slower on CPU)
    peak = torch.maximum(hi, lo.neg())  # max |t|; NaN when t holds one
    if peak.device != out.device:
        _host_source(peak, out, key=key, where=where)
        return
    if peak.device.type == "meta":
        return  # no values to check (a model built or offloaded on meta)
    bound = torch.where(peak.isinf(), math.inf, float(info.max))
    # inputs already inf stay inf, as without the guard; two one-sided clamps with a 0-d bound
    # (clamp_(min=tensor, max=tensor) takes a slow broadcasting path on the CPU)
    out.clamp_max_(bound).clamp_min_(bound.neg())
    finite = peak.nan_to_num(nan=0.0, posinf=0.0)
    over = torch.where(finite >= _overflow_threshold(dtype), finite, 0.0)
    site = sites.get(key)
    if site is None:
        site = sites[key] = Site(where, key, dtype)
    if site.peak is not None and site.peak.device != over.device:
        _read(site)  # the module moved (offloading): say what the old device saw, start anew
    if site.peak is None:
        site.peak = over
        _UNREAD.append(site)
        if not _AT_EXIT:
            _AT_EXIT.append(True)
            atexit.register(read_deferred)
    else:
        torch.maximum(site.peak, over, out=site.peak)
    site.casts += 1
    if site.casts == 1 or site.casts % EVERY == 0:
        _read(site)


def _host_source(peak: torch.Tensor, out: torch.Tensor, *, key: str, where: str) -> None:
    """The source is on another device than the cast: a CPU batch the guard sends to the GPU
    (its largest value is read on the host, which waits for no device, where a copy of it to
    the GPU would), or a GPU tensor sent to the CPU (that copy waited for the GPU already)."""
    amax = float(peak)
    if math.isinf(amax):
        return  # inf already in the input: left as it was
    info = torch.finfo(out.dtype)
    out.clamp_(min=info.min, max=info.max)
    if amax >= _overflow_threshold(out.dtype):
        say_clamped(where, key, amax, out.dtype, late=False, stacklevel=5)


def _read(site: Site) -> None:
    """Read one site's record (a host sync when it lives on a GPU) and warn for an overflow."""
    peak = site.peak
    if peak is None:
        return
    site.peak = None
    if site in _UNREAD:
        _UNREAD.remove(site)
    amax = float(peak)
    if amax > 0:
        say_clamped(site.where, site.key, amax, site.dtype, late=site.casts > 1, stacklevel=4)


def read_deferred() -> int:
    """Read every site's device-side overflow record (one host read each) and warn for those
    that overflowed; the guards call it at their events. Returns how many sites were read."""
    sites = list(_UNREAD)
    for site in sites:
        _read(site)
    return len(sites)


def say_clamped(
    where: str, key: str, amax: float, dtype: torch.dtype, *, late: bool, stacklevel: int
) -> None:
    """The warning for values clamped instead of becoming ``inf`` (one function, so the
    message goes wherever findings go)."""
    when = (
        " (read on the device at the guard's next check, so this comes after the cast: "
        "no value became inf meanwhile)"
        if late
        else ""
    )
    warnings.warn(
        f"{where}: {key or 'tensor'} has values up to {amax:g}, beyond the "
        f"{dtype_name(dtype)} range (±{torch.finfo(dtype).max:g}); clamped instead of becoming "
        f"inf{when}. Fix: normalise the data, or use bf16.",
        PrecisionWarning,
        stacklevel=stacklevel,
    )
