"""The guards' range check before a downcast (``hf_precision.engine.range_check``): no host read
per cast, values never ``inf``, the warning at the next read."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hf_precision import PrecisionWarning, enforce_policy, install_guards
from hf_precision.engine import range_check
from hf_precision.engine.batch import cast_tensor
from hf_precision.tiny import tiny_batch, tiny_llava

#: what reads a tensor's value on the host (a device sync on a GPU)
_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__"}
_PACKAGE = str(__import__("hf_precision").__file__).rsplit("/", 1)[0]


class HostReads(TorchFunctionMode):
    """Counts the host reads hf-precision's own code makes (the model's own are not ours)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in _READS:
            frame: Any = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            caller = frame.f_code.co_filename if frame is not None else ""
            if caller.startswith(_PACKAGE):
                self.reads.append(f"{func.__name__} in {caller.rsplit('/', 1)[-1]}")
        return func(*args, **(kwargs or {}))


def _guarded_fp16() -> tuple[Any, dict[str, torch.Tensor]]:
    model = tiny_llava(torch.float16)
    install_guards(model, "fp16-true", enforce_policy(model, "fp16-true"))
    batch = tiny_batch(model)
    assert batch["pixel_values"].dtype == torch.float32  # the batch guard casts it every step
    return model.eval(), batch


def test_guarded_fp16_forwards_read_nothing_on_the_host():
    model, batch = _guarded_fp16()
    with torch.no_grad():
        model(**batch)  # a site's first cast is read at once (once per guard)
        with HostReads() as seen:
            for _ in range(5):
                out = model(**batch)
    assert torch.isfinite(out.logits).all()
    assert seen.reads == []  # main: __bool__ in batch.py at every fp16 cast


def test_an_overflow_is_clamped_at_once_and_said_at_the_next_read():
    model, batch = _guarded_fp16()
    range_check.read_deferred()  # nothing left over from other tests
    with torch.no_grad():
        model(**batch)
        big = {**batch, "pixel_values": batch["pixel_values"].clone()}
        big["pixel_values"][0, 0, 0, 0] = 1e6  # beyond ±65504
        with warnings.catch_warnings():
            warnings.simplefilter("error", PrecisionWarning)  # nothing said during the step
            out = model(**big)
    assert torch.isfinite(out.logits).all()  # clamped on the device: never inf
    with pytest.warns(PrecisionWarning, match=r"pixel_values has values up to 1e\+06") as said:
        assert range_check.read_deferred() >= 1
    assert "beyond the float16 range" in str(said[0].message)
    assert "next check" in str(said[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        range_check.read_deferred()  # read once: said once


def test_every_nth_cast_is_read_without_an_event():
    sites: dict[str, range_check.Site] = {}
    x = torch.ones(4)
    cast_tensor(x, torch.float16, key="k", where="w", ranges=sites)  # first: read at once
    big = torch.tensor([1.0, 7e4])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        for _ in range(range_check.EVERY - 2):
            out = cast_tensor(big, torch.float16, key="k", where="w", ranges=sites)
    assert out.tolist() == [1.0, torch.finfo(torch.float16).max]
    with pytest.warns(PrecisionWarning, match="up to 70000"):
        cast_tensor(big, torch.float16, key="k", where="w", ranges=sites)  # the EVERY-th
    assert sites["k"].casts == range_check.EVERY and sites["k"].peak is None


def test_inf_and_nan_already_there_stay_and_are_not_blamed_on_the_cast():
    sites: dict[str, range_check.Site] = {}
    x = torch.tensor([float("inf"), -1.0, 7e4])
    y = torch.tensor([float("nan"), 7e4])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        out = cast_tensor(x, torch.float16, key="a", where="w", ranges=sites)
    assert out[0].item() == float("inf")  # as without the guard: the input was inf
    # a NaN input: the largest |value| reads NaN, so only the clamp is sure (the non-finite
    # blame names where NaN came from); the NaN stays and no value becomes inf
    out = cast_tensor(y, torch.float16, key="b", where="w", ranges=sites)
    assert out[0].isnan() and out[1].item() == torch.finfo(torch.float16).max


def test_a_host_source_moved_to_another_device_is_read_on_the_host():
    # a CPU batch the guard sends to the model's device: its values are read where they are
    # (no device waits for that), never copied over for the check
    sites: dict[str, range_check.Site] = {}
    big = torch.tensor([1.0, 7e4])
    with pytest.warns(PrecisionWarning, match="up to 70000"):
        out = cast_tensor(
            big, torch.float16, torch.device("meta"), key="k", where="w", ranges=sites
        )
    assert out.device.type == "meta" and out.dtype == torch.float16 and not sites
    # on meta itself there are no values: nothing checked, nothing recorded to read later
    cast_tensor(big.to("meta"), torch.float16, key="k", where="w", ranges=sites)
    assert not sites


@pytest.mark.gpu
def test_on_cuda_a_site_follows_its_module_between_devices():
    sites: dict[str, range_check.Site] = {}
    big = torch.tensor([1.0, 7e4])
    cast_tensor(torch.ones(2), torch.float16, key="k", where="w", ranges=sites)  # read at once
    cast_tensor(big, torch.float16, key="k", where="w", ranges=sites)  # recorded on the CPU
    with pytest.warns(PrecisionWarning, match="up to 70000"):  # moved: the CPU record is read
        out = cast_tensor(big.cuda(), torch.float16, key="k", where="w", ranges=sites)
    assert out.device.type == "cuda" and torch.isfinite(out).all()


@pytest.mark.gpu
def test_on_cuda_guarded_fp16_forwards_read_nothing_and_clamp_on_the_device():
    model, batch = _guarded_fp16()
    model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}  # fp32 pixel_values, cast on the GPU
    range_check.read_deferred()
    with torch.no_grad():
        model(**batch)  # the first cast of each site is read once
        batch["pixel_values"][0, 0, 0, 0] = 1e6
        with HostReads() as seen:
            for _ in range(3):
                out = model(**batch)
    assert seen.reads == []
    assert torch.isfinite(out.logits).all()
    with pytest.warns(PrecisionWarning, match=r"values up to 1e\+06"):
        range_check.read_deferred()
