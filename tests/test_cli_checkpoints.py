"""``hf-precision doctor`` and ``audit`` on checkpoints shaped unlike the package's tiny models:
other vocab sizes, image token ids and image sizes, stored split (vision fp32, language bf16)."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision.cli import main

TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


def _llava() -> Any:  # SigLIP tower, 48 px / patch 8, Qwen2 text, vocab 400, image token 399
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    return LlavaForConditionalGeneration(
        LlavaConfig(
            vision_config={
                "model_type": "siglip_vision_model",
                "image_size": 48,
                "patch_size": 8,
                **VISION,
            },
            text_config={"model_type": "qwen2", "vocab_size": 400, **TEXT},
            image_token_id=399,
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
        )
    )


def _paligemma() -> Any:  # 40 px / patch 8 (25 tokens), vocab 300, image token 7
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    return PaliGemmaForConditionalGeneration(
        PaliGemmaConfig(
            vision_config={
                "model_type": "siglip_vision_model",
                "image_size": 40,
                "patch_size": 8,
                "projection_dim": 32,
                **VISION,
            },
            text_config={"model_type": "gemma", "vocab_size": 300, "head_dim": 16, **TEXT},
            image_token_id=7,
            projection_dim=32,
        )
    )


def _idefics3() -> Any:  # 48 px / patch 8, scale factor 2 (9 tokens), vocab 500, token 450
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration(
        Idefics3Config(
            vision_config={"image_size": 48, "patch_size": 8, **VISION},
            text_config={"model_type": "llama", "vocab_size": 500, **TEXT},
            image_token_id=450,
            scale_factor=2,
        )
    )


BUILDERS = {"llava": _llava, "paligemma": _paligemma, "idefics3": _idefics3}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, build in BUILDERS.items():
        torch.manual_seed(0)
        model = build()
        lm = getattr(model.model, "language_model", None) or model.model.text_model
        lm.to(torch.bfloat16)  # stored split: vision fp32, language model bf16
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = folder
    return out


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_doctor_runs_on_checkpoints_of_other_shapes(
    arch: str, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["doctor", str(checkpoints[arch]), "--policy", "bf16", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ok"], data
    assert set(data["diagnosis"]) == {"train", "generate"}


def test_doctor_says_which_value_it_needs_instead_of_a_traceback(
    checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["doctor", str(checkpoints["llava"]), "--image-token-id", "5", "--no-generate"])
    assert code == 2
    err = capsys.readouterr().err
    assert "does not fit LlavaForConditionalGeneration" in err and "--image-token-id N" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_audit_shows_the_split_as_stored(
    arch: str, checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", str(checkpoints[arch]), "--json"]) == 1  # the vision side is fp32
    data = json.loads(capsys.readouterr().out)
    groups = {g["group"]: g["dtypes"] for g in data["groups"]}
    assert groups["vision_encoder"] == "float32" and groups["language_model"] == "bfloat16"
    assert data["dtype_from"].startswith("as stored in the safetensors files")
    assert "the rest" not in data["dtype_from"]  # every stored tensor found its module


def test_audit_of_a_bare_model_type_says_where_its_dtype_comes_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # no config dtype; nothing trainable: the frozen dtype is the policy's
    assert main(["audit", "llava", "--policy", "bf16", "--trainable", "none", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "dtypes: the policy's dtype (the config declares none)" in out and "OK:" in out
    assert main(["audit", "paligemma", "--trainable", "none", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "tied: lm_head.weight -> model.language_model.embed_tokens.weight" in out
    assert "ok (tied)" in out


@pytest.mark.slow
def test_every_architecture_the_rules_know_audits_without_an_exception(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_precision.groups import group_rules

    types = sorted({t for r in group_rules() for t in r.model_types} & set(CONFIG_MAPPING_NAMES))
    assert len(types) > 40
    slow = []
    for mt in types:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = main(["audit", mt, "--json"])  # a clean CLI error (2) is an answer too
        out = capsys.readouterr()
        assert code in (0, 1, 2), (mt, code)
        if code in (0, 1):
            assert json.loads(out.out)["model_type"], mt
        else:
            # transformers may log its own warnings first (once per process): ours is the last line
            assert out.err.splitlines()[-1].startswith("hf-precision: error:"), (mt, out.err)
        slow.append((time.perf_counter() - t0, mt))
    assert max(slow)[0] < 60, max(slow)
