"""Reading a checkpoint without its weights: where a source points (a folder, a config.json, a
model type, a Hub id through the local cache or the Hub, a PEFT adapter folder, a diffusers
folder), its config, the model classes it names, a bare model on the meta device, the dtypes
its safetensors headers store (read by :mod:`hf_precision.tools.weight_files`; the one-line
failures and exit codes are :mod:`hf_precision.tools.exits`).

Shared by the CLI's ``audit`` (:mod:`hf_precision.tools.cli`) and ``doctor``
(:mod:`hf_precision.tools.doctor`); nothing here parses arguments.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, NoReturn

from ..base.names import unknown_groups
from ..errors import did_you_mean
from .exits import fail

__all__ = [
    "CONFIG_REPAIRS",
    "DEFAULT_TRAINABLE",
    "MARKERS",
    "apply_stored_dtypes",
    "build_bare",
    "build_model",
    "checkpoint_key_map",
    "fill_subconfigs",
    "is_component",
    "load_config",
    "model_classes",
    "remote_headers",
    "resolve_hub",
    "resolve_source",
    "set_trainable",
    "trainable_groups",
]


# ---------------------------------------------------------------------------- sources
#: the file that says what a folder is, and the source kind it makes
MARKERS = (
    ("config.json", "path"),
    ("adapter_config.json", "adapter"),
    ("model_index.json", "diffusers"),
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_source(source: str) -> tuple[str, Any]:
    """``("path", folder or config.json)``, ``("adapter", folder)`` (PEFT: adapter_config.json),
    ``("diffusers", folder)`` (model_index.json), ``("hub", repo_id)`` (``org/name`` that is no
    local path) or ``("type", model_type)``."""
    path = Path(source)
    if path.is_dir():
        for marker, kind in MARKERS:
            if (path / marker).is_file():
                return ("component" if is_component(path) else kind), path
        fail(
            f"{source}: no config.json, adapter_config.json or model_index.json in this folder "
            "(expected a checkpoint, PEFT adapter or diffusers folder, a config.json, a Hub id "
            "or a model type)"
        )
    if path.is_file():
        if path.suffix != ".json":
            fail(f"{source}: expected a config.json, a checkpoint folder or a model type")
        return "path", path
    if source.endswith(".json"):
        fail(f"{source}: no such file or folder")
    if _HUB_ID.match(source) and not Path(source.split("/")[0]).is_dir():
        return "hub", source
    if "/" in source or os.sep in source:  # a path, or owner/name whose owner is a local folder
        fail(f"no such folder: {source}{_hub_hint(source)}")
    return "type", source


def _hub_hint(source: str) -> str:
    """What a missing path says about Hub ids: ``work/ckpt`` next to a folder ``work/`` is a
    path (the Hub is not asked); a Hub id is ``owner/name`` run where no folder ``owner/`` is."""
    if not _HUB_ID.match(source):
        return ""
    owner = source.split("/")[0]
    return (
        f" (the folder {owner}/ is here, so this is read as a path and the Hub is not asked; "
        f"if you meant the Hub id {source}, run the command from another folder)"
    )


def is_component(folder: Path) -> bool:
    """A diffusers component folder (``unet/``, ``vae/``, ``transformer/``): a config.json
    with diffusers' ``_class_name`` and no transformers ``model_type``."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "_class_name" in config and "model_type" not in config


def resolve_hub(repo_id: str) -> tuple[Path, str, dict[str, dict[str, Any]] | None]:
    """A Hub id's files, no weights: ``(folder, where from, safetensors headers or None)``.

    Offline (``HF_HUB_OFFLINE=1``) the folder is the cached snapshot of ``refs/main`` and the
    dtypes come from the safetensors headers there, if cached (``None``: read the folder).
    Online the JSON file that says what the repository is (config.json, adapter_config.json,
    model_index.json) is fetched into the cache and the headers read from the Hub's safetensors
    metadata (the headers only, by HTTP range requests)."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    if constants.HF_HUB_OFFLINE:
        try:
            folder = Path(snapshot_download(repo_id, local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError) as err:
            fail(
                f"no folder {repo_id} here (in {Path.cwd()}), and as a Hub id it is not in the "
                f"local Hugging Face cache ({constants.HF_HUB_CACHE}) while the Hub is offline "
                f"(HF_HUB_OFFLINE=1): "
                f"{type(err).__name__}. Fix: pass an existing checkpoint folder; or unset "
                f"HF_HUB_OFFLINE; or fetch its config once (hf download {repo_id} --include "
                "'*.json': no weights; the stored dtypes then come from the config, as "
                "'*.safetensors' would download the whole weights)"
            )
        return folder, f"the local Hugging Face cache, offline (HF_HUB_OFFLINE=1): {folder}", None
    unreachable = _hub_unreachable(constants.ENDPOINT)
    if unreachable is not None:
        _fail_unreachable(repo_id, unreachable)
    found: Path | None = None
    for marker, _ in MARKERS:
        try:
            found = Path(hf_hub_download(repo_id, marker)).parent
            break
        except LocalEntryNotFoundError as err:  # the network went away: not "no such file"
            _fail_unreachable(repo_id, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
        except EntryNotFoundError:
            continue
        except (OSError, ValueError) as err:  # not found, gated, no network (all OSErrors)
            fail(
                f"no such folder: {repo_id}, and the Hub did not give it as a Hub id "
                f"({type(err).__name__}: {str(err).splitlines()[0][:160]}). Fix: pass an "
                "existing checkpoint folder, or a Hub id this machine can reach (no network: "
                "HF_HUB_OFFLINE=1 reads the local cache)"
            )
    if found is None:
        fail(f"{repo_id}: no config.json, adapter_config.json or model_index.json on the Hub")
    return found, f"the Hub ({repo_id}: config and safetensors headers)", remote_headers(repo_id)


#: seconds the one look at the Hub waits before it says the Hub cannot be reached
HUB_PROBE_TIMEOUT = 5.0


def _hub_unreachable(endpoint: str) -> str | None:
    """Why the Hub at ``endpoint`` cannot be reached (one request, no retries, at most
    :data:`HUB_PROBE_TIMEOUT` seconds), or ``None`` when it answers at all (any HTTP status):
    huggingface_hub's own download retries a refused connection for over a minute."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(f"{endpoint.rstrip('/')}/", timeout=HUB_PROBE_TIMEOUT)
    except Exception as err:  # connection refused, DNS, timeout, proxy, TLS
        detail = str(err).splitlines()[0][:120] if str(err) else ""
        return (
            f"{type(err).__name__}: {detail} at {endpoint}"
            if detail
            else f"{type(err).__name__} at {endpoint}"
        )
    return None


def _fail_unreachable(repo_id: str, why: str) -> NoReturn:
    fail(
        f"no folder {repo_id} here (in {Path.cwd()}), and the Hub could not be reached to look it "
        f"up as a Hub id ({why}). Fix: pass an existing checkpoint folder; for a Hub id, run "
        "where the Hub is reachable (HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to read the local "
        f"Hugging Face cache (hf download {repo_id} --include '*.json' fetches its config once)"
    )


def remote_headers(repo_id: str) -> dict[str, dict[str, Any]]:
    """name -> ``{"dtype", "shape"}`` of every tensor of a Hub repository's top-level
    safetensors files (``huggingface_hub.get_safetensors_metadata``: headers only)."""
    from huggingface_hub import get_safetensors_metadata
    from huggingface_hub.errors import NotASafetensorsRepoError

    try:
        meta = get_safetensors_metadata(repo_id)
    except NotASafetensorsRepoError:
        return {}
    return {
        name: {"dtype": info.dtype, "shape": list(info.shape)}
        for file in meta.files_metadata.values()
        for name, info in file.tensors.items()
    }


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


def checkpoint_key_map(model: Any, keys: list[str]) -> dict[str, tuple[str, ...]]:
    """stored key -> the model's parameter/buffer names it loads into, through the key
    conversion ``from_pretrained`` itself applies when it loads these keys into ``model``.

    transformers 5.x: the weight conversions of the model and its sub-models
    (``conversion_mapping.get_model_conversion_mapping``: checkpoint names such as Qwen2-VL's
    ``model.layers.*`` / ``visual.*``, legacy layouts, the ``base_model_prefix`` added or
    dropped) applied by ``core_model_loading.rename_source_key``; a converter that splits one
    stored tensor (a fused ``qkv``, ``gate_up_proj``) names every target, as transformers does
    (the first target pattern replaced by each other). transformers 4.x: the class's
    ``_checkpoint_conversion_mapping`` through ``PreTrainedModel._get_key_renaming_mapping``.
    Keys the model has no tensor for are left out."""
    state = model.state_dict()  # meta tensors: names only, no data
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # transformers 4.x
        return _key_map_v4(model, keys, state)
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_source = {p: c for c in converters for p in c.source_patterns}
    prefix = model.base_model_prefix
    out: dict[str, tuple[str, ...]] = {}
    for key in keys:
        # the same two steps as convert_and_load_state_dict_in_model
        new, source = rename_source_key(key, renamings, converters, prefix, state)
        if new not in state and key in state:
            new, source = rename_source_key(key, [], [], prefix, state)
        names = [new]
        conv = by_source.get(source) if source is not None else None
        if conv is not None:
            first = conv.target_patterns[0]
            names += [new.replace(first, t) for t in conv.target_patterns[1:]]
        found = tuple(n for n in names if n in state)
        if found:
            out[key] = found
    return out


def _key_map_v4(model: Any, keys: list[str], state: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """transformers 4.x: ``from_pretrained``'s ``key_mapping`` default (the class's
    ``_checkpoint_conversion_mapping``, for the VLM classes it names) and its prefix rules."""
    import transformers.modeling_utils as mu

    key_mapping = getattr(model, "_checkpoint_conversion_mapping", None) or None
    vlms = getattr(mu, "VLMS", None)
    if key_mapping and vlms is not None:
        name = type(model).__name__.lower()
        key_mapping = key_mapping if any(v in name for v in vlms) else None
    prefix = model.base_model_prefix
    has_prefix = bool(prefix) and any(k.startswith(prefix) for k in keys)
    expects_prefix = bool(prefix) and hasattr(model, prefix)
    renamed = model._get_key_renaming_mapping(
        list(keys),
        key_mapping,
        loading_base_model_from_task_state_dict=has_prefix and not expects_prefix,
        loading_task_model_from_base_state_dict=not has_prefix and expects_prefix,
    )
    return {k: (v,) for k, v in renamed.items() if v in state}


def apply_stored_dtypes(model: Any, stored: dict[str, Any]) -> tuple[int, int]:
    """Give the model's tensors the dtypes they are stored in (matched by name through
    :func:`checkpoint_key_map`): a meta model gets empty meta tensors, a loaded one its values
    cast (exact when it was loaded in a wider dtype); returns (matched, stored) counts."""
    import torch

    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    names = checkpoint_key_map(model, list(stored))
    matched = 0
    with torch.no_grad():
        for key, dt in stored.items():
            found = [tensors[n] for n in names.get(key, ()) if n in tensors]
            for t in found:
                if t.is_floating_point() and t.dtype != dt:
                    t.data = torch.empty_like(t, dtype=dt) if t.is_meta else t.data.to(dt)
            matched += bool(found)
    return matched, len(stored)


#: the one default of every command: nothing trained (LoRA's case, the most common: the
#: checkpoint's weights stay frozen, so a bf16 checkpoint audited against ``bf16`` is clean);
#: ``--trainable projector`` / ``all`` for runs that train the checkpoint's own weights
DEFAULT_TRAINABLE = "none"


def trainable_groups(spec: str) -> list[str]:
    """The groups ``--trainable`` names, checked against the registry (a typo is an argument
    error before anything is built)."""
    from ..rules.groups.group_rule import group_names

    error = unknown_groups(spec, group_names())
    if error:
        fail(error)
    return [s.strip() for s in spec.split(",") if s.strip()]


def set_trainable(model: Any, spec: str) -> None:
    from ..rules.groups.module_groups import find_module_groups

    want = trainable_groups(spec)
    groups = find_module_groups(model)
    for name, p in model.named_parameters():
        p.requires_grad_("all" in want or groups.group_of(name) in want)
