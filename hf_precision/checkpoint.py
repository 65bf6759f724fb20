"""Reading a checkpoint without its weights: where a source points, its config, the model
classes it names, a bare model on the meta device, the dtypes its safetensors store.

Shared by the CLI's ``audit`` (:mod:`hf_precision.cli`) and ``doctor``
(:mod:`hf_precision.doctor`); nothing here parses arguments.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from .errors import did_you_mean


def fail(message: str) -> NoReturn:
    print(f"hf-precision: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ---------------------------------------------------------------------------- sources
def resolve_source(source: str) -> tuple[str, Any]:
    """``("path", config_path)`` for folders/files, ``("type", model_type)`` otherwise."""
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            fail(
                f"{source}: no config.json in this folder (expected a checkpoint folder, "
                "a config.json or a model type)"
            )
        return "path", path
    if path.is_file():
        if path.suffix != ".json":
            fail(f"{source}: expected a config.json, a checkpoint folder or a model type")
        return "path", path
    if os.sep in source or source.endswith(".json"):
        fail(f"{source}: no such file or folder")
    return "type", source


def load_config(kind: str, where: Any) -> Any:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if kind == "path":
        try:
            return AutoConfig.from_pretrained(str(where), local_files_only=True)
        except (OSError, ValueError, KeyError) as err:
            fail(f"{where}: cannot read the config ({str(err).splitlines()[0]})")
    if where not in CONFIG_MAPPING_NAMES:
        hint = did_you_mean(where, CONFIG_MAPPING_NAMES, n=3)
        fail(
            f"unknown model type {where!r}.{hint} Allowed: a checkpoint folder, a config.json, "
            "or a transformers model type such as llava, idefics2, qwen2_vl, paligemma."
        )
    return AutoConfig.for_model(where)


def model_classes(config: Any) -> list[Any]:
    import transformers

    out = [
        getattr(transformers, a)
        for a in (getattr(config, "architectures", None) or [])
        if hasattr(transformers, a)
    ]
    for auto in ("AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModel"):
        out.append(getattr(transformers, auto))
    return out


def build_model(config: Any, *, meta: bool, dtype: Any = None, exit_on_error: bool = True) -> Any:
    import torch

    errors = []
    for cls in model_classes(config):
        try:
            kwargs = {"dtype": dtype} if dtype is not None else {}
            with torch.device("meta") if meta else contextlib.nullcontext():
                return (
                    cls.from_config(config, **kwargs)
                    if cls.__name__.startswith("Auto")
                    else cls._from_config(config, **kwargs)
                )
        except (ValueError, KeyError, TypeError, AttributeError, ImportError) as err:
            text = " ".join(str(err).split())  # ImportError texts start with a blank line
            errors.append(f"{cls.__name__}: {text[:160]}")
    message = f"cannot build a model for {type(config).__name__}: {'; '.join(errors)}"
    if not exit_on_error:
        raise _BuildError(message, errors[0] if errors else "")
    fail(message)


#: Default configs of some model types do not build without values a checkpoint (or its
#: tokenizer) supplies; the smallest repair that makes each build, for a bare-type audit.
CONFIG_REPAIRS: dict[str, Any] = {
    # SigLIP default width 1152 with 14 heads: not divisible.
    "aya_vision": lambda c: setattr(c.vision_config, "num_attention_heads", 16),
    # The VQ token map comes from the tokenizer of a checkpoint.
    "chameleon": lambda c: setattr(c, "vocabulary_map", {"<image>": 8711}),
    "emu3": lambda c: setattr(c, "vocabulary_map", {"<image>": 8711, "<|extra_200|>": 8712}),
    "hunyuan_vl": lambda c: setattr(c.text_config, "head_dim", 128),
    "granite4_vision": lambda c: c.__dict__.update(
        deepstack_layer_map=[(0, 0)], downsample_rate="2/4"
    ),
    "deepseek_ocr2": lambda c: setattr(
        c.text_config, "mlp_layer_types", ["dense"] * c.text_config.num_hidden_layers
    ),
}


def fill_subconfigs(config: Any) -> bool:
    """Default configs of some omni models leave ``vision_config`` (and audio) ``None``: fill
    them with the concrete sub-config classes' defaults so the towers are built."""
    if getattr(config, "vision_config", 0) is not None:
        return False
    filled = False
    for key, cls in getattr(config, "sub_configs", {}).items():
        if getattr(config, key, 0) is None and cls.__name__ != "AutoConfig":
            setattr(config, key, cls())
            filled = True
    return filled


def build_bare(model_type: str, dtype: Any = None) -> tuple[Any, str | None]:
    """A model type's default config built on the meta device (repaired when the default does
    not build: see :data:`CONFIG_REPAIRS`), and a note saying what was filled or repaired."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    note = (
        "vision/audio sub-configs filled with their defaults" if fill_subconfigs(config) else None
    )
    try:
        return build_model(config, meta=True, dtype=dtype, exit_on_error=False), note
    except _BuildError as err:
        repair = CONFIG_REPAIRS.get(model_type)
        if repair is None:
            fail(str(err))
        config = AutoConfig.for_model(model_type)
        fill_subconfigs(config)
        repair(config)
        return build_model(config, meta=True, dtype=dtype), (
            f"default config repaired for the audit ({err.first})"
        )


class _BuildError(Exception):
    def __init__(self, message: str, first: str) -> None:
        super().__init__(message)
        self.first = first


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_dtypes(folder: Path) -> dict[str, Any]:
    """name -> dtype of every floating tensor in the folder's ``*.safetensors`` files, read
    from their headers (metadata only: no tensor data is read)."""
    import struct

    import torch

    out: dict[str, Any] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            dt = _SAFETENSORS_DTYPES.get(meta.get("dtype", "")) if isinstance(meta, dict) else None
            if dt is not None:
                out[name] = getattr(torch, dt)
    return out


def _model_keys(model: Any, key: str, renamings: list[Any]) -> list[str]:
    """Names a stored key may have in the model: itself, after transformers' checkpoint
    renamings (legacy layouts such as ``language_model.model.*``), with one ``model.`` segment
    dropped or added."""
    out = [key]
    for r in renamings:
        try:
            new, _ = r.rename_source_key(out[-1])
        except Exception:  # renaming objects differ between transformers versions
            continue
        if new and new != out[-1]:
            out.append(new)
    for k in list(out):
        parts = k.split(".")
        out += [".".join(parts[:i] + parts[i + 1 :]) for i, p in enumerate(parts) if p == "model"]
        out.append("model." + k)
    return out


def apply_stored_dtypes(model: Any, stored: dict[str, Any]) -> tuple[int, int]:
    """Give the meta model's tensors the dtypes they are stored in (matched by name, through
    transformers' checkpoint renamings); returns (matched, stored) counts."""
    import torch

    try:  # transformers 5.x: how legacy checkpoint keys map to module names
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        renamings = list(get_checkpoint_conversion_mapping(model.config.model_type) or ())
    except (ImportError, AttributeError, KeyError):
        renamings = []
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    matched = 0
    with torch.no_grad():
        for key, dt in stored.items():
            name = next((k for k in _model_keys(model, key, renamings) if k in tensors), None)
            if name is None:
                continue
            t = tensors[name]
            if t.is_floating_point() and t.dtype != dt:
                t.data = torch.empty_like(t, dtype=dt, device="meta")
            matched += 1
    return matched, len(stored)


def set_trainable(model: Any, spec: str) -> None:
    from .groups import find_module_groups, group_names

    want = [s.strip() for s in spec.split(",") if s.strip()]
    for w in want:
        if w not in (*group_names(), "all", "none", "other"):
            fail(
                f"--trainable: unknown group {w!r}.{did_you_mean(w, group_names())} "
                f"Allowed: {', '.join(group_names())}, other, all, none"
            )
    groups = find_module_groups(model)
    for name, p in model.named_parameters():
        p.requires_grad_("all" in want or groups.group_of(name) in want)
