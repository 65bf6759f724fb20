"""hf_precision.rules.roles: what a tensor is by the module that holds it."""

from __future__ import annotations

import torch
from torch import nn

from hf_precision.rules.roles import is_norm_module, is_rotary_module, tensor_role


class MyRMSNorm(nn.Module):  # remote code's norm: recognised by class name
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


class Rope(nn.Module):  # a rotary module known by its state, not its name
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(2))
        self.register_buffer("steps", torch.arange(3))


def test_norms_by_type_and_by_class_name() -> None:
    assert is_norm_module(nn.LayerNorm(4)) and is_norm_module(MyRMSNorm())
    assert not is_norm_module(nn.Linear(4, 4))


def test_roles_of_norm_weights_and_rotary_buffers() -> None:
    norm, linear, rope = nn.LayerNorm(4), nn.Linear(4, 4), Rope()
    assert tensor_role(norm, "weight", norm.weight, is_buffer=False) == "norm"
    assert tensor_role(linear, "bias", linear.bias, is_buffer=False) is None
    assert is_rotary_module(rope)
    assert tensor_role(rope, "inv_freq", rope.inv_freq, is_buffer=True) == "rotary"
    # an integer buffer of a rotary module is no table to keep fp32
    assert tensor_role(rope, "steps", rope.steps, is_buffer=True) is None


def test_zero_d_floating_tensors_are_scalars() -> None:
    from torch import nn

    lin, norm = nn.Linear(2, 2), nn.LayerNorm(2)
    alpha = torch.tensor(0.3)
    assert tensor_role(lin, "alpha", alpha, is_buffer=True) == "scalar"
    assert tensor_role(lin, "logit_scale", nn.Parameter(alpha), is_buffer=False) == "scalar"
    assert tensor_role(norm, "temperature", nn.Parameter(alpha), is_buffer=False) == "scalar"
    assert tensor_role(lin, "steps", torch.tensor(3), is_buffer=True) is None  # not floating
    assert tensor_role(lin, "scale", torch.tensor([0.3]), is_buffer=True) is None  # 1-D
    assert tensor_role(nn.Module(), "inv_freq", alpha, is_buffer=True) == "rotary"
