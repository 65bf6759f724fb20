"""What a group rule is made of: the group names (built-in and registered) and the
:class:`GroupRule` value. The registry of rules is :mod:`~.registry`; finding
the groups of a model is :mod:`~.module_groups`.

>>> from hf_precision.rules.groups.group_rule import GroupRule
>>> GroupRule("my_vlm", paths={"language_model": "decoder"}).paths
{'language_model': ('decoder',)}
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

from ...base.registry import add_entry
from ...errors import PrecisionError

#: The groups every VLM rule speaks of, in forward order.
VLM_GROUPS: tuple[str, ...] = (
    "vision_encoder",
    "resampler",
    "projector",
    "language_model",
    "lm_head",
)
#: Parameters outside every group.
OTHER = "other"
# Groups that build tensors inside forward, so their leaves are guarded under
# ``leaf_guards="auto"`` even when their weights agree: resamplers (MiniCPM-V 2.x's numpy sin-cos
# table is fp32 whatever the weights are) and, registered by :mod:`.diffusion`, denoisers
# (the sinusoidal timestep embedding is made in fp32). Changed only by ``register_group``.
_LEAF_GUARDED: set[str] = {"resampler"}
#: Every group name, in forward order: built-in, then registered (:func:`register_group`).
GROUP_NAMES: list[str] = [*VLM_GROUPS[:3], "audio_encoder", *VLM_GROUPS[3:]]
#: What a group or rule name looks like.
NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_GROUP_NAME_RE = re.compile(rf"^(?!{OTHER}$)[a-z][a-z0-9_]*$")


def register_group(name: str, *, leaf_guarded: bool = False) -> str:
    """Declare a new group name (lowercase, ``[a-z0-9_]``) so policies may refer to it, with its
    properties: ``leaf_guarded=True`` for a group that builds tensors inside forward (its
    leaves are guarded under ``leaf_guards="auto"`` even when its weights agree). Declaring a
    known group again keeps it (and may mark it leaf-guarded).

    >>> register_group("resampler")  # a known group is kept as it is
    'resampler'
    """

    def add(group: str) -> str:
        if group not in GROUP_NAMES:
            GROUP_NAMES.append(group)
        if leaf_guarded:
            _LEAF_GUARDED.add(group)
        return group

    return add_entry(
        f"register_group({name!r})",
        name,
        pattern=_GROUP_NAME_RE,
        example="'depth_encoder'",
        exists=GROUP_NAMES.__contains__,
        add=add,
        duplicate="keep",
        rule=f"group names are lowercase identifiers ([a-z][a-z0-9_]*) and not {OTHER!r}",
    )


def group_names() -> tuple[str, ...]:
    """Every known group name (built-in and registered)."""
    return tuple(GROUP_NAMES)


def leaf_guarded_groups() -> tuple[str, ...]:
    """The groups registered ``leaf_guarded=True``, sorted."""
    return tuple(sorted(_LEAF_GUARDED))


PathMap = Mapping[str, "tuple[str, ...] | str"]


def _norm(call: str, what: str, value: PathMap) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for group, paths in value.items():
        # A bare string would otherwise be iterated character by character.
        items = (paths,) if isinstance(paths, str) else tuple(paths)
        # "" (paths only) is the model itself: a denoiser or text encoder that is one group.
        if not all(isinstance(p, str) and (p or what == "paths") for p in items):
            raise PrecisionError(
                f"{call}: {what}[{group!r}]={paths!r} must be module paths (non-empty strings). "
                f"Fix: {what}={{{group!r}: ('model.vision_tower',)}}."
            )
        out[group] = items
    return out


@dataclass(frozen=True)
class GroupRule:
    """How to find the groups of one architecture family.

    ``paths`` maps a group to candidate module paths (the first that exists wins); ``extra``
    adds every listed module that exists (a second tower, a deepstack merger list); ``params``
    maps a group to direct parameters it owns (``image_newline``, ``query_tokens``,
    ``latent_query``). A bare string counts as a one-element tuple; the path ``""`` in
    ``paths`` is the model itself (a diffusers UNet found on its own is wholly ``unet``).
    """

    name: str
    paths: PathMap
    model_types: tuple[str, ...] = ()
    params: PathMap = field(default_factory=dict)
    required: tuple[str, ...] = ("language_model",)
    match: Callable[[nn.Module], bool] | None = None
    extra: PathMap = field(default_factory=dict)
    #: What the rule covers beyond ``model_types``, in words (remote-code families).
    note: str = ""
    #: A group's former name under this rule -> its name now (Qwen2-VL's merger was the
    #: ``resampler``, it is the ``projector``): a policy naming the old one still reaches it.
    renamed: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        call = f"GroupRule(name={self.name!r})"
        for attr in ("paths", "params", "extra"):
            object.__setattr__(self, attr, _norm(call, attr, getattr(self, attr)))
        object.__setattr__(self, "renamed", dict(self.renamed))
        if isinstance(self.model_types, str):
            object.__setattr__(self, "model_types", (self.model_types,))

    def applies_to(self, root: nn.Module, model_type: str | None) -> bool:
        if model_type is not None and model_type in self.model_types:
            return True
        return self.match is not None and bool(self.match(root))
