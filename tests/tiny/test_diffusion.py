"""OneTrainer-style denoiser: fp32 trains; fp16/bf16 fail at the time embedding, then conv_in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_precision.tiny.diffusion import (
    OneTrainerTiny,
    collate_onetrainer,
    get_timestep_embedding,
    onetrainer_batch,
    onetrainer_examples,
)

HALF = [(torch.float16, "Half"), (torch.bfloat16, "BFloat16")]


def test_fp32_forward_backward() -> None:
    model = OneTrainerTiny()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    batch = onetrainer_batch()
    out = model(**batch)
    assert out.sample.shape == batch["latents"].shape and out.sample.dtype == torch.float32
    assert out.loss is not None and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.time_embedding[0].weight.grad is not None
    assert model.conv_in.weight.grad is not None


@pytest.mark.parametrize(("dtype", "name"), HALF)
def test_collator_mask_is_fp32(dtype: torch.dtype, name: str) -> None:
    batch = collate_onetrainer(onetrainer_examples(3, dtype=dtype))
    assert batch["latents"].dtype == dtype and batch["target"].dtype == dtype
    assert batch["latent_mask"].dtype == torch.float32  # the GenerateImageLike bug
    assert batch["latent_mask"].shape == (3, 1, 8, 8) and bool((batch["latent_mask"] == 1).all())
    assert batch["timesteps"].dtype == torch.int64
    assert torch.cat([batch["latents"], batch["latent_mask"]], 1).dtype == torch.float32
    assert get_timestep_embedding(batch["timesteps"], 16).dtype == torch.float32


@pytest.mark.parametrize(("dtype", "name"), HALF)
def test_half_failures_reproduce_on_cpu(dtype: torch.dtype, name: str) -> None:
    model = OneTrainerTiny(dtype=dtype)
    batch = onetrainer_batch(dtype=dtype)
    # 1. fp32 sinusoidal embedding into the half time_embedding linear.
    mat = f"mat1 and mat2 must have the same dtype, but got Float and {name}"
    with pytest.raises(RuntimeError, match=mat):
        model(**batch)

    # 2. With that input cast (what leaf input casting does), the fp32 mask breaks conv_in.
    def cast_to_weight(module: nn.Linear, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        return (args[0].to(module.weight.dtype),)

    model.time_embedding[0].register_forward_pre_hook(cast_to_weight)
    with pytest.raises(RuntimeError, match=rf"Input type \(float\) and bias type \(c10::{name}\)"):
        model(**batch)

    # 3. With the mask in the model dtype too, half precision runs.
    out = model(**{**batch, "latent_mask": batch["latent_mask"].to(dtype)})
    assert out.sample.dtype == dtype
    assert out.loss is not None and torch.isfinite(out.loss)
