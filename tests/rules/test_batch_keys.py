"""Which floating batch keys the batch fixer casts: activations yes, metadata never, unknown
0-D/1-D tensors kept with one warning (hf_precision.rules.batch_keys)."""

from __future__ import annotations

import doctest
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from hf_precision import (
    PrecisionCollator,
    PrecisionError,
    PrecisionWarning,
    cast_batch,
    install_guards,
    register_metadata_key,
)
from hf_precision.rules import batch_keys as bk


@pytest.fixture(autouse=True)
def _registry() -> Iterator[None]:
    """Registrations and warnings of one test do not leak into the next."""
    meta, act, seen = list(bk.METADATA_KEYS), list(bk.ACTIVATION_KEYS), set(bk._seen_unknown)
    yield
    bk.METADATA_KEYS[:], bk.ACTIVATION_KEYS[:] = meta, act
    bk._seen_unknown.clear()
    bk._seen_unknown.update(seen)
    bk._cache.clear()


@pytest.mark.parametrize(
    ("key", "shape", "kind"),
    [
        ("second_per_grid_ts", (1,), "metadata"),
        ("video_second_per_grid", (2,), "metadata"),
        ("timesteps", (2,), "metadata"),
        ("sigmas", (2,), "metadata"),
        ("video_fps", (2,), "metadata"),
        ("audio_lengths", (2,), "metadata"),
        ("time_ids", (2, 6), "metadata"),  # SDXL sizes and crops: 2-D, still metadata
        ("pixel_values_videos", (64, 24), "activation"),
        ("inputs_embeds", (2,), "activation"),  # a known activation even 1-D
        ("input_features", (1, 8, 30), "activation"),
        ("attention_mask", (2, 8), "activation"),
        ("my_extra", (2, 4), "activation"),  # unknown, 2-D: shaped like an activation
        ("my_extra", (2,), "unknown_small"),
        ("my_extra", (), "unknown_small"),
    ],
)
def test_kinds(key: str, shape: tuple[int, ...], kind: str) -> None:
    assert bk.batch_key_kind(key, torch.zeros(shape)) == kind


def test_metadata_and_unknown_small_keep_their_dtype_unknown_said_once() -> None:
    batch = {
        "pixel_values": torch.rand(2, 3, 4, 4),
        "sigmas": torch.tensor([0.416667, 14.6146]),
        "speed": torch.tensor([0.416667, 3.0]),
        "ids": torch.tensor([1, 2]),
    }
    with pytest.warns(PrecisionWarning, match=r"(?s)'speed' is a 1-D float32.*register_metadata"):
        out = cast_batch(batch, torch.bfloat16)
    assert out["pixel_values"].dtype == torch.bfloat16
    assert out["sigmas"] is batch["sigmas"] and out["speed"] is batch["speed"]
    assert out["ids"] is batch["ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per key
        assert cast_batch(batch, torch.bfloat16)["speed"] is batch["speed"]


def test_registration_both_ways_and_batch_key_groups_win() -> None:
    clip = torch.tensor([[0.416667, 2.0]])
    register_metadata_key("clip_speed")
    out = PrecisionCollator(lambda f: f[0], "bf16")([{"clip_speed": clip}])
    assert out["clip_speed"] is clip  # 2-D, but registered: not cast
    bk.register_activation_key("Gain")  # names are matched lower-case
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cast_batch({"gain": torch.rand(2)}, torch.bfloat16)["gain"].dtype == torch.bfloat16
    # a key the user names in batch_key_groups follows that group, registered or not
    out = cast_batch({"clip_speed": clip}, torch.float32, key_dtypes={"clip_speed": torch.float16})
    assert out["clip_speed"].dtype == torch.float16
    for bad in ("", "  ", 3):
        with pytest.raises(PrecisionError, match=r"non-empty string.*Fix: register_metadata_key"):
            register_metadata_key(bad)  # type: ignore[arg-type]


def test_positional_metadata_arguments_of_the_model_keep_their_dtype() -> None:
    """The batch hook names a positional argument by ``forward``'s parameter: a model called
    ``model(pixels, clip_fps)`` gets its frame rate unrounded (29.97 is 30.0 in bf16)."""

    class Clip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.seen: list[torch.Tensor] = []

        def forward(self, pixel_values: torch.Tensor, clip_fps: torch.Tensor) -> torch.Tensor:
            self.seen.append(clip_fps)
            return self.proj(pixel_values) * clip_fps.to(pixel_values.dtype)[:, None]

    model = Clip().to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)  # a bare model: no groups found
        install_guards(model, "bf16-true")
    fps = torch.tensor([29.97, 25.0])
    assert model(torch.rand(2, 4), fps).dtype == torch.bfloat16
    assert model.seen[-1].dtype == torch.float32 and torch.equal(model.seen[-1], fps)


def test_module_doctests() -> None:
    result = doctest.testmod(bk, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 6 and result.failed == 0


def test_metadata_passed_down_by_name_is_kept_at_the_module_guards() -> None:
    """Trainer passes ``num_items_in_batch`` (the loss's token count) to ``forward``, and
    LLaVA hands its kwargs down to the vision tower: neither the batch hook nor the tower's
    boundary guard rounds it (1001 is 1000 in bf16)."""
    from hf_precision import enforce_policy
    from hf_precision.tiny import tiny_batch, tiny_llava

    model = tiny_llava(torch.bfloat16)
    model.model.multi_modal_projector.float()  # a mixed model: boundary guards at work
    report = enforce_policy(model, "bf16-true")
    install_guards(model, "bf16-true", report)
    seen: list[torch.Tensor] = []
    model.model.vision_tower.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["num_items_in_batch"]), with_kwargs=True
    )
    count = torch.tensor(1001.0)
    with torch.no_grad():
        model(**tiny_batch(model), num_items_in_batch=count)
    assert seen and seen[-1].dtype == torch.float32 and float(seen[-1]) == 1001.0
