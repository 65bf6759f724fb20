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

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# Any wording of a matmul dtype mismatch (biased / bias-free linear, CPU / CUDA): pytest.raises.
MATMUL_DTYPE_ERROR = (
    r"(mat1 and mat2 must have the same dtype"
    r"|expected (m1 and m2|mat1 and mat2) to have the same dtype)"
)
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

    ``adaptive=True`` (MiniCPM-V 2.x): the key position table is computed in numpy in forward
    and added as ``torch.from_numpy(pos).float().to(x.device)``: device follows, dtype does
    not, so under bf16 weights the fp32 key reaches ``attn`` (class F). ``adaptive=False``
    (OmniLMM, Qwen-VL): the table is a frozen parameter cast with the module, dtype-safe.
    """

    def __init__(
        self, grid_size: int, embed_dim: int, num_heads: int, kv_dim: int, adaptive: bool
    ) -> None:
        super().__init__()
        self.embed_dim, self.adaptive = embed_dim, adaptive
        table = torch.from_numpy(get_2d_sincos_pos_embed(embed_dim, grid_size)).float()
        self.pos_embed = nn.Parameter(table, requires_grad=False)
        self.query = nn.Parameter(torch.randn(grid_size**2, embed_dim) * 0.02)
        self.kv_proj = nn.Linear(kv_dim, embed_dim, bias=False)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)
        self.ln_q, self.ln_kv = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.ln_post = nn.LayerNorm(embed_dim)
        self.proj = nn.Parameter(embed_dim**-0.5 * torch.randn(embed_dim, embed_dim))

    def forward(self, x: torch.Tensor, tgt_size: tuple[int, int]) -> torch.Tensor:
        if self.adaptive:  # the seed's line: no dtype=, so the table stays fp32
            pos = get_2d_sincos_pos_embed(self.embed_dim, tgt_size)
            pos_embed = torch.from_numpy(pos).float().to(x.device)
        else:  # Qwen-VL get_abs_pos: interpolate in fp32, cast back to the table's dtype
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
    from .vlm import build_tiny

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
    """MiniCPM-V 2.x layout: ``vpm`` (ViT), ``resampler`` (adaptive numpy table), ``llm``.

    The vision path casts pixels to ``vpm.pos_embed.dtype`` with ``.type(dtype)`` (device
    unchanged), then the resampler adds its fp32 numpy table to the keys: any bf16/fp16
    resampler fails there, whatever the input dtype (the seed's bug 4).
    """

    _MODEL_TYPE, _ADAPTIVE = "minicpmv", True

    def __init__(self, dtype: torch.dtype | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = RemoteConfig(self._MODEL_TYPE, image_size=30, num_image_tokens=4)
        self.vpm = TinyViT(image_size=30, patch_size=6, width=16)
        self.resampler = Resampler(2, 32, 4, kv_dim=16, adaptive=self._ADAPTIVE)
        self.llm = _tiny_llama()
        self.eval()
        if dtype is not None:
            self.to(dtype)

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


class OmniLMMTiny(MiniCPMV2Tiny):
    """OmniLMM layout: ``vpm.forward_features``, fixed-grid ``resampler``, ``llm``.

    ``get_vision_embedding`` does ``pixel_values.type(vpm.pos_embed.dtype)``: dtype follows the
    vision tower, device does not (a CPU batch reaches a CUDA model unchanged). With
    ``tune_clip=False`` the real code hides the tower in a list (its FSDP hack): ``vpm`` is then
    not a submodule, ``model.to(dtype)`` skips it, and its fp32 output meets a bf16 resampler.
    """

    _MODEL_TYPE, _ADAPTIVE = "omnilmm", False

    def __init__(
        self, dtype: torch.dtype | None = None, seed: int = 0, tune_clip: bool = True
    ) -> None:
        super().__init__(seed=seed)
        if not tune_clip:
            vpm = self._modules.pop("vpm")
            self.__dict__["_hidden_vpm"] = [vpm]
        if dtype is not None:
            self.to(dtype)

    def __getattr__(self, name: str) -> Any:
        hidden = self.__dict__.get("_hidden_vpm")
        if name == "vpm" and hidden is not None:
            return hidden[0]
        return super().__getattr__(name)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.vpm.pos_embed.data.dtype
        side = self.config.image_size // self.vpm.patch_size
        return self.resampler(self.vpm.forward_features(pixel_values.type(dtype)), (side, side))


class XComposerTiny(RemoteVLM):
    """InternLM-XComposer layout: ``vit``, ``vision_proj``, ``model`` (LM body), ``output``.

    ``img2emb`` moves the image to the model's device only; the vit's linear patch embedding then
    gets the collator's fp32 pixels: ``mat1 and mat2 must have the same dtype`` under fp16/bf16.
    """

    def __init__(self, dtype: torch.dtype | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = RemoteConfig("internlmxcomposer2", image_size=30, num_image_tokens=25)
        self.vit = TinyViT(image_size=30, patch_size=6, width=16, linear_patch=True)
        self.vision_proj = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        llm = _tiny_llama()
        self.model, self.output = llm.model, llm.lm_head
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


class InternVLTiny(RemoteVLM):
    """Remote-code InternVL-Chat layout: ``vision_model``, ``mlp1``, ``language_model``.

    InternViT's embeddings read ``target_dtype = patch_embedding.weight.dtype`` but never cast
    the pixels with it, so fp32 pixels into a bf16 conv fail:
    ``Input type (float) and bias type (c10::BFloat16) should be the same``.
    """

    def __init__(self, dtype: torch.dtype | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        # 32x32 image, patch 8 -> 4x4 grid (+CLS); pixel shuffle 0.5 -> 4 tokens of width 64.
        self.config = RemoteConfig("internvl_chat", image_size=32, num_image_tokens=4)
        self.downsample_ratio = 0.5
        self.vision_model = TinyViT(image_size=32, patch_size=8, width=16, cls_token=True)
        vit_hidden = 16 * int(1 / self.downsample_ratio) ** 2
        self.mlp1 = nn.Sequential(
            nn.LayerNorm(vit_hidden), nn.Linear(vit_hidden, 32), nn.GELU(), nn.Linear(32, 32)
        )
        self.language_model = _tiny_llama()
        self.eval()
        if dtype is not None:
            self.to(dtype)

    def pixel_shuffle(self, x: torch.Tensor, scale_factor: float = 0.5) -> torch.Tensor:
        n, w, h, c = x.size()
        x = x.view(n, w, int(h * scale_factor), int(c / scale_factor))
        x = x.permute(0, 2, 1, 3).contiguous()
        x = x.view(n, int(h * scale_factor), int(w * scale_factor), int(c / scale_factor**2))
        return x.permute(0, 2, 1, 3).contiguous()

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        vit_embeds = self.vision_model(pixel_values)[:, 1:, :]  # drop CLS
        side = int(vit_embeds.shape[1] ** 0.5)
        vit_embeds = self.pixel_shuffle(vit_embeds.reshape(vit_embeds.shape[0], side, side, -1))
        return self.mlp1(vit_embeds.reshape(vit_embeds.shape[0], -1, vit_embeds.shape[-1]))

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def lm_logits(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.language_model(inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        return out.logits


REMOTE_LAYOUTS: dict[str, type[RemoteVLM]] = {
    "minicpmv": MiniCPMV2Tiny,
    "omnilmm": OmniLMMTiny,
    "internlmxcomposer2": XComposerTiny,
    "internvl_chat": InternVLTiny,
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
