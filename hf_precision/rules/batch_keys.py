"""Which floating batch keys are activations (cast to the policy) and which are metadata
(counts, times, scales: never cast).

The batch fixer (the batch hook, :class:`~hf_precision.PrecisionCollator`, the accelerate
plugin's loader) asks :func:`batch_key_kind` before it casts a floating tensor:

1. a key the user names in ``batch_key_groups`` follows that group (cast);
2. a registered metadata key (:data:`METADATA_KEYS`, :func:`register_metadata_key`) is never
   cast, only moved to the model's device;
3. a known activation input (:data:`ACTIVATION_KEYS`: ``pixel_values*``, ``*_embeds``,
   ``*_features``, ``input_values``, ``latents``, attention masks …) is cast;
4. a key nobody registered is cast when it is 2-D or more (what transformers' models take as
   activations: ``(batch, ...)`` tensors) and left as it is when it is 0-D or 1-D (one value
   per sample, video or clip: a time, a count, a scale), with one warning per key naming
   :func:`register_metadata_key` and ``batch_key_groups``.

Why: in transformers 5.x every floating activation a model's ``forward`` takes is at least
2-D (``pixel_values`` (B, C, H, W) or Qwen's flattened patches (N, C·T·P·P),
``input_features`` (B, mel, T), ``input_values`` (B, T), ``inputs_embeds`` (B, S, H), masks
(B, S)), while its floating metadata is one value per sample or per video
(Qwen2.5-VL's ``second_per_grid_ts``, Qwen2.5-Omni's ``video_second_per_grid``, diffusion
timesteps and sigmas). Metadata multiplies integer aranges into position ids or feeds a
sinusoidal embedding made in fp32: rounded to bf16 (0.416667 -> 0.416016) it moves positions
with no error. A tensor kept in fp32 by mistake costs a cast at its consumer (autocast or
the module guards do it); a rounded one cannot be restored. So the unknown small tensor is
kept, and said.

>>> import torch
>>> from hf_precision import register_metadata_key
>>> from hf_precision.rules.batch_keys import batch_key_kind
>>> batch_key_kind("second_per_grid_ts", torch.tensor([0.416667]))
'metadata'
>>> register_metadata_key("clip_speed")
>>> batch_key_kind("clip_speed", torch.rand(2, 3))
'metadata'
>>> batch_key_kind("pixel_values_videos", torch.rand(8, 24))
'activation'
"""

from __future__ import annotations

import re
import warnings
from typing import Literal

import torch

from ..base.registry import add_entry
from ..errors import PrecisionError, PrecisionWarning

#: Batch keys never cast (targets are compared, not computed with).
DEFAULT_SKIP_KEYS: tuple[str, ...] = (
    "labels",
    "label",
    "label_ids",
    "targets",
    "target",
    # made by the model itself and handed back by generate(): not batch data
    "mm_encoder_outputs",
    "encoder_outputs",
    "past_key_values",
)
#: Batch keys that follow a group's dtype rather than the compute dtype.
DEFAULT_KEY_GROUPS: dict[str, str] = {
    "pixel_values": "vision_encoder",
    "pixel_values_videos": "vision_encoder",
    "images": "vision_encoder",
    "image": "vision_encoder",
}

KeyKind = Literal["metadata", "activation", "unknown_small"]
#: Diffusion timesteps: metadata for every policy; the diffusion presets also skip them
#: entirely (not even moved), and the denoiser's leaf guards cast them at their consumer.
TIMESTEP_KEYS: tuple[str, ...] = ("timestep", "timesteps")

#: Floating batch keys that are metadata: exact names or ``glob patterns (``*`` any run).
#: What the models in transformers 5.x and diffusers read as times, counts and scales.
METADATA_KEYS: list[str] = [
    # Qwen2.5-VL / Qwen2.5-Omni / Qwen3-Omni: seconds per temporal grid -> M-RoPE temporal ids
    "second_per_grid_ts",
    "second_per_grids",
    "video_second_per_grid",
    # diffusion: noise level / time (sinusoidal embeddings made in fp32)
    *TIMESTEP_KEYS,
    "sigma",
    "sigmas",
    "*_timestep",
    "*_timesteps",
    "*_sigmas",
    # SDXL micro-conditioning: original size, crop, target size (ints beyond bf16's 256)
    "time_ids",
    "add_time_ids",
    # Trainer's token count for the loss (a 0-D tensor passed to forward and down to modules)
    "num_items_in_batch",
    # frame rates, durations, lengths, ratios, guidance
    "fps",
    "*_fps",
    "duration",
    "durations",
    "*_duration",
    "*_durations",
    "*_seconds",
    "lengths",
    "*_lengths",
    "*_lens",
    "*_ratio",
    "*_ratios",
    "guidance",
    "guidance_scale",
]

#: Floating batch keys that are activation inputs of a model (cast to the policy).
ACTIVATION_KEYS: list[str] = [
    "pixel_values*",
    "*pixel_values",
    "images",
    "image",
    "inputs_embeds",
    "*_embeds",
    "*_embeddings",
    "*_features",
    "input_features",
    "input_values",
    "*_input_values",
    "*hidden_states",
    "latents",
    "*_latents",
    "noise",
    "sample",
    "*mask*",  # float attention masks and additive biases (sentinels kept finite)
    "*_bias",
]

_seen_unknown: set[str] = set()


def _check_name(name: object, call: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise PrecisionError(
            f"{call}: a batch key is a non-empty string (an exact name or a pattern with '*' "
            f"such as '*_fps'), got {name!r}. Fix: {call.split('(')[0]}('clip_fps')."
        )
    return name.strip().lower()


def register_metadata_key(name: str) -> None:
    """Never cast the floating batch key ``name`` (an exact name or a glob pattern with ``*``):
    the batch fixer keeps its dtype and only moves it to the model's device.

    >>> import torch
    >>> from hf_precision import PrecisionCollator, register_metadata_key
    >>> register_metadata_key("frame_seconds")
    >>> collate = PrecisionCollator(lambda f: f[0], "bf16")
    >>> batch = collate([{"frame_seconds": torch.rand(2, 8), "pixel_values": torch.rand(2, 3)}])
    >>> batch["frame_seconds"].dtype, batch["pixel_values"].dtype
    (torch.float32, torch.bfloat16)
    """
    _add_key(METADATA_KEYS, name, "register_metadata_key(name)")


def register_activation_key(name: str) -> None:
    """Always cast the floating batch key ``name`` (exact or a ``*`` pattern), even when
    it is 0-D or 1-D; a registered metadata key of the same name still wins."""
    _add_key(ACTIVATION_KEYS, name, "register_activation_key(name)")


def _add_key(keys: list[str], name: str, call: str) -> None:
    """Add a key (lowercase, stripped) to a key list; adding one it holds is harmless."""
    name = _check_name(name, call)

    def add(key: str) -> None:
        if key not in keys:
            keys.append(key)
        _cache.clear()

    add_entry(
        call,
        name,
        pattern=None,
        example="'clip_fps'",
        exists=keys.__contains__,
        add=add,
        duplicate="keep",
    )


def _glob(key: str, pattern: str) -> bool:
    """``fnmatch`` for ``*`` alone, with ``str`` methods (``torch.compile`` traces them; it
    breaks the graph on ``fnmatch``'s regex cache)."""
    parts = pattern.split("*")
    if len(parts) == 1:
        return key == pattern
    head, *middle, tail = parts
    if len(key) < len(head) + len(tail) or not key.startswith(head) or not key.endswith(tail):
        return False
    pos, end = len(head), len(key) - len(tail)
    for part in middle:
        found = key.find(part, pos, end)
        if found < 0:
            return False
        pos = found + len(part)
    return True


def _matches(key: str, patterns: list[str]) -> bool:
    return any(_glob(key, p) for p in patterns)


def _name_kind(key: str) -> KeyKind | None:
    low = key.lower()
    if _matches(low, METADATA_KEYS):
        return "metadata"
    if _matches(low, ACTIVATION_KEYS):
        return "activation"
    return None


# the batch hook asks per key per step: names are classified once (cleared on registration)
_cache: dict[str, KeyKind | None] = {}


def _kind(key: str) -> KeyKind | None:
    try:
        return _cache[key]
    except KeyError:
        out = _cache[key] = _name_kind(key)
        return out


def is_metadata_key(key: str) -> bool:
    """``key`` is a registered metadata key (never cast)."""
    return bool(key) and _kind(key) == "metadata"


def batch_key_kind(key: str, tensor: torch.Tensor) -> KeyKind:
    """What the floating tensor at batch key ``key`` is: ``metadata`` (a registered name:
    never cast), ``activation`` (a known input, or an unknown key 2-D or more: cast) or
    ``unknown_small`` (an unknown 0-D/1-D tensor: kept, with one warning per key)."""
    kind = _kind(key) if key else None
    if kind is not None:
        return kind
    if tensor.dim() >= 2 or not key or _POSITIONAL.fullmatch(key):
        return "activation"
    return "unknown_small"


# unnamed positional inputs ("input 0") of a module's forward
_POSITIONAL = re.compile(r"input \d+")


def notice_unknown(key: str, tensor: torch.Tensor, where: str) -> None:
    """Say once per key that an unknown small floating tensor was left as it is."""
    if key in _seen_unknown or torch.compiler.is_compiling():
        return
    _seen_unknown.add(key)
    warnings.warn(
        f"{where}: batch key {key!r} is a {tensor.dim()}-D "
        f"{str(tensor.dtype).replace('torch.', '')} tensor of shape {tuple(tensor.shape)} that "
        "no rule names: left as it is (one value per sample looks like metadata: a time, a "
        "count, a scale; rounding it would be silent). Fix: "
        f"hf_precision.register_metadata_key({key!r}) to keep it so without this warning, or "
        f"hf_precision.rules.batch_keys.register_activation_key({key!r}) to have it cast.",
        PrecisionWarning,
        stacklevel=4,
    )
