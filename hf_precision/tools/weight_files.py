"""Reading weight files without their data: the safetensors headers of a folder (every shard,
checked against the files themselves), the dtypes they store, a PEFT adapter folder and a
diffusers folder or component. An unreadable file ends the command in one line with exit code
3 (:func:`~hf_precision.tools.exits.bad_weights`).

>>> SAFETENSORS_DTYPES["BF16"]
'bfloat16'
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .exits import bad_weights, fail

SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def weight_files(folder: Path, stem: str = "") -> list[Path]:
    """The folder's ``*.safetensors`` files (every shard), without diffusers' dtype variants
    (``*.fp16.safetensors``) when plain files are there too."""
    files = sorted(Path(folder).glob(f"{stem}*.safetensors"))
    plain = [f for f in files if len(f.name.split(".")) == 2]
    return plain or files


def safetensors_headers(files: list[Path]) -> dict[str, dict[str, Any]]:
    """name -> header entry (``dtype``, ``shape``) of every tensor in ``files``: the 8-byte
    length and the JSON header of each, no tensor data."""
    out: dict[str, dict[str, Any]] = {}
    for path in files:
        header = read_header(Path(path))
        out.update({k: v for k, v in header.items() if isinstance(v, dict) and "dtype" in v})
    return out


#: the first bytes of what is often saved under a .safetensors name by mistake
_MAGIC = {b"PK": "a zip archive (torch.save's format, a .bin/.pt file)", b"\x80": "a pickle"}


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file, checked against the file itself: an empty,
    truncated, corrupt or wrong-format file ends in one line and exit code 3 (no tensor data is
    read: the data offsets are compared with the file's size)."""
    import struct

    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if size < 8:
            bad_weights(path, "the file is empty" if not size else f"only {size} bytes")
        (n,) = struct.unpack("<Q", head)
        kind = next((v for k, v in _MAGIC.items() if head.startswith(k)), None)
        if n > size - 8 or n < 2:  # the magic bytes only name what the file is instead
            what = kind or f"its header length {n:,} does not fit the file of {size:,} bytes"
            bad_weights(
                path,
                f"not a safetensors file ({what}); save it with save_pretrained(..., "
                "safe_serialization=True) or safetensors.torch.save_file",
            )
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, ValueError) as err:
            bad_weights(path, f"the header is not JSON ({err}): a corrupt or partial file")
    if not isinstance(header, dict):
        bad_weights(path, "the header is not a JSON object: a corrupt file")
    ends = [
        v["data_offsets"][1]
        for v in header.values()
        if isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
    ]
    have = size - 8 - n
    if ends and max(ends) > have:
        bad_weights(
            path,
            f"truncated: the header places tensor data up to byte {max(ends):,}, the file holds "
            f"{have:,} bytes of data (an interrupted download or copy: fetch it again)",
        )
    return header


def torch_dtypes(stored: dict[str, str]) -> dict[str, Any]:
    """name -> torch dtype of the floating entries of ``{name: "BF16", ...}``."""
    import torch

    names = {k: SAFETENSORS_DTYPES.get(v) for k, v in stored.items()}
    return {k: getattr(torch, v) for k, v in names.items() if v is not None}


def stored_dtypes(folder: Path) -> dict[str, Any]:
    """name -> dtype of every floating tensor in the folder's ``*.safetensors`` files, read
    from their headers (metadata only: no tensor data is read)."""
    _check_shards(Path(folder))
    headers = safetensors_headers(weight_files(folder))
    return torch_dtypes({k: v["dtype"] for k, v in headers.items()})


def _check_shards(folder: Path) -> None:
    """Every shard ``*.safetensors.index.json`` names is in the folder, or none is (the JSON
    files alone, as ``hf download --include '*.json'`` leaves them: the dtypes then come from
    the config); some but not all is exit code 3 (a partial download would otherwise read as a
    model with fewer tensors)."""
    for index in folder.glob("*.safetensors.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as err:
            bad_weights(index, f"not a shard index ({type(err).__name__}: {err})")
        missing = sorted(f for f in shards if not (folder / f).is_file())
        if missing and len(missing) < len(shards):
            bad_weights(
                index,
                f"{len(missing)} of its {len(shards)} shards are missing ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}): an interrupted download or copy",
            )


# ---------------------------------------------------------------------------- adapters
def read_adapter(folder: Path, headers: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A PEFT adapter folder: its ``adapter_config.json`` and the dtype/shape of each tensor
    of ``adapter_model.safetensors`` (its headers, or ``headers`` already read from the Hub)."""
    try:
        config = json.loads((Path(folder) / "adapter_config.json").read_text())
    except (OSError, ValueError) as err:
        fail(f"{folder}: cannot read adapter_config.json ({err})")
    if headers:
        return {"config": config, "tensors": headers}
    files = weight_files(folder, "adapter_model")
    if not files:
        fail(f"{folder}: no adapter_model.safetensors next to adapter_config.json")
    return {"config": config, "tensors": safetensors_headers(files)}


def adapter_module_path(key: str) -> str:
    """The base model's module path of an adapter tensor: PEFT saves
    ``base_model.model.<module>.lora_A.weight``."""
    key = key.removeprefix("base_model.model.")
    return re.sub(
        r"\.(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector|modules_to_save)\b.*$", "", key
    )


# ---------------------------------------------------------------------------- diffusers
def read_diffusers(folder: Path) -> dict[str, dict[str, Any]]:
    """A diffusers folder: component -> {"class": ..., "tensors": headers} for each component
    of ``model_index.json`` that stores safetensors (schedulers, tokenizers store none)."""
    try:
        index = json.loads((Path(folder) / "model_index.json").read_text())
    except (OSError, ValueError) as err:
        fail(f"{folder}: cannot read model_index.json ({err})")
    out: dict[str, dict[str, Any]] = {}
    for name, spec in index.items():
        if (
            name.startswith("_")
            or not isinstance(spec, list)
            or (Path(folder) / name).is_dir() is False
        ):
            continue
        files = weight_files(Path(folder) / name)
        if files:
            out[name] = {
                "class": ".".join(str(x) for x in spec if x),
                "files": [f.name for f in files],
                "tensors": safetensors_headers(files),
            }
    return out


#: a diffusers component class -> its diffusion group, when the folder's name does not say it
_COMPONENT_GROUPS = (("UNet", "unet"), ("Autoencoder", "vae"), ("Transformer", "transformer"))


def read_component(folder: Path) -> dict[str, dict[str, Any]]:
    """One diffusers component folder (``unet/``, ``vae/``, ``transformer/``: a config.json with
    ``_class_name``, ``diffusion_pytorch_model*.safetensors``), in the shape of
    :func:`read_diffusers`; its group is the folder's name, else the one its class names."""
    folder = Path(folder)
    cls = str(json.loads((folder / "config.json").read_text()).get("_class_name"))
    files = weight_files(folder)
    if not files:
        fail(f"{folder}: a diffusers component ({cls}) with no *.safetensors weights")
    group = folder.resolve().name
    if group not in ("unet", "vae", "transformer") and not group.startswith("text_encoder"):
        group = next((g for k, g in _COMPONENT_GROUPS if k in cls), "other")
    return {
        folder.resolve().name: {
            "class": f"diffusers.{cls}",
            "files": [f.name for f in files],
            "tensors": safetensors_headers(files),
            "group": group,
        }
    }
