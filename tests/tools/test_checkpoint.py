"""Reading a checkpoint without its weights: where a source points, the dtypes its
safetensors headers store, a meta model given those dtypes, trainable groups by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_precision.model.dtype_maps import dtype_map
from hf_precision.rules.groups.module_groups import find_module_groups
from hf_precision.tiny import TINY_CONFIGS, build_tiny, tiny_available, tiny_llava
from hf_precision.tools.checkpoint import (
    apply_stored_dtypes,
    build_model,
    resolve_source,
    set_trainable,
)
from hf_precision.tools.cli import main
from hf_precision.tools.weight_files import stored_dtypes, weight_files


@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA saved split: vision tower fp32, the rest bf16."""
    model = tiny_llava(torch.bfloat16)
    model.model.vision_tower.float()
    folder = tmp_path_factory.mktemp("llava_split")
    model.save_pretrained(folder)
    return folder


def test_sources_are_folders_configs_or_model_types(split_checkpoint: Path) -> None:
    assert resolve_source(str(split_checkpoint)) == ("path", split_checkpoint)
    config = split_checkpoint / "config.json"
    assert resolve_source(str(config)) == ("path", config)
    assert resolve_source("llava") == ("type", "llava")
    with pytest.raises(SystemExit) as err:
        resolve_source(str(split_checkpoint / "missing" / "config.json"))
    assert err.value.code == 2


def test_stored_dtypes_come_from_the_headers(split_checkpoint: Path) -> None:
    stored = stored_dtypes(split_checkpoint)
    tower = {dt for name, dt in stored.items() if "vision_tower" in name}
    rest = {dt for name, dt in stored.items() if "vision_tower" not in name}
    assert tower == {torch.float32} and rest == {torch.bfloat16}


def test_a_meta_model_takes_the_stored_dtypes(split_checkpoint: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(split_checkpoint, local_files_only=True)
    model = build_model(config, meta=True)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    stored = stored_dtypes(split_checkpoint)
    matched, total = apply_stored_dtypes(model, stored)
    assert matched == total == len(stored)
    assert {p.dtype for p in model.model.vision_tower.parameters()} == {torch.float32}
    assert {p.dtype for p in model.model.language_model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"meta"}  # still no data read


def test_trainable_groups_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_llava()
    set_trainable(model, "projector, lm_head")
    trainable = {
        n.split(".")[1] if n.startswith("model.") else n.split(".")[0]
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    assert trainable == {"multi_modal_projector", "lm_head"}
    with pytest.raises(SystemExit):
        set_trainable(model, "projektor")
    assert "--trainable: unknown group 'projektor'. Did you mean 'projector'?" in (
        capsys.readouterr().err
    )


# ------------------------------------------- every tiny architecture, saved split both ways
_LM_SIDE = frozenset({"language_model", "lm_head"})
_TINY_TYPES = sorted(t for t in TINY_CONFIGS if tiny_available(t))


def _save_split(model_type: str, lm_dtype: torch.dtype, other: torch.dtype, folder: Path) -> Any:
    """The tiny model with its language model + lm_head in ``lm_dtype`` and the rest (vision
    encoder, resampler, projector, ...) in ``other``, saved with save_pretrained."""
    model = build_tiny(model_type)
    groups = find_module_groups(model)
    for name, p in model.named_parameters():
        p.data = p.data.to(lm_dtype if groups.group_of(name) in _LM_SIDE else other)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize(
    "lm_dtype, other", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
@pytest.mark.parametrize("model_type", _TINY_TYPES)
def test_audit_reads_every_tiny_checkpoint_under_its_stored_names(
    model_type: str,
    lm_dtype: torch.dtype,
    other: torch.dtype,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # transformers 5 saves Qwen2-VL as model.layers.* / visual.*: the audit must map them
    # through transformers' own loading conversion, not read the rest "in the config's dtype"
    saved = _save_split(model_type, lm_dtype, other, tmp_path)
    main(["audit", str(tmp_path), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["dtype_from"].startswith("as stored in the safetensors files"), data["dtype_from"]
    assert "the rest" not in data["dtype_from"], data["dtype_from"]
    want = {r["group"]: r["dtypes"] for r in dtype_map(saved).group_rows()}
    got = {r["group"]: r["dtypes"] for r in data["groups"]}
    assert got == want
    assert {r["devices"] for r in data["groups"]} == {"not loaded (read from the files)"}
    assert "meta" not in json.dumps(data["changes"])


def _header_only(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A ``model.safetensors`` holding only its header (what the audit reads): every tensor's
    dtype and shape, no data (meta tensors have none)."""
    import struct

    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    header = {
        k: {"dtype": names.get(t.dtype, "I64"), "shape": list(t.shape), "data_offsets": [0, 0]}
        for k, t in tensors.items()
    }
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)


#: Default configs whose auto-built class is not the one their conversion mapping is written for:
#: transformers' own loading does not map back what revert_weight_conversion names, so neither
#: can an audit that follows it. A real checkpoint names its class (``architectures``).
_NOT_ROUND_TRIPPED = {
    # AutoModelForImageTextToText builds Gemma3ForConditionalGeneration; the shieldgemma2 mapping
    # (^language_model.model -> language_model) is ShieldGemma2ForImageClassification's, whose
    # saved checkpoints read right (model.model.language_model.model.*)
    "shieldgemma2": "Gemma3ForConditionalGeneration under the shieldgemma2 mapping",
}


@pytest.mark.slow
def test_audit_reads_every_meta_built_architecture_under_its_saved_names(
    tmp_path: Path,
) -> None:
    """Every image-text-to-text architecture built at full size on the meta device, split (LM
    bf16, the rest fp32), its keys named as save_pretrained names them (transformers'
    revert_weight_conversion), written as a header-only safetensors file: a fresh meta build
    given the stored dtypes must hold the dtypes of the model that was "saved"."""
    from transformers import AutoConfig

    # how transformers 5 names what it saves (4.x saves the module names)
    loading = pytest.importorskip("transformers.core_model_loading")
    revert_weight_conversion = loading.revert_weight_conversion
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as MAPPING,
    )

    from hf_precision.tools.checkpoint import CONFIG_REPAIRS, fill_subconfigs

    wrong: dict[str, list[str]] = {}
    checked = 0
    for arch in sorted(set(MAPPING) - set(_NOT_ROUND_TRIPPED)):
        folder = tmp_path / arch
        folder.mkdir()
        config = AutoConfig.for_model(arch)
        fill_subconfigs(config)
        try:
            model = build_model(config, meta=True, exit_on_error=False)
        except Exception:
            if arch not in CONFIG_REPAIRS:
                continue  # does not build (tests/rules/test_groups_all_architectures.py says why)
            CONFIG_REPAIRS[arch](config)
            model = build_model(config, meta=True, exit_on_error=False)
        groups = find_module_groups(model)
        for name, p in model.named_parameters():
            lm = groups.group_of(name) in _LM_SIDE
            p.data = torch.empty_like(p, dtype=torch.bfloat16 if lm else torch.float32)
        want = {n: p.dtype for n, p in model.named_parameters()}
        _header_only(folder, revert_weight_conversion(model, model.state_dict()))
        config.save_pretrained(folder)
        fresh = build_model(AutoConfig.from_pretrained(folder), meta=True, exit_on_error=False)
        apply_stored_dtypes(fresh, stored_dtypes(folder))
        got = {n: p.dtype for n, p in fresh.named_parameters()}
        bad = [n for n in want if got.get(n) != want[n]]
        if bad:
            wrong[arch] = bad[:3]
        checked += 1
    assert checked > 40 and not wrong, wrong


def test_sources_are_told_apart_by_the_file_that_says_what_they_are(tmp_path: Path) -> None:
    for marker, kind in (("adapter_config.json", "adapter"), ("model_index.json", "diffusers")):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / marker).write_text("{}")
        assert resolve_source(str(tmp_path / kind)) == (kind, tmp_path / kind)
    assert resolve_source("Qwen/Qwen2-VL-7B-Instruct") == ("hub", "Qwen/Qwen2-VL-7B-Instruct")
    assert resolve_source("qwen2_vl") == ("type", "qwen2_vl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        resolve_source(str(tmp_path / "empty"))


def test_weight_files_skip_dtype_variants_next_to_plain_files(tmp_path: Path) -> None:
    names = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors")
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert [f.name for f in weight_files(tmp_path)] == [names[0]]
    (tmp_path / names[0]).unlink()
    assert [f.name for f in weight_files(tmp_path)] == [names[1]]  # only the variant is there


# ---------------------------------------------------------------------------- no Hub here
def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends: refused


def _audit(tmp_path: Path, source: str, **env: str) -> tuple[int, str, float]:
    """``hf-precision audit <source>`` as a user runs it, in a folder without ``source``."""
    import os
    import subprocess
    import sys
    import time

    run_env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    run_env.update(HF_HOME=str(tmp_path / "hf-home"), PYTHONPATH=str(Path.cwd()), **env)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "hf_precision", "audit", source],
        capture_output=True,
        text=True,
        env=run_env,
        cwd=tmp_path,
        timeout=120,
    )
    return done.returncode, done.stderr, time.monotonic() - started


@pytest.mark.parametrize("offline", ["", "1"])
def test_no_folder_and_no_hub_is_one_line_within_seconds(tmp_path: Path, offline: str) -> None:
    """#34: with the Hub unreachable (a closed port) a two-part name that is no folder here is
    answered at once in one line: no such folder here, the Hub not reachable and why (or
    offline), what to do. huggingface_hub alone retried for 74 s and then said "not on the
    Hub"."""
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    if offline:
        env["HF_HUB_OFFLINE"] = offline
    code, err, took = _audit(tmp_path, "work/ckpt_that_is_not_here", **env)
    assert code == 2 and err.count("\n") == 1 and "Retrying" not in err, err
    assert took < 30, took  # the interpreter's imports; no retry loop (74 s before)
    assert err.startswith(
        f"hf-precision: error: no folder work/ckpt_that_is_not_here here (in {tmp_path})"
    )
    if offline:
        assert "offline (HF_HUB_OFFLINE=1)" in err
    else:
        assert "the Hub could not be reached" in err and "Connection refused" in err
    assert "Fix: pass an existing checkpoint folder" in err


def test_a_reachable_hub_is_still_asked(tmp_path: Path, hub_404: str) -> None:
    """The Hub answers (a local endpoint that knows no repository): the lookup happens and its
    answer is said, in one line, not "could not be reached"."""
    code, err, _ = _audit(tmp_path, "someone/no-such-model", HF_ENDPOINT=hub_404)
    assert code == 2 and err.count("\n") == 1, err
    assert "could not be reached" not in err
    assert "no such folder: someone/no-such-model, and the Hub did not give it" in err
    assert "RepositoryNotFoundError" in err
