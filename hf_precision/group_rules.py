"""Built-in group rules: transformers 5.24 paths, and remote-code layouts matched by attribute
names. ``hf-precision architectures`` (:func:`hf_precision.groups.architecture_table`) prints
them as the README's table; register your own with :func:`hf_precision.groups.register_group_rule`.

``_r`` keeps the table short: each keyword is a group, each space-separated word a candidate path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from .groups import GroupRule, register_group_rule

_KEYS = {
    "vision": "vision_encoder",
    "resampler": "resampler",
    "projector": "projector",
    "audio": "audio_encoder",
    "lm": "language_model",
    "head": "lm_head",
}


def _r(
    name: str,
    types: str,
    match: Callable[[nn.Module], bool] | None = None,
    *,
    extra: Mapping[str, str] | None = None,
    params: Mapping[str, str] | None = None,
    note: str = "",
    **groups: str,
) -> GroupRule:
    groups.setdefault("head", "lm_head")
    return GroupRule(
        name,
        model_types=tuple(types.split()),
        match=match,
        paths={_KEYS[k]: tuple(v.split()) for k, v in groups.items() if v},
        extra={_KEYS[k]: tuple(v.split()) for k, v in (extra or {}).items()},
        params={_KEYS[k]: tuple(v.split()) for k, v in (params or {}).items()},
        note=note,
    )


def _attrs(*names: str) -> Callable[[nn.Module], bool]:
    return lambda m: all(isinstance(m._modules.get(n), nn.Module) for n in names)


_VT, _LM = "model.vision_tower", "model.language_model"
for _rule in (
    _r(
        "llava",
        "llava llava_next llava_onevision llava_next_video vipllava fast_vlm granite4_vision",
        vision=_VT,
        resampler="model.vision_resampler model.spatial_projectors",
        projector="model.multi_modal_projector",
        lm=_LM,
        extra={"resampler": "model.layerwise_projectors"},
        params={"resampler": "model.image_newline"},
    ),
    _r(
        "video_llava",
        "video_llava",
        vision="model.image_tower",
        lm=_LM,
        extra={"vision": "model.video_tower"},
        projector="model.multi_modal_projector",
    ),
    _r(
        "idefics",
        "idefics",
        vision="model.vision_model",
        resampler="model.perceiver_resampler",
        lm="model",
    ),
    _r(
        "idefics2",
        "idefics2",
        vision="model.vision_model",
        resampler="model.connector.perceiver_resampler",
        projector="model.connector.modality_projection",
        lm="model.text_model",
    ),
    _r(
        "idefics3",
        "idefics3 smolvlm",
        vision="model.vision_model",
        resampler="model.connector",
        projector="model.connector.modality_projection",
        lm="model.text_model",
    ),
    _r(
        "granite_docling",
        "granite_docling",
        vision="model.vision_model",
        resampler="model.vision_model.connector",
        lm="model.text_model",
    ),
    _r(
        "vision_tower_projector",
        "paligemma gemma3 shieldgemma2 internvl aya_vision mistral3 mistral_large4 mllama got_ocr2 "
        "pp_chart2table cohere2_vision lfm2_vl lfm3_vl molmo2 qianfan_ocr minimax_m3_vl aria "
        "kimi_k25 deepseek_vl perception_lm step3p7 unlimited_ocr deepseek_ocr2 video_llama_3 "
        "paddleocr_vl cosmos3_edge florence2 ovis2 lighton_ocr",
        vision=f"{_VT} model.vision_model model.vision_encoder model.visual",
        projector="model.multi_modal_projector model.aligner model.mm_projector model.projector "
        "model.vision_projection model.visual_embeddings_table",
        lm=f"{_LM} model.text_model",
        # DeepSeek-OCR layouts: separators in the LM embedding space, like LLaVA's image_newline.
        params={"resampler": "model.image_newline model.view_separator"},
    ),
    _r(
        "qwen2_vl",
        "qwen2_vl qwen2_5_vl qwen3_vl qwen3_vl_moe qwen3_5 qwen3_5_moe qwen2_5_omni_thinker "
        "qwen3_omni_moe_thinker qwen4_exp cosmos3_omni cohere_compass exaone4_5 glm4v glm4v_moe "
        "glm46v glmga glm5_next glm_ocr hyperclovax_vision_v2 dots3_note inkling2 "
        "inkling_mm_model inkling2_loop hunyuan_vl hy_v4_vl ernie4_5_vl_moe",
        vision=f"model.visual {_VT} model.vision_model",
        resampler="model.visual.merger model.vision_tower.merger model.vision_model.merger "
        "model.vision_tower.patch_merger model.resampler_model",
        projector="model.projector",
        audio="model.audio_tower",
        lm=_LM,
        extra={"resampler": "model.visual.deepstack_merger_list model.visual.merger_list"},
    ),
    _r(
        "gemma3n",
        "gemma3n gemma4",
        vision=_VT,
        projector="model.embed_vision",
        audio="model.audio_tower",
        extra={"audio": "model.embed_audio"},
        lm=_LM,
    ),
    _r(
        "gemma4_unified",
        "gemma4_unified",
        vision="model.embed_vision",
        audio="model.embed_audio",
        lm=_LM,
    ),
    _r(
        "muse",
        "muse_glimmer muse_spark",
        vision=_VT,
        projector="model.vision_adapter",
        audio="model.audio_tower",
        lm=_LM,
        extra={"projector": "model.vision_projection model.perception_emb_norm"},
    ),
    _r(
        "janus",
        "janus",
        vision="model.vision_model",
        projector="model.aligner",
        lm=_LM,
        # Image generation path: VQ tokenizer, its embeddings/aligner into the LM, image head.
        extra={
            "vision": "model.vqmodel",
            "projector": "model.generation_embeddings model.generation_aligner",
            "head": "model.generation_head",
        },
    ),
    _r(
        "deepseek_vl_hybrid",
        "deepseek_vl_hybrid",
        vision="model.vision_model",
        projector="model.aligner",
        lm=_LM,
        extra={
            "vision": "model.high_res_vision_model model.high_res_vision_neck "
            "model.high_res_vision_proj"
        },
        params={"vision": "model.high_res_vision_alpha"},
    ),
    _r("chameleon", "chameleon", vision="model.vqmodel", lm="model"),
    _r(
        "apertus1p5",
        "apertus1p5",
        vision="model.vision_tokenizer",
        audio="model.audio_tokenizer",
        lm=_LM,
    ),
    _r("emu3", "emu3", vision="model.vqmodel", lm="model.text_model"),
    _r(
        "blip_2",
        "blip-2 instructblip instructblipvideo",
        vision="vision_model",
        resampler="qformer",
        projector="language_projection",
        lm="language_model",
        head="language_model.lm_head lm_head",
        params={"resampler": "query_tokens"},
    ),
    _r("blip", "blip", vision="vision_model", lm="text_decoder", head="text_decoder.cls"),
    _r(
        "kosmos2",
        "kosmos-2 kosmos-2.5",
        vision="vision_model",
        resampler="image_to_text_projection",
        projector="image_to_text_projection.dense",
        lm="text_model",
        head="text_model.lm_head",
        params={"resampler": "image_to_text_projection.latent_query"},
    ),
    _r("fuyu", "fuyu", vision="model.vision_embed_tokens", lm=_LM),
    _r(
        "minicpmv",
        "minicpmv4_6 minicpmv4_7 minicpm_ocr",
        vision=_VT,
        resampler="model.merger",
        lm=_LM,
    ),
    _r(
        "top_level",
        "llama4 nemotron_h_omni",
        vision="vision_model",
        projector="multi_modal_projector",
        lm="language_model",
        head="language_model.lm_head",
        audio="audio_tower",
        extra={"vision": "vision_final_layernorm", "audio": "embed_audio"},
    ),
    _r(
        "git",
        "git",
        vision="git.image_encoder",
        projector="git.visual_projection",
        lm="git",
        head="output",
        extra={"vision": "git.img_temporal_embedding"},
    ),
    _r(
        "pi0",
        "pi0",
        vision="model.vlm.vision_tower",
        projector="model.vlm.multi_modal_projector",
        lm="model.vlm.language_model",
        head="action_out_proj",
        extra={"lm": "model.dit", "projector": "embed_action_time"},
    ),
    _r(
        "encoder_decoder",
        "pix2struct vision-encoder-decoder",
        vision="encoder",
        lm="decoder",
        head="decoder.lm_head decoder.cls decoder.output_projection",
    ),
    _r(
        "pp_formulanet",
        "pp_formulanet",
        vision="model.encoder",
        projector="model.encoder.multi_modal_projector",
        lm="model.decoder",
    ),
    _r(
        "t5gemma2",
        "t5gemma2",
        vision="model.encoder.vision_tower",
        projector="model.encoder.multi_modal_projector",
        lm="model.encoder.text_model",
        extra={"lm": "model.decoder"},
    ),
    _r(
        "diffusion_gemma",
        "diffusion_gemma",
        vision="model.encoder.vision_tower",
        projector="model.encoder.embed_vision",
        lm="model.encoder.language_model",
        extra={"lm": "model.decoder"},
    ),
    _r(
        "udop",
        "udop",
        vision="patch_embed",
        lm="encoder",
        extra={"vision": "encoder.embed_patches decoder.embed_patches", "lm": "decoder shared"},
    ),
    # Remote-code layouts (trust_remote_code checkpoints), matched by attribute names too.
    # MiniCPM-V 2.x / MiniCPM-o: vpm/resampler/llm (+ apm audio); OmniLMM-12B:
    # model.vision_tower/model.resampler inside the Mistral body ``model``, lm_head on top.
    _r(
        "minicpmv2_omnilmm",
        "minicpmv minicpmo omnilmm",
        _attrs("vpm", "resampler", "llm"),
        note="remote code: MiniCPM-V 2.x, MiniCPM-o, OmniLMM-12B, whose vision tower a plain "
        "list may hold (found all the same, reported as hidden)",
        vision="vpm model.vision_tower",
        resampler="resampler model.resampler",
        lm="llm model",
        head="llm.lm_head lm_head",
        audio="apm",
        extra={"audio": "audio_projection_layer"},
    ),
    _r(
        "internlm_xcomposer",
        "internlmxcomposer2 internlm_xcomposer2",
        _attrs("vit", "vision_proj", "model"),
        note="remote code: InternLM-XComposer 2/2.5, PLoRA inside the LM",
        vision="vit",
        projector="vision_proj",
        lm="model",
        head="output score",
        extra={"projector": "video_mem_proj"},
        params={"vision": "plora_glb_GN plora_sub_GN"},
    ),
    # XTuner's LLaVAModel (mmengine, no HF config): llm / visual_encoder / projector; XTuner
    # wraps the LLM itself with peft (self.llm = get_peft_model(self.llm, ...)).
    _r(
        "xtuner_llava",
        "xtuner_llava",
        _attrs("llm", "visual_encoder", "projector"),
        note="XTuner's LLaVAModel, whose LLM may be a PeftModel",
        vision="visual_encoder",
        projector="projector",
        lm="llm",
        head="llm.lm_head llm.base_model.model.lm_head",
    ),
    _r(
        "internvl_chat",
        "internvl_chat",
        _attrs("vision_model", "mlp1", "language_model"),
        note="remote code: InternVL-Chat",
        vision="vision_model",
        projector="mlp1",
        lm="language_model",
        head="language_model.lm_head language_model.output",
    ),
):
    register_group_rule(_rule)
