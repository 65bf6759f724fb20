"""Tiny plain-torch copies of remote-code VLM layouts (real checkpoints need trust_remote_code).

Each model keeps the attribute names of the real code (so group discovery sees the real paths)
and the real code's dtype handling, bugs included, so the precision failures users report can be
reproduced offline. Errors observed on CPU with torch 2.13 (the same texts as on CUDA):

- biased ``nn.Linear``, fp32 input, bf16 weight:
  ``mat1 and mat2 must have the same dtype, but got Float and BFloat16``
- bias-free ``nn.Linear`` (e.g. ``resampler.kv_proj``), fp32 input, bf16 weight:
  ``expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16``
- ``nn.Conv2d``, fp32 input, bf16 weight:
  ``Input type (float) and bias type (c10::BFloat16) should be the same``
- ``nn.MultiheadAttention`` with an fp32 key and bf16 weights (MiniCPM-V 2.x resampler):
  ``mat1 and mat2 must have the same dtype, but got Float and BFloat16``

On CUDA (H100, torch 2.11) the XComposer linear patch embedding reads
``expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16`` and CPU pixels
into a CUDA model (``.type(dtype)`` keeps the device) read ``Input type (torch.FloatTensor) and
weight type (torch.cuda.FloatTensor) should be the same or input should be a MKLDNN tensor ...``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .vlm import build_tiny, fragment_kwargs

# Any wording of a matmul dtype mismatch (biased / bias-free linear, CPU / CUDA): pytest.raises.
MATMUL_DTYPE_ERROR = (
    r"(mat1 and mat2 must have the same dtype"
    r"|expected (m1 and m2|mat1 and mat2) to have the same dtype)"
)
#: Image features written by index put into text embeddings of another dtype (InternVL-Chat,
#: DeepSeek-VL).
INDEX_PUT_DTYPE_ERROR = r"Index put requires the source and destination dtypes match"
CONV_DTYPE_ERROR = r"Input type \(float\) and bias type \(c10::(BFloat16|Half)\) should be the same"
IMAGE_TOKEN_ID = 255
_TEXT_LEN = 6


@dataclass
class RemoteConfig:
    """The few config fields the real remote configs expose and the guard may read."""

    model_type: str
    image_size: int
    num_image_tokens: int
    hidden_size: int = 32
    vocab_size: int = 256
    image_token_id: int = IMAGE_TOKEN_ID
    # Special ids of the tiny tokenizer (Trainer aligns them with the tokenizer's).
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2

    def get_text_config(self, decoder: bool | None = None) -> RemoteConfig:
        """As ``PreTrainedConfig.get_text_config`` (real remote configs are PreTrainedConfigs;
        ``Trainer.train`` calls it when given a processor)."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """As ``PreTrainedConfig.to_dict`` (peft 0.17 reads the model config through it)."""
        return dataclasses.asdict(self)


def get_2d_sincos_pos_embed(embed_dim: int, grid_size: int | tuple[int, int]) -> np.ndarray:
    """MAE / MiniCPM-V style 2D sin-cos table, computed in numpy: shape (h*w, embed_dim)."""
    gh, gw = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
    grid = np.meshgrid(np.arange(gw, dtype=np.float32), np.arange(gh, dtype=np.float32))
    grid_w, grid_h = (g.reshape(-1) for g in grid)

    def one_d(dim: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float32) / (dim / 2.0))
        out = np.einsum("m,d->md", pos, omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    half = embed_dim // 2
    return np.concatenate([one_d(half, grid_h), one_d(half, grid_w)], axis=1)


class Block(nn.Module):
    """Pre-norm ViT block (qkv linear + SDPA + MLP)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """timm-like ViT: patch embed (conv, or linear over flattened patches), pos_embed, blocks."""

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        width: int = 16,
        depth: int = 1,
        heads: int = 2,
        linear_patch: bool = False,
        cls_token: bool = False,
    ) -> None:
        super().__init__()
        self.patch_size, self.linear_patch = patch_size, linear_patch
        self.patch_embed: nn.Module = (
            nn.Linear(3 * patch_size**2, width)
            if linear_patch
            else nn.Conv2d(3, width, patch_size, stride=patch_size)
        )
        self.num_prefix_tokens = int(cls_token)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width)) if cls_token else None
        n = (image_size // patch_size) ** 2 + self.num_prefix_tokens
        self.pos_embed = nn.Parameter(torch.randn(1, n, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.linear_patch:  # (B, C, H, W) -> (B, N, C*p*p); a Linear sees the raw dtype
            p = self.patch_size
            x = F.unfold(pixel_values, p, stride=p).transpose(1, 2)
            x = self.patch_embed(x)
        else:
            x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.forward_features(pixel_values)


class Resampler(nn.Module):
    """MiniCPM-V 2.x / OmniLMM perceiver resampler (one cross-attention of learned queries).

    ``pos_embed`` is an ``nn.Parameter`` made from a numpy sin-cos table with ``.float()``, as
    upstream (``omnilmm/model/resampler.py``): built under a half default dtype it stays fp32,
    and ``query + pos_embed`` then hands fp32 queries to a half ``attn`` (class F).
    ``adaptive=True`` (MiniCPM-V 2.x): the key table is computed in numpy in forward and
    follows the input's device and dtype. ``adaptive=False`` (OmniLMM): ``get_abs_pos``
    interpolates the parameter in fp32 and casts back to its dtype. ``table_dtype=float32``
    makes the adaptive table in fp32 whatever the input (``torch.from_numpy(pos).float()``):
    the class-F pattern of a tensor made in forward, for the tests that need one.
    """

    def __init__(
        self,
        grid_size: int,
        embed_dim: int,
        num_heads: int,
        kv_dim: int,
        adaptive: bool,
        table_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim, self.adaptive, self.table_dtype = embed_dim, adaptive, table_dtype
        table = torch.from_numpy(get_2d_sincos_pos_embed(embed_dim, grid_size)).float()
        self.pos_embed = nn.Parameter(table, requires_grad=False)
        self.query = nn.Parameter(torch.randn(grid_size**2, embed_dim) * 0.02)
        self.kv_proj = nn.Linear(kv_dim, embed_dim, bias=False)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)
        self.ln_q, self.ln_kv = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.ln_post = nn.LayerNorm(embed_dim)
        self.proj = nn.Parameter(embed_dim**-0.5 * torch.randn(embed_dim, embed_dim))

    def forward(self, x: torch.Tensor, tgt_size: tuple[int, int]) -> torch.Tensor:
        if self.adaptive:
            pos = get_2d_sincos_pos_embed(self.embed_dim, tgt_size)
            pos_embed = torch.from_numpy(pos).to(device=x.device, dtype=self.table_dtype or x.dtype)
        else:  # get_abs_pos: interpolate in fp32, cast back to the table's dtype
            side = int(math.sqrt(self.pos_embed.shape[0]))
            grid = self.pos_embed.float().reshape(1, side, side, -1).permute(0, 3, 1, 2)
            grid = F.interpolate(grid, size=tgt_size, mode="bicubic", align_corners=False)
            pos_embed = grid.permute(0, 2, 3, 1).flatten(0, 2).to(self.pos_embed.dtype)
        x = self.ln_kv(self.kv_proj(x)).permute(1, 0, 2)  # (N, B, D)
        q = self.ln_q(self.query).unsqueeze(1).repeat(1, x.shape[1], 1)
        out, _ = self.attn(q + self.pos_embed.unsqueeze(1), x + pos_embed.unsqueeze(1), x)
        return self.ln_post(out.permute(1, 0, 2)) @ self.proj


def _tiny_llama() -> Any:
    """The tiny ``LlamaForCausalLM`` of :mod:`.vlm` (typed ``Any``: used duck-typed)."""
    return build_tiny("llama")


class RemoteVLM(nn.Module):
    """Base of the remote layouts: shared forward and greedy generate; subclasses define the
    vision path (``encode_images``) and the LM calls."""

    config: RemoteConfig

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def get_input_embeddings(self) -> nn.Module:
        raise NotImplementedError

    def lm_logits(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def get_vllm_embedding(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor
    ) -> torch.Tensor:
        """Token embeddings with the image placeholders replaced by the image features."""
        embeds = self.get_input_embeddings()(input_ids)
        images = self.encode_images(pixel_values)
        mask = (input_ids == self.config.image_token_id).unsqueeze(-1)
        # As the real code: features follow the embeddings' dtype (`.type(embeds.dtype)`).
        return embeds.masked_scatter(mask, images.type(embeds.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        embeds = self.get_vllm_embedding(input_ids, pixel_values)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        logits = self.lm_logits(embeds, mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        max_new_tokens: int = 3,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Greedy decoding. Images are encoded once, first, outside ``forward`` (as HF generate
        and the remote ``chat``/``generate`` do), so top-level forward hooks never see them."""
        embeds = self.get_vllm_embedding(input_ids, pixel_values)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        ids = input_ids
        for _ in range(max_new_tokens):  # no KV cache: tiny sequences, recomputed each step
            nxt = self.lm_logits(embeds, mask)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            embeds = torch.cat([embeds, self.get_input_embeddings()(nxt)], dim=1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        return ids

    def batch(self, batch_size: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
        return remote_batch(self, batch_size=batch_size, seed=seed)


class MiniCPMV2Tiny(RemoteVLM):
    """MiniCPM-V 2.x layout: ``vpm`` (ViT), ``resampler`` (adaptive), ``llm``.

    Follows the HF remote code of ``openbmb/MiniCPM-V-2`` (``modeling_minicpmv.py``,
    ``resampler.py``), which lives on the hub and in no public source repository reachable here;
    its resampler derives from OmniLMM's (``OpenBMB/OmniLMM`` commit 2553592b,
    ``omnilmm/model/resampler.py``), which was read. The vision path casts pixels to
    ``vpm.pos_embed.dtype`` with ``.type(dtype)`` (device unchanged). The real fp32 leak is the
    resampler's ``pos_embed`` *parameter*, made with ``.float()`` from a numpy table: a model
    built the way ``from_pretrained(torch_dtype=bf16)`` builds it (bf16 default dtype) keeps
    that one parameter fp32, so ``query + pos_embed`` turns the queries fp32 and a bf16
    attention fails outside autocast (``generate()``; the seed's bug 4). The adaptive sin-cos
    table of the keys follows the input dtype in this version.
    """

    _MODEL_TYPE, _ADAPTIVE = "minicpmv", True

    def __init__(self, dtype: torch.dtype | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        default = torch.get_default_dtype()
        if dtype is not None:  # as from_pretrained(torch_dtype=dtype): the default dtype
            torch.set_default_dtype(dtype)
        try:
            self.config = RemoteConfig(self._MODEL_TYPE, image_size=30, num_image_tokens=4)
            self.vpm = TinyViT(image_size=30, patch_size=6, width=16)
            self.resampler = Resampler(2, 32, 4, kv_dim=16, adaptive=self._ADAPTIVE)
            self.llm = _tiny_llama()
            if dtype is not None:
                self.llm.to(dtype)  # built from a config, as from_pretrained does
        finally:
            torch.set_default_dtype(default)
        self.eval()

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.vpm.pos_embed.data.dtype
        side = self.config.image_size // self.vpm.patch_size
        res = []
        for pixel_value in pixel_values:  # real code: one image at a time
            vision_embedding = self.vpm.forward_features(pixel_value.unsqueeze(0).type(dtype))
            res.append(self.resampler(vision_embedding, (side, side)))
        return torch.vstack(res)

    def get_input_embeddings(self) -> nn.Module:
        return self.llm.get_input_embeddings()

    def lm_logits(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.llm(inputs_embeds=inputs_embeds, attention_mask=attention_mask).logits


class OmniLMMTiny(RemoteVLM):
    """OmniLMM-12B, held as ``OpenBMB/OmniLMM`` holds it (commit
    2553592bae4034f57557a593c8609a0611919d10, ``omnilmm/model/omnilmm.py`` and
    ``omnilmm/model/resampler.py``).

    ``OmniLMMForCausalLM`` has ``model`` (``OmniLMMModel``, the Mistral body: here the tiny
    Llama body) and ``lm_head``; the vision tower (a timm EVA ViT: here :class:`TinyViT`) and
    the fixed-grid ``resampler`` are attributes of ``model``. With ``tune_clip=False`` (the
    LoRA setting) ``__init__`` and ``initialize_vision_modules`` store the tower as
    ``self.vision_tower = [vision_tower]``: ``nn.Module.__setattr__`` keeps a list in the
    instance ``__dict__``, so ``model.to()``, ``named_parameters()``, ``state_dict()`` and
    ``get_submodule("model.vision_tower")`` never reach it. ``get_vision_embedding`` reads it
    back with ``vision_tower[0]`` and casts the pixels with
    ``pixel_values.type(vision_tower.pos_embed.data.dtype)``: dtype follows the tower, device
    does not (the seed: a CPU tower under a CUDA model).
    """

    def __init__(
        self, dtype: torch.dtype | None = None, seed: int = 0, tune_clip: bool = True
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = RemoteConfig("omnilmm", image_size=30, num_image_tokens=4)
        llm = _tiny_llama()
        body: Any = llm.model
        tower = TinyViT(image_size=30, patch_size=6, width=16)
        body.vision_tower = tower if tune_clip else [tower]  # a list: not registered
        body.resampler = Resampler(2, 32, 4, kv_dim=16, adaptive=False)
        self.model, self.lm_head = body, llm.lm_head
        self.eval()
        if dtype is not None:
            self.to(dtype)  # what chat.py does after loading; a list-held tower is skipped

    @property
    def tower(self) -> Any:
        """The vision tower, however ``model`` holds it (a convenience of this copy)."""
        held = self.model.vision_tower
        return held[0] if isinstance(held, list) else held

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        tower = self.tower
        dtype = tower.pos_embed.data.dtype
        side = self.config.image_size // tower.patch_size
        return self.model.resampler(tower.forward_features(pixel_values.type(dtype)), (side, side))

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def lm_logits(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        return self.lm_head(hidden.last_hidden_state)


class PLoRA(nn.Linear):
    """InternLM-XComposer's Partial LoRA linear (``build_mlp.py``): a plain linear on every
    token plus ``Plora_B(Plora_A(x)) * scaling`` on the image tokens only (``im_mask``, set on
    the module by the model before the language model runs)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        lora_r: int = 4,
        lora_alpha: int = 8,
    ) -> None:
        super().__init__(in_features, out_features, bias)
        self.lora_scaling = lora_alpha / lora_r
        self.Plora_A = nn.Linear(in_features, lora_r, bias=False)
        self.Plora_B = nn.Linear(lora_r, out_features, bias=False)
        nn.init.zeros_(self.Plora_B.weight)
        self.im_mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        res = super().forward(x)
        mask = self.im_mask
        if mask is not None and mask.shape == x.shape[:2] and bool(mask.any()):
            lora = self.Plora_B(self.Plora_A(x[mask])) * self.lora_scaling
            res = res.index_put((mask,), res[mask] + lora)
        return res


class VisionTowerWrapper(nn.Module):
    """XComposer's ``CLIPVisionTower``: the CLIP model sits at ``vit.vision_tower``."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.vision_tower = tower

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision_tower(pixel_values)


class XComposerTiny(RemoteVLM):
    """InternLM-XComposer 2 / 2.5, held as ``InternLM/InternLM-XComposer`` holds it (commit
    00005d62b40beb3e62c6f260d9004bd4bb93dce2,
    ``InternLM-XComposer-2.5-OmniLive/internlm-xcomposer2d5-ol-7b/base/build_mlp.py`` and the
    ``InternLMXComposer2ForCausalLM`` layout of its ``modeling_internlm_xcomposer2.py``).

    ``model`` (the InternLM2 body, here the tiny Llama body, its attention ``q_proj``/``v_proj``
    made :class:`PLoRA` linears with ``Plora_A``/``Plora_B``), ``output`` (the LM head),
    ``vit`` (``CLIPVisionTower``: the CLIP model at ``vit.vision_tower``), ``vision_proj``
    (``mlp2x_gelu``: Linear, GELU, Linear) and, in 2.5, ``plora_glb_GN``/``plora_sub_GN``
    separator parameters. ``img2emb`` moves the image to the model's device only: the vit's
    linear patch embedding then gets the collator's fp32 pixels, ``mat1 and mat2 must have the
    same dtype`` under fp16/bf16.
    """

    def __init__(self, dtype: torch.dtype | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = RemoteConfig("internlmxcomposer2", image_size=30, num_image_tokens=25)
        self.vit = VisionTowerWrapper(
            TinyViT(image_size=30, patch_size=6, width=16, linear_patch=True)
        )
        self.vision_proj = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        llm = _tiny_llama()
        for layer in llm.model.layers:
            attn = layer.self_attn
            for name in ("q_proj", "v_proj"):
                old = getattr(attn, name)
                new = PLoRA(old.in_features, old.out_features, bias=old.bias is not None)
                new.weight.data.copy_(old.weight.data)
                setattr(attn, name, new)
        self.model, self.output = llm.model, llm.lm_head
        self.plora_glb_GN = nn.Parameter(torch.zeros(1, 1, 32))
        self.plora_sub_GN = nn.Parameter(torch.zeros(1, 1, 1, 32))
        self.eval()
        if dtype is not None:
            self.to(dtype)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision_proj(self.vit(pixel_values.to(self.device)))  # no dtype: the bug

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def lm_logits(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        return self.output(hidden.last_hidden_state)

    def get_vllm_embedding(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor
    ) -> torch.Tensor:
        im_mask = input_ids == self.config.image_token_id  # the image tokens get the PLoRA
        for m in self.model.modules():
            if isinstance(m, PLoRA):
                m.im_mask = im_mask
        return super().get_vllm_embedding(input_ids, pixel_values)


class XTunerLLaVATiny(RemoteVLM):
    """XTuner's LLaVA, held as ``InternLM/xtuner`` holds it (commit
    02974d60dd26b596656fd734063c8211734cdf32, ``xtuner/model/llava.py`` and
    ``xtuner/model/modules/projector/``).

    ``LLaVAModel`` (an mmengine ``BaseModel``, no HF config) has ``llm`` (an HF causal LM, its
    head at ``llm.lm_head``), ``visual_encoder`` (an HF ``CLIPVisionModel``) and
    ``projector`` (``ProjectorModel``: ``projector.model`` is Linear, GELU, Linear), built with
    ``.to(self.visual_encoder.dtype)``. Pixels are cast with
    ``.to(self.visual_encoder.dtype)``; the features of layer ``visual_select_layer`` (-2),
    CLS dropped, go through the projector into the LLM's embeddings. Seed 1: with the LLM in
    fp16 and its final norm trained in fp32, evaluation-time ``generate()`` (no autocast) hands
    fp32 hidden states to the fp16 ``lm_head``.
    """

    def __init__(self, dtype: torch.dtype | None = None, seed: int = 0) -> None:
        super().__init__()
        from transformers import CLIPVisionConfig, CLIPVisionModel

        torch.manual_seed(seed)
        self.config = RemoteConfig("xtuner_llava", image_size=30, num_image_tokens=25)
        self.llm = _tiny_llama()
        self.visual_encoder = CLIPVisionModel(CLIPVisionConfig(**fragment_kwargs("clip_vision_16")))
        self.projector = ProjectorModel(16, 32)
        self.visual_select_layer = -2
        self.eval()
        if dtype is not None:
            self.to(dtype)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.visual_encoder(
            pixel_values.to(self.visual_encoder.dtype), output_hidden_states=True
        )
        return self.projector(out.hidden_states[self.visual_select_layer][:, 1:])

    def get_input_embeddings(self) -> nn.Module:
        return self.llm.get_input_embeddings()

    def lm_logits(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.llm(inputs_embeds=inputs_embeds, attention_mask=attention_mask).logits


class ProjectorModel(nn.Module):
    """XTuner's ``ProjectorModel`` (depth 2): ``model`` is Linear, GELU, Linear."""

    def __init__(self, visual_hidden_size: int, llm_hidden_size: int) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(visual_hidden_size, llm_hidden_size),
            nn.GELU(),
            nn.Linear(llm_hidden_size, llm_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class InternVLTiny(RemoteVLM):
    """InternVL-Chat, held as ``OpenGVLab/InternVL`` holds it (commit
    03285798fa1ed6496981887724d0db688581a859,
    ``internvl_chat/internvl/model/internvl_chat/modeling_internvl_chat.py``).

    ``InternVLChatModel`` has ``vision_model`` (InternViT: here :class:`TinyViT` with a CLS
    token), ``mlp1`` (LayerNorm, Linear, GELU, Linear over the pixel-shuffled features) and
    ``language_model`` (an HF causal LM, its head at ``language_model.lm_head``;
    :meth:`wrap_llm_lora` makes it a ``PeftModel``, head at
    ``language_model.base_model.model.lm_head``). Its dtype handling, bugs included:

    - InternViT's embeddings read ``target_dtype = patch_embedding.weight.dtype`` but never cast
      the pixels with it: fp32 pixels into a bf16 conv fail with
      ``Input type (float) and bias type (c10::BFloat16) should be the same``;
    - ``forward`` writes the image features into the text embeddings by index put,
      ``input_embeds[selected] = input_embeds[selected] * 0.0 + vit_embeds.reshape(-1, C)``
      (``generate``: ``input_embeds[selected] = vit_embeds.reshape(-1, C)``): nothing casts them,
      so ``mlp1`` trained in fp32 beside a bf16 language model fails with ``Index put requires
      the source and destination dtypes match``. (Upstream wraps the training form in a
      ``try`` whose ``except`` repeats the same index put: the error propagates.)
    """

    def __init__(self, dtype: torch.dtype | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        # 32x32 image, patch 8 -> 4x4 grid (+CLS); pixel shuffle 0.5 -> 4 tokens of width 64.
        self.config = RemoteConfig("internvl_chat", image_size=32, num_image_tokens=4)
        self.downsample_ratio = 0.5
        self.select_layer = -1
        self.img_context_token_id = self.config.image_token_id
        self.vision_model = TinyViT(image_size=32, patch_size=8, width=16, cls_token=True)
        vit_hidden = 16 * int(1 / self.downsample_ratio) ** 2
        self.mlp1 = nn.Sequential(
            nn.LayerNorm(vit_hidden), nn.Linear(vit_hidden, 32), nn.GELU(), nn.Linear(32, 32)
        )
        self.language_model = _tiny_llama()
        self.eval()
        if dtype is not None:
            self.to(dtype)

    def wrap_llm_lora(self, r: int = 4, lora_alpha: int = 8, lora_dropout: float = 0.05) -> None:
        """InternVL's own LoRA: ``get_peft_model`` on the language model only (the Llama/Qwen2
        target modules), then ``enable_input_require_grads``."""
        from peft import LoraConfig, get_peft_model

        target_modules = [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.down_proj",
            "mlp.up_proj",
        ]
        lora_config = LoraConfig(
            r=r,
            target_modules=target_modules,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            task_type="CAUSAL_LM",
        )
        self.language_model = get_peft_model(self.language_model, lora_config)
        self.language_model.enable_input_require_grads()

    def pixel_shuffle(self, x: torch.Tensor, scale_factor: float = 0.5) -> torch.Tensor:
        n, w, h, c = x.size()
        x = x.view(n, w, int(h * scale_factor), int(c / scale_factor))
        x = x.permute(0, 2, 1, 3).contiguous()
        x = x.view(n, int(h * scale_factor), int(w * scale_factor), int(c / scale_factor**2))
        return x.permute(0, 2, 1, 3).contiguous()

    def extract_feature(self, pixel_values: torch.Tensor) -> torch.Tensor:
        vit_embeds = self.vision_model(pixel_values)[:, 1:, :]  # drop CLS
        h = w = int(vit_embeds.shape[1] ** 0.5)
        vit_embeds = vit_embeds.reshape(vit_embeds.shape[0], h, w, -1)
        vit_embeds = self.pixel_shuffle(vit_embeds, scale_factor=self.downsample_ratio)
        vit_embeds = vit_embeds.reshape(vit_embeds.shape[0], -1, vit_embeds.shape[-1])
        return self.mlp1(vit_embeds)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.extract_feature(pixel_values)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def lm_logits(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.language_model(inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        return out.logits

    def get_vllm_embedding(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor
    ) -> torch.Tensor:
        """``generate``'s merge: ``input_embeds[selected] = vit_embeds.reshape(-1, C)``."""
        vit_embeds = self.extract_feature(pixel_values)
        input_embeds = self.language_model.get_input_embeddings()(input_ids)
        b, n, c = input_embeds.shape
        input_embeds = input_embeds.reshape(b * n, c)
        selected = input_ids.reshape(b * n) == self.img_context_token_id
        input_embeds[selected] = vit_embeds.reshape(-1, c).to(input_embeds.device)
        return input_embeds.reshape(b, n, c)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        image_flags: torch.Tensor | None = None,
    ) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        input_embeds = self.language_model.get_input_embeddings()(input_ids).clone()
        vit_embeds = self.extract_feature(pixel_values)
        if image_flags is not None:  # upstream requires it; the tiny batches carry no padding
            vit_embeds = vit_embeds[image_flags.squeeze(-1) == 1]
        b, n, c = input_embeds.shape
        input_embeds = input_embeds.reshape(b * n, c)
        selected = input_ids.reshape(b * n) == self.img_context_token_id
        input_embeds[selected] = input_embeds[selected] * 0.0 + vit_embeds.reshape(-1, c)
        input_embeds = input_embeds.reshape(b, n, c)
        logits = self.language_model(
            inputs_embeds=input_embeds, attention_mask=attention_mask
        ).logits
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous().view(-1, logits.shape[-1])
            shift_labels = labels[..., 1:].contiguous().view(-1).to(shift_logits.device)
            loss = nn.CrossEntropyLoss()(shift_logits, shift_labels)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class SigLIPTower(nn.Module):
    """DeepSeek-VL's ``CLIPVisionTower`` around a timm SigLIP ViT (``select_feature="same"``,
    ``select_layer=-1``): ``vision_tower`` (here :class:`TinyViT`) returns the patch features
    as a tensor, which ``feature_select`` hands on unchanged."""

    def __init__(self, image_size: int, patch_size: int, width: int) -> None:
        super().__init__()
        self.select_feature, self.select_layer = "same", -1
        self.vision_tower = TinyViT(image_size=image_size, patch_size=patch_size, width=width)
        self.image_norm = None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.vision_tower(images)


class MlpProjector(nn.Module):
    """DeepSeek-VL's ``MlpProjector`` (``projector_type="mlp_gelu"``, depth 2): ``layers`` is
    Linear, GELU, Linear."""

    def __init__(self, input_dim: int, n_embed: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_dim, n_embed), nn.GELU(), nn.Linear(n_embed, n_embed)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class DeepSeekVLTiny(RemoteVLM):
    """DeepSeek-VL, held as ``deepseek-ai/DeepSeek-VL`` holds it (commit
    d04d289cb8ef9e1e02f7e4eae7e817d572dcb07f, ``deepseek_vl/models/modeling_vlm.py``,
    ``clip_encoder.py``, ``projector.py``; it runs on transformers 4.x).

    ``MultiModalityCausalLM`` (config ``model_type="multi_modality"``) has ``vision_model``
    (``CLIPVisionTower``: :class:`SigLIPTower`), ``aligner`` (:class:`MlpProjector`) and
    ``language_model`` (a ``LlamaForCausalLM``), with no ``model.`` prefix.
    ``prepare_inputs_embeds`` encodes ``pixel_values`` of shape (b, n_images, 3, H, W), zeroes
    negative ids in place and writes the aligned features into the text embeddings by index
    put, ``inputs_embeds[images_seq_mask] = images_embeds[images_emb_mask]``: nothing casts
    them, so an fp32 aligner beside a bf16 language model fails (``Index put requires the
    source and destination dtypes match``), and so do bf16 autocast features written into fp32
    embeddings. Upstream has no training ``forward`` (its scripts call
    ``language_model(inputs_embeds=prepare_inputs_embeds(...))``); :meth:`forward` does that,
    building the two masks from the image placeholder ids when they are not given and taking
    4-D pixels as one image per sample.
    """

    def __init__(self, dtype: torch.dtype | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        # 30x30 image, patch 6 -> 25 patch features of width 16, aligned to the LM's 32.
        self.config = RemoteConfig("multi_modality", image_size=30, num_image_tokens=25)
        self.vision_model = SigLIPTower(image_size=30, patch_size=6, width=16)
        self.aligner = MlpProjector(16, 32)
        self.language_model = _tiny_llama()
        self.eval()
        if dtype is not None:
            self.to(dtype)

    def prepare_inputs_embeds(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        images_seq_mask: torch.Tensor,
        images_emb_mask: torch.Tensor,
    ) -> torch.Tensor:
        bs, n = pixel_values.shape[0:2]
        images = pixel_values.flatten(0, 1)  # "b n c h w -> (b n) c h w"
        images_embeds = self.aligner(self.vision_model(images))  # [b x n, T2, D]
        images_embeds = images_embeds.reshape(bs, n * images_embeds.shape[1], -1)
        images_emb_mask = images_emb_mask.reshape(bs, -1)  # "b n t -> b (n t)"
        input_ids[input_ids < 0] = 0  # ignore the image embeddings
        inputs_embeds = self.language_model.get_input_embeddings()(input_ids)
        inputs_embeds[images_seq_mask] = images_embeds[images_emb_mask]
        return inputs_embeds

    def _masks(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if pixel_values.dim() == 4:
            pixel_values = pixel_values.unsqueeze(1)
        seq_mask = input_ids == self.config.image_token_id
        b, n = pixel_values.shape[:2]
        emb_mask = torch.ones(
            b, n, self.config.num_image_tokens, dtype=torch.bool, device=input_ids.device
        )
        return pixel_values, seq_mask, emb_mask

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.aligner(self.vision_model(pixel_values))

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def lm_logits(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.language_model(inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        return out.logits

    def get_vllm_embedding(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor
    ) -> torch.Tensor:
        pixel_values, seq_mask, emb_mask = self._masks(input_ids, pixel_values)
        return self.prepare_inputs_embeds(input_ids.clone(), pixel_values, seq_mask, emb_mask)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        images_seq_mask: torch.Tensor | None = None,
        images_emb_mask: torch.Tensor | None = None,
    ) -> Any:
        pixel_values, seq_mask, emb_mask = self._masks(input_ids, pixel_values)
        inputs_embeds = self.prepare_inputs_embeds(
            input_ids.clone(),
            pixel_values,
            seq_mask if images_seq_mask is None else images_seq_mask,
            emb_mask if images_emb_mask is None else images_emb_mask,
        )
        return self.language_model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, labels=labels
        )


REMOTE_LAYOUTS: dict[str, type[RemoteVLM]] = {
    "minicpmv": MiniCPMV2Tiny,
    "omnilmm": OmniLMMTiny,
    "internlmxcomposer2": XComposerTiny,
    "internvl_chat": InternVLTiny,
    "xtuner_llava": XTunerLLaVATiny,
    "multi_modality": DeepSeekVLTiny,
}


def remote_batch(
    model: RemoteVLM, batch_size: int = 2, seed: int = 0, with_labels: bool = True
) -> dict[str, torch.Tensor]:
    """fp32 ``pixel_values`` (B, 3, S, S), ``input_ids`` = [bos, image placeholders, text],
    ``attention_mask`` and ``labels`` (placeholders set to -100)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    b, n = batch_size, cfg.num_image_tokens
    head = torch.tensor([1] + [cfg.image_token_id] * n).expand(b, -1)
    input_ids = torch.cat([head, torch.randint(4, 200, (b, _TEXT_LEN), generator=g)], dim=1)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": torch.randn(b, 3, cfg.image_size, cfg.image_size, generator=g),
    }
    if with_labels:
        batch["labels"] = input_ids.masked_fill(input_ids == cfg.image_token_id, -100)
    return batch
