"""Tiny native transformers models built offline from configs (random init, < 100k params).

Nothing is downloaded: every model is built from a config with ``torch.manual_seed(seed)``, so
tests, recipes and benchmarks get the real module layout of each architecture (paths, groups,
``_keep_in_fp32_modules``, ``generate()`` pre-encoding images) at no cost.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import tempfile
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    from transformers import LlavaProcessor, PreTrainedConfig, PreTrainedModel

# Ids follow the tiny tokenizer (configs.toml spells the same numbers).
PAD_ID, BOS_ID, EOS_ID, UNK_ID, IMAGE_TOKEN_ID = 0, 1, 2, 3, 255
# Qwen2-VL special ids (the real ones are beyond a 256 vocab).
QWEN_IMAGE, QWEN_VIDEO, QWEN_VISION_START, QWEN_VISION_END = 250, 251, 252, 253
_TEXT_LEN = 6  # text tokens per row after the image placeholders
CONFIGS_FILE = "configs.toml"  # the tiny configs, as data


def _takes(cls: Any, name: str, method: str = "__init__") -> bool:
    return cls is not None and name in inspect.signature(getattr(cls, method)).parameters


def _accepts(class_name: str, name: str, method: str = "__init__") -> bool:
    """Whether transformers' ``class_name.method`` takes ``name`` (a feature check, not a
    version check: the 4.x and 5.x lines spell a few fields and inputs differently)."""
    import transformers

    return _takes(getattr(transformers, class_name, None), name, method)


def _merged(table: dict[str, Any], fragments: dict[str, Any]) -> dict[str, Any]:
    """A table of configs.toml with the ``use`` fragments of it and its sub-tables merged in
    first (the table's own keys win)."""
    out: dict[str, Any] = {}
    for name in table.get("use", ()):
        out.update(_merged(fragments[name], fragments))
    for key, value in table.items():
        if key != "use":
            out[key] = _merged(value, fragments) if isinstance(value, dict) else value
    return out


def _read_configs() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    text = resources.files(__package__).joinpath(CONFIGS_FILE).read_text(encoding="utf-8")
    tables = tomllib.loads(text)
    fragments = tables.pop("fragments")
    return {key: _merged(table, fragments) for key, table in tables.items()}, fragments


_TABLES, _FRAGMENTS = _read_configs()


def fragment_kwargs(name: str) -> dict[str, Any]:
    """A fresh copy of the keyword arguments of ``[fragments.<name>]`` in ``configs.toml`` (the
    parts of the tiny remote-code and diffusion models that are transformers configs).

    >>> fragment_kwargs("clip_text_16")["hidden_size"]
    16
    """
    if name not in _FRAGMENTS:
        raise KeyError(f"no fragment {name!r} in {CONFIGS_FILE}; known: {sorted(_FRAGMENTS)}")
    return copy.deepcopy(_merged(_FRAGMENTS[name], _FRAGMENTS))


def _config(key: str) -> PreTrainedConfig:
    import transformers

    kwargs = copy.deepcopy(_TABLES[key])  # a config may keep and change what it is given
    name = kwargs.pop("config")
    del kwargs["model"]
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ImportError(
            f"tiny_config({key!r}): transformers {transformers.__version__} has no {name}. "
            "Fix: upgrade transformers."
        )
    text = kwargs.get("text_config", {})
    sub = getattr(cls, "sub_configs", {}).get("text_config")
    if "rope_parameters" in text and not _takes(sub, "rope_parameters"):
        # transformers 4.x: rope_scaling, and multimodal rope says so in its type
        text["rope_scaling"] = {**text.pop("rope_parameters"), "type": "mrope"}
    return cast("PreTrainedConfig", cls(**kwargs))


TINY_CONFIGS: dict[str, Callable[[], PreTrainedConfig]] = {
    key: functools.partial(_config, key) for key in _TABLES
}

_ALIASES = {"blip_2": "blip-2", "blip2": "blip-2", "kosmos2": "kosmos-2", "text_llama": "llama"}


def _canonical(model_type: str) -> str:
    key = _ALIASES.get(model_type, model_type)
    if key not in TINY_CONFIGS:
        raise KeyError(f"no tiny model for {model_type!r}; known: {sorted(TINY_CONFIGS)}")
    return key


def tiny_available(model_type: str) -> bool:
    """Whether the installed transformers has the model class ``model_type`` needs (MiniCPM-V
    4.6 came with transformers 5; the 4.x line builds every other tiny model).

    A model type without a tiny model here (``qwen2_5_vl``) is not available: ``False``.

    >>> tiny_available("llava"), tiny_available("qwen2_5_vl")
    (True, False)
    """
    import transformers

    key = _ALIASES.get(model_type, model_type) if isinstance(model_type, str) else None
    if key not in TINY_CONFIGS:
        return False
    return hasattr(transformers, _TABLES[key]["model"])


def tower_body(tower: nn.Module) -> nn.Module:
    """The transformer inside a CLIP/SigLIP vision tower (``embeddings``, ``encoder``): the
    tower itself in transformers 5, its ``vision_model`` in 4.x.

    >>> tower_body(tiny_llava().model.vision_tower).encoder.layers[0].mlp.fc1.in_features
    32
    """
    body = getattr(tower, "vision_model", None)
    return body if isinstance(body, nn.Module) else tower


def tiny_config(model_type: str) -> PreTrainedConfig:
    """A fresh tiny config for ``model_type`` (``blip_2``/``kosmos2`` aliases accepted)."""
    return TINY_CONFIGS[_canonical(model_type)]()


def build_tiny(model_type: str, dtype: torch.dtype | None = None, seed: int = 0) -> PreTrainedModel:
    """Build the tiny model in fp32 (eval mode), then ``.to(dtype)`` if given."""
    import transformers

    key = _canonical(model_type)
    if not tiny_available(key):
        raise ImportError(
            f"build_tiny({model_type!r}): transformers {transformers.__version__} has no "
            f"{_TABLES[key]['model']}.\nFix: upgrade transformers, or use one of "
            f"{sorted(k for k in TINY_CONFIGS if tiny_available(k))}."
        )
    config = TINY_CONFIGS[key]()
    torch.manual_seed(seed)
    model: Any = getattr(transformers, _TABLES[key]["model"])(config)
    model.eval()
    if dtype is not None:
        model.to(dtype)  # in place, every floating param/buffer (_keep_in_fp32 included)
    return cast("PreTrainedModel", model)


class TinyBuilder(Protocol):
    """``tiny_<arch>(dtype=None, seed=0)``: a tiny random model of one architecture."""

    def __call__(self, dtype: torch.dtype | None = None, seed: int = 0) -> PreTrainedModel: ...


def _builder(name: str, key: str) -> TinyBuilder:
    def build(dtype: torch.dtype | None = None, seed: int = 0) -> PreTrainedModel:
        return build_tiny(key, dtype, seed)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = (
        f"A tiny random ``{key}`` model (``build_tiny({key!r}, dtype, seed)``): cast to ``dtype``"
        " when given, the same weights for the same ``seed``."
    )
    return build


tiny_llava = _builder("tiny_llava", "llava")
tiny_llava_next = _builder("tiny_llava_next", "llava_next")
tiny_idefics2 = _builder("tiny_idefics2", "idefics2")
tiny_idefics3 = _builder("tiny_idefics3", "idefics3")
tiny_qwen2_vl = _builder("tiny_qwen2_vl", "qwen2_vl")
tiny_paligemma = _builder("tiny_paligemma", "paligemma")
tiny_minicpmv4_6 = _builder("tiny_minicpmv4_6", "minicpmv4_6")
tiny_blip2 = _builder("tiny_blip2", "blip-2")
tiny_kosmos2 = _builder("tiny_kosmos2", "kosmos-2")
tiny_text_llama = _builder("tiny_text_llama", "llama")


def _vision(config: Any) -> tuple[int, int]:
    """(image size, patch size) of the config's vision tower (tiny defaults when absent)."""
    vision = getattr(config, "vision_config", None)
    size = getattr(vision, "image_size", None) or 30
    patch = getattr(vision, "patch_size", None) or 6
    return int(size if not isinstance(size, (list, tuple)) else size[0]), int(
        patch if not isinstance(patch, (list, tuple)) else patch[0]
    )


#: Qwen-VL families whose batch is flattened patches with a (t, h, w) grid, and their classes
QWEN_VL_TYPES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
#: the model types :func:`tiny_batch` builds a batch for
BATCH_TYPES = (
    "llava",
    "llava_next",
    "idefics2",
    "idefics3",
    *QWEN_VL_TYPES,
    "paligemma",
    "minicpmv4_6",
    "blip-2",
    "kosmos-2",
    "llama",
)


def _vision_int(config: Any, key: str, default: int) -> int:
    value = getattr(getattr(config, "vision_config", None), key, None)
    if isinstance(value, (list, tuple)):
        value = value[0]
    return int(value) if value else default


def qwen_grid(config: Any, image_size: int | None = None) -> tuple[int, int]:
    """(patches per side, patch length) of one image for a Qwen-VL config: its patch size,
    temporal patch size, spatial merge size and channels; the side is ``image_size`` in patches
    (a multiple of the merge size), else two merged tokens per side."""
    patch = _vision_int(config, "patch_size", 14)
    merge = _vision_int(config, "spatial_merge_size", 2)
    temporal = _vision_int(config, "temporal_patch_size", 2)
    channels = _vision_int(config, "in_channels", 0) or _vision_int(config, "in_chans", 3)
    side = max(merge, (image_size // patch) // merge * merge) if image_size else 2 * merge
    return side, channels * temporal * patch * patch


def num_image_tokens(config: PreTrainedConfig, image_size: int | None = None) -> int:
    """Placeholder tokens one image expands to (what a processor inserts), from the config."""
    mt = config.model_type
    size, patch = _vision(config)
    side = (image_size or size) // patch
    if mt == "llava":  # patches (+ CLS for CLIP towers); the "default" strategy drops one
        vision_type = getattr(getattr(config, "vision_config", None), "model_type", "")
        cls = int("siglip" not in str(vision_type))
        default = getattr(config, "vision_feature_select_strategy", "default") == "default"
        return side**2 + cls - int(default)
    if mt == "llava_next":  # base tile + one tile with a newline per row
        return side**2 + side * (side + 1)
    if mt == "idefics2":
        return int(config.perceiver_config.resampler_n_latents)
    if mt == "idefics3":
        return int(side**2 // config.scale_factor**2)
    if mt in QWEN_VL_TYPES:  # grid (1, side, side) merged merge x merge
        return int(
            qwen_grid(config, image_size)[0] ** 2
            // _vision_int(config, "spatial_merge_size", 2) ** 2
        )
    if mt == "paligemma":
        return int(side**2)
    if mt == "minicpmv4_6":  # 8x8 patches, 2x2 window merger then 2x2 merger
        return 4
    if mt == "blip-2":
        return int(config.num_query_tokens)
    if mt == "kosmos-2":
        return int(config.latent_query_num)
    if mt == "llama":
        return 0
    raise KeyError(f"no tiny batch recipe for model_type {mt!r}")


def image_token_of(config: Any) -> int | None:
    """The image placeholder id the config declares (``image_token_id`` / ``_index``)."""
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def tiny_batch(
    model: Any,
    batch_size: int = 2,
    seed: int = 0,
    with_labels: bool = True,
    *,
    image_size: int | None = None,
    text_len: int | None = None,
    image_token_id: int | None = None,
) -> dict[str, torch.Tensor]:
    """A valid fp32 forward batch for a model (or its config): one image per row.

    Rows are ``[prefix] + image placeholders + [suffix] + text``; ``labels`` copy ``input_ids``
    with the image placeholders set to -100. The vocabulary size, the image token id, the image
    size and the number of image tokens come from the config (``image_size``, ``text_len``,
    ``image_token_id`` override them). Floating tensors are fp32 on purpose: that is what
    collators and processors produce (root-cause class A).
    """
    # Longer than most functions here: one branch per tiny architecture's batch layout, kept
    # together so a reader compares them side by side.
    cfg = getattr(model, "config", model)
    mt = cfg.model_type
    g = torch.Generator().manual_seed(seed)
    size = image_size or _vision(cfg)[0]
    # Qwen-VL: no image size in the config; its grid follows --image-size alone
    b, n_img = batch_size, num_image_tokens(cfg, image_size if mt in QWEN_VL_TYPES else size)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = int(getattr(text_cfg, "vocab_size", None) or 256)
    default_img = {"qwen2_vl": QWEN_IMAGE, "qwen2_5_vl": QWEN_IMAGE, "kosmos-2": 4}.get(
        mt, IMAGE_TOKEN_ID
    )
    img_id = (
        image_token_id
        if image_token_id is not None
        else (image_token_of(cfg) if mt not in ("kosmos-2",) else None) or default_img
    )
    if img_id >= vocab and n_img:
        raise ValueError(f"image token id {img_id} is outside the vocabulary ({vocab})")
    hi = min(vocab, 200)
    if hi - 4 < 2:
        raise ValueError(f"vocabulary of {vocab} tokens is too small for a text batch")
    text = torch.randint(4, hi, (b, text_len or _TEXT_LEN), generator=g)
    special = torch.tensor([img_id, QWEN_IMAGE, QWEN_VIDEO, QWEN_VISION_START, QWEN_VISION_END])
    text = torch.where(torch.isin(text, special), torch.full_like(text, 4), text)
    prefix: list[int] = [BOS_ID]
    suffix: list[int] = []
    if mt in QWEN_VL_TYPES:  # the config's vision start/end ids (a real checkpoint's, or ours)
        prefix = [getattr(cfg, "vision_start_token_id", None) or QWEN_VISION_START]
        suffix = [getattr(cfg, "vision_end_token_id", None) or QWEN_VISION_END]
    elif mt == "kosmos-2":  # <s> <image> latents </image>; ids are arbitrary in the tiny vocab
        prefix, suffix = [0, 5], [6]
    head = torch.tensor(prefix + [img_id] * n_img + suffix).expand(b, -1)
    input_ids = torch.cat([head, text], dim=1) if n_img else torch.cat([head[:, :1], text], 1)
    is_img = torch.zeros_like(input_ids, dtype=torch.bool)
    if n_img:
        is_img[:, len(prefix) : len(prefix) + n_img] = True
    batch: dict[str, torch.Tensor] = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
    }

    def pixels(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    ch = _vision_int(cfg, "num_channels", 3)  # the vision config's channels
    if mt in ("llava", "blip-2", "kosmos-2"):
        batch["pixel_values"] = pixels(b, ch, size, size)
    elif mt == "llava_next":
        batch["pixel_values"] = pixels(b, 2, ch, size, size)  # (B, tiles, C, H, W)
        batch["image_sizes"] = torch.tensor([[size, size]] * b)
    elif mt in ("idefics2", "idefics3"):
        batch["pixel_values"] = pixels(b, 1, ch, size, size)  # (B, images, C, H, W)
        batch["pixel_attention_mask"] = torch.ones(b, 1, size, size, dtype=torch.bool)
    elif mt in QWEN_VL_TYPES:  # flattened patches, (side x side) per image, from the config
        side, patch_len = qwen_grid(cfg, image_size)
        batch["pixel_values"] = pixels(b * side * side, patch_len)
        batch["image_grid_thw"] = torch.tensor([[1, side, side]] * b)
        if _accepts(QWEN_VL_TYPES[mt], "mm_token_type_ids", "forward"):
            batch["mm_token_type_ids"] = is_img.long()  # text 0, image 1 (drives M-RoPE)
    elif mt == "paligemma":
        batch["pixel_values"] = pixels(b, ch, size, size)
        # prefix (image + bos + first half of the text) is bidirectional, the rest is the suffix
        tt = torch.ones_like(input_ids)
        tt[:, : len(prefix) + n_img + _TEXT_LEN // 2] = 0
        batch["token_type_ids"] = tt
    elif mt == "minicpmv4_6":
        # NaViT packing: all images' 4x4 patches side by side in one (1, C, P, L*P) row.
        p = _vision(cfg)[1]  # the config's patch size
        batch["pixel_values"] = pixels(1, ch, p, b * 64 * p)
        batch["target_sizes"] = torch.tensor([[8, 8]] * b, dtype=torch.int32)
    if mt == "kosmos-2":
        batch["image_embeds_position_mask"] = is_img.long()
    if with_labels:
        batch["labels"] = input_ids.masked_fill(is_img, -100)
    return batch


# Words of the synthetic captioning/VQA data; the tokenizer covers them plus chat-template words.
_WORDS = """user assistant system : . , ? ! a an the is are it this that what which where how
    many in on of and with image picture photo describe shows there color colour shape size red
    green blue yellow black white orange purple gray square circle triangle line dot small large
    big left right top bottom center one two three four five yes no background object objects
    caption answer question see do you"""
TINY_WORDS: tuple[str, ...] = tuple(_WORDS.split())
_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image> {% else %}{{ item['text'] }} {% endif %}"
    "{% endfor %}{% endif %}{% if message['role'] == 'assistant' %}</s>{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
)


def _tiny_tokenizer() -> Any:
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIALS + TINY_WORDS)}
    for i in range(len(vocab), IMAGE_TOKEN_ID):  # fill up to 255 so <image> gets the model's id
        vocab[f"<extra_{i}>"] = i
    vocab["<image>"] = IMAGE_TOKEN_ID
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # Specials are matched before pre-tokenization, so "<image><image>" splits correctly.
    tok.add_special_tokens([AddedToken(t, special=True) for t in (*_SPECIALS, "<image>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )


def tiny_llava_processor(tmpdir: str | None = None) -> LlavaProcessor:
    """An offline ``LlavaProcessor`` matching :func:`tiny_llava` (30x30 images, 25 tokens).

    With ``tmpdir`` it is saved there and reloaded with ``from_pretrained`` (round-trip check);
    without it, a throwaway directory is used for the same round trip.
    """
    import transformers
    from transformers import LlavaProcessor

    # the PIL-backed processor is CLIPImageProcessorPil in transformers 5, CLIPImageProcessor
    # in 4.x (where 5's CLIPImageProcessor name means the torchvision one)
    pil = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    image_processor = pil(
        size={"shortest_edge": 30},
        crop_size={"height": 30, "width": 30},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=_tiny_tokenizer(),
        patch_size=6,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    if tmpdir is None:
        with tempfile.TemporaryDirectory() as tmp:
            processor.save_pretrained(tmp)
            return LlavaProcessor.from_pretrained(tmp, local_files_only=True)
    processor.save_pretrained(tmpdir)
    return LlavaProcessor.from_pretrained(tmpdir, local_files_only=True)
