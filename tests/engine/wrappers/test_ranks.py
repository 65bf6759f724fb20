"""Multi-process correctness: rank agreement, FSDP/DeepSpeed detection and verification.

Single-process tests use a real one-rank gloo group where a process group is needed. The
two-process tests share ONE ``torchrun`` launch (tests/multiprocess/scenarios.py) whose results
the tests below read back.
"""

from __future__ import annotations

import doctest
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_precision import (
    PrecisionError,
    PrecisionPolicy,
    dtype_map,
    enforce_policy,
    install_guards,
)
from hf_precision.base.wrapper_kinds import (
    detect_wrapper,
    planned_wrapper,
    settle_shards,
    wrapper_compute_dtypes,
    wrapper_of,
)
from hf_precision.engine.hooks import guard_targets
from hf_precision.engine.wrappers.check import check_wrapped, explain_wrapped
from hf_precision.engine.wrappers.ranks import check_ranks_agree, rank_digest
from hf_precision.tiny import tiny_batch, tiny_llava

SCENARIOS = Path(__file__).parents[2] / "multiprocess" / "scenarios.py"


# ----------------------------------------------------------------------------- wrappers
@pytest.fixture
def one_rank(tmp_path):
    """A real one-process gloo group (FSDP and DDP need one); destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded_llava(policy: str = "bf16") -> tuple[nn.Module, PrecisionPolicy]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = tiny_llava()
    model.model.vision_tower.to(torch.float16).requires_grad_(False)
    pol = PrecisionPolicy.from_preset(policy)
    enforce_policy(model, pol)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.language_model.layers:
        fully_shard(layer, mp_policy=mp, mesh=mesh)
    fully_shard(model, mp_policy=mp, mesh=mesh)
    return model, pol


def test_plain_model_has_no_wrapper():
    model = tiny_llava()
    assert wrapper_of(model) is None and detect_wrapper(model) is None
    assert wrapper_compute_dtypes(model) == {}
    assert settle_shards(model) == 0


def test_fsdp2_is_detected_verified_and_guarded_in_its_compute_dtype(one_rank):
    model, policy = _sharded_llava()
    assert wrapper_of(model) == "FSDP2" and detect_wrapper(model) == "FSDP2"
    compute = wrapper_compute_dtypes(model)  # before the first forward (no lazy init yet)
    assert len(compute) == len(list(model.parameters()))
    assert set(compute.values()) == {torch.bfloat16}
    before = {n: p.dtype for n, p in model.named_parameters()}
    audit = enforce_policy(model, policy, mode="fix")
    assert not audit.changes and len(audit.skipped) == len(before)  # sharded: never cast
    check = check_wrapped(model, policy)
    assert not check and check.wrapper == "FSDP2" and not check.notes
    assert check.expected == {}  # enforced before sharding: storage already as the policy says
    # guards follow what FSDP computes in (bf16), not the fp32 storage of trainable weights
    install_guards(model, policy, audit)
    targets = guard_targets(model)
    assert targets["model.multi_modal_projector"] == ("boundary", "bfloat16")
    out = model(**tiny_batch(model))
    out.loss.backward()
    assert out.logits.dtype == torch.bfloat16
    assert settle_shards(model) == 0  # backward resharded everything
    with torch.no_grad():  # an evaluation: the root unit keeps unsharded bf16 views after it
        model(**tiny_batch(model))
    assert {p.dtype for p in model.model.multi_modal_projector.parameters()} == {torch.bfloat16}
    assert settle_shards(model) == 1  # the shards are registered again
    assert {n: p.dtype for n, p in model.named_parameters()} == before
    dmap = dtype_map(model)
    assert sum(r.sharded for r in dmap) == dmap.total_params
    assert dmap.groups["projector"].dtypes == ("float32",)
    assert dmap.groups["vision_encoder"].dtypes == ("bfloat16",)


def test_fsdp2_compute_dtype_that_contradicts_the_policy_is_explained(one_rank):
    model, _ = _sharded_llava()
    fp16 = PrecisionPolicy.from_preset("fp16")
    check = check_wrapped(model, fp16)
    assert check and len(check.violations) == len(list(model.parameters()))
    assert "computed in bfloat16; the policy wants float32 (trainable)" in "\n".join(
        check.violations
    )
    err = check.error("where", fp16)
    assert "FSDP2 holds them, so the guard will not cast them" in str(err)
    assert "MixedPrecisionPolicy(param_dtype=...)" in str(err)
    audit = enforce_policy(model, fp16, mode="audit")
    with pytest.raises(PrecisionError, match="FSDP2 holds them"):
        explain_wrapped(model, fp16, audit.groups, audit, where="where")


def test_fsdp_upcast_of_trainable_weights_is_expected(one_rank):
    """accelerate upcasts trainable weights to fp32 before fully_shard under mixed precision:
    under a bf16-true policy that is expected, not drift."""
    model = tiny_llava(dtype=torch.bfloat16)
    policy = PrecisionPolicy.from_preset("bf16-true")
    for p in model.parameters():
        p.data = p.data.float()  # what accelerate's fsdp2_prepare_model does to trainables
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fully_shard(
        model,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        mesh=init_device_mesh("cpu", (1,)),
    )
    check = check_wrapped(model, policy)
    assert not check.violations
    assert check.expected == {"stored float32, computed bfloat16 by FSDP2": 64}
    audit = enforce_policy(model, policy, mode="audit")
    kept = explain_wrapped(model, policy, audit.groups, audit, where="w")
    assert kept.changes == []


def test_fsdp1_and_ddp_are_detected(one_rank):
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    ddp = nn.parallel.DistributedDataParallel(tiny_llava())
    assert wrapper_of(ddp) == "DDP"
    fsdp = FullyShardedDataParallel(
        tiny_llava(),
        device_id=torch.device("cpu"),
        use_orig_params=True,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
    )
    assert wrapper_of(fsdp) == "FSDP"
    assert set(wrapper_compute_dtypes(fsdp).values()) == {torch.bfloat16}
    assert not check_wrapped(fsdp, PrecisionPolicy.from_preset("bf16"))


def test_deepspeed_is_detected_and_its_dtype_expected():
    # A unit test of the check alone: a stand-in named like its engine, and the attribute ZeRO-3
    # puts on partitioned parameters. Real DeepSpeed runs in the torchrun scenarios below.
    class DeepSpeedEngine(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    model = tiny_llava().to(torch.bfloat16)  # DeepSpeed bf16 casts the whole module
    engine = DeepSpeedEngine(model)
    assert wrapper_of(engine) == "DeepSpeed"
    zero3 = tiny_llava()
    next(zero3.parameters()).ds_id = 0
    assert wrapper_of(zero3) == "DeepSpeed"
    policy = PrecisionPolicy.from_preset("bf16", keep_fp32=("lm_head",))
    check = check_wrapped(engine, policy, wrapper="DeepSpeed", deepspeed_dtype=torch.bfloat16)
    assert not check.violations
    assert list(check.expected.values()) == [sum(1 for _ in model.parameters()) - 1]
    # DeepSpeed cast the keep-fp32 head: reported as its cast, with the fix
    assert check.notes == []
    assert check.casts == [
        ("lm_head.weight", "lm_head", torch.bfloat16, torch.float32, "keep_fp32 'lm_head'")
    ]
    msg = check.cast_message("where")
    assert msg.startswith(
        "where: DeepSpeed holds 1 parameter(s) in bfloat16 that the policy "
        "keeps in float32 (keep_fp32 'lm_head'): lm_head: 1 parameter(s), "
        "e.g. lm_head.weight."
    )
    assert "no setting that keeps one module in float32. Fix:" in msg


def test_planned_wrappers_from_accelerator_and_args(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    try:
        assert planned_wrapper(Accelerator(cpu=True)) is None
    finally:
        AcceleratorState._reset_state(True)
    ns = types.SimpleNamespace  # the TrainingArguments fields read (FSDP/DeepSpeed need a GPU)
    assert planned_wrapper(args=ns(deepspeed="ds.json")) == "DeepSpeed"
    assert (
        planned_wrapper(args=ns(deepspeed=None, fsdp="full_shard", fsdp_config={"version": 2}))
        == "FSDP2"
    )
    assert planned_wrapper(args=ns(deepspeed=None, fsdp="full_shard", fsdp_config={})) == "FSDP"
    assert planned_wrapper(args=ns(deepspeed=None, fsdp="", world_size=2)) == "DDP"


# ----------------------------------------------------------------------------- ranks (1 process)
def test_rank_check_is_free_in_one_process(one_rank):
    check_ranks_agree(dtype_map(tiny_llava()))  # world size 1: nothing to compare


def test_numel_free_digest_ignores_shard_sizes():
    a, b = tiny_llava(), tiny_llava()
    b.lm_head.weight = nn.Parameter(b.lm_head.weight.detach()[:3])  # another rank's FSDP1 slice
    da, db = dtype_map(a), dtype_map(b)
    assert rank_digest(da) != rank_digest(db)
    assert rank_digest(da, with_numel=False) == rank_digest(db, with_numel=False)
    b.lm_head.to(torch.bfloat16)
    assert rank_digest(da, with_numel=False) != rank_digest(dtype_map(b), with_numel=False)


class _Slicer(nn.Module):
    """A wrapper no library ships: each rank would hold its own slice of every parameter."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


def test_ranks_compare_without_numel_where_the_wrapper_kind_slices(monkeypatch) -> None:
    """The rank check reads the kind's ``slices_per_rank``, not its name: a kind registered
    with it has its ranks compared by dtype only (per-rank slices differ in size)."""
    from hf_precision.base.wrapper_kinds import WRAPPERS, WrapperKind, register_wrapper
    from hf_precision.engine.wrappers import ranks

    seen: list[bool] = []
    monkeypatch.setattr(ranks, "is_distributed", lambda: True)  # the gather is what is faked
    monkeypatch.setattr(ranks, "check_ranks_agree", lambda d, **kw: seen.append(kw["with_numel"]))
    saved = dict(WRAPPERS)
    try:
        register_wrapper(WrapperKind("Slicer", classes=("_Slicer",), slices_per_rank=True))
        ranks.check_model_ranks(_Slicer(tiny_llava()))
        register_wrapper(WrapperKind("Slicer", classes=("_Slicer",)))
        ranks.check_model_ranks(_Slicer(tiny_llava()))
    finally:
        WRAPPERS.clear()
        WRAPPERS.update(saved)
    assert seen == [False, True]


@pytest.mark.parametrize("name", ["engine.wrappers.ranks"])
def test_module_doctests(name):
    import importlib

    mod = importlib.import_module(f"hf_precision.{name}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 2


# ----------------------------------------------------------------------------- two processes
def _launch(out: Path, names: list[str], nproc: int = 2, timeout: int = 600) -> dict[str, Any]:
    """Run ``names`` in one torchrun launch; what each rank wrote, plus the launch's log.

    A launch past ``timeout`` is killed and still returns what finished: the scenarios that
    wrote no file fail their own tests, with the log and the scenario that was running."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "DS_ACCELERATOR": "cuda" if torch.cuda.is_available() else "cpu",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(SCENARIOS),
        str(out),
        *names,
    ]
    # its own session, so that a timeout kills the ranks with the launcher
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        log = ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        running = next((n for n in names if not (out / n / "rank0.json").is_file()), None)
        log = f"torchrun killed after {timeout} s while running {running!r}\n"
    log += "".join(stream.decode(errors="replace")[-4000:] for stream in (stdout, stderr))
    results: dict[str, Any] = {"_log": log}
    for name in names:
        results[name] = [
            json.loads((out / name / f"rank{r}.json").read_text())
            if (out / name / f"rank{r}.json").is_file()
            else None
            for r in range(nproc)
        ]
    return results


CPU_SCENARIOS = [
    "one_walk",
    "plain_loop",
    "plain_disagree",
    "trainer",
    "trainer_disagree",
    "fsdp2",
    "fsdp1",
    # real DeepSpeed on CPU, last (ZeRO-3 leaves global state behind)
    "ds_zero2_fp32",
    "ds_zero2_bf16_keep_fp32_tower",
    "ds_zero2_keep_fp32_tower_raise",
    "ds_zero3_init_bf16",
    "ds_zero3_fp32",
    "ds_zero3_peft_bf16_adapters",
    "ds_json_contradicts_flag",
]


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """One torchrun launch, two CPU processes (gloo), every scenario in sequence.

    Launched once per test run even when xdist spreads the "torchrun" group over workers
    (pytest 9.2 + xdist 3.8 ignore ``xdist_group`` here): the first worker launches under a file
    lock in the folder all workers share, the others read its results."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    # under xdist each worker's basetemp sits in the session's folder; without it basetemp is
    # the session's folder (its parent is shared by every session: stale results)
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "torchrun"
    with FileLock(str(shared / "torchrun.lock")):
        done = out / "results.json"
        if not done.is_file():
            out.mkdir(exist_ok=True)
            done.write_text(json.dumps(_launch(out, CPU_SCENARIOS)))
        return out, json.loads(done.read_text())


def _ok(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    ranks = results[name]
    assert all(r is not None for r in ranks), results["_log"]
    for r in ranks:
        assert r["ok"], r.get("traceback")
    return ranks


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_plain_loop_on_two_ranks(two_ranks):
    out, results = two_ranks
    r0, r1 = _ok(results, "plain_loop")
    assert r0["wrapped"] == r1["wrapped"] == "DistributedDataParallel"
    assert r0["digest"] == r1["digest"]
    assert (
        r0["groups"]
        == r1["groups"]
        == {
            "vision_encoder": ["bfloat16"],
            "projector": ["float32"],
            "language_model": ["float32"],
            "lm_head": ["float32"],
        }
    )
    assert r0["events"] == r1["events"] and r0["events"][0] == ["setup", 39]
    assert r0["generated"] == r1["generated"] and r0["policy"] == "bf16"
    assert r0["written"] and r1["written"] == []  # only the main process writes
    files = sorted(p.name for p in (out / "plain_loop" / "precision").iterdir())
    assert files == sorted(r0["written"] + ["precision.log"])
    assert r0["policy_file"] and r1["policy_file"]  # one shared checkpoint folder


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_one_walk_per_event_on_two_ranks(two_ranks):
    """Under DDP on two ranks one event checks, unwraps and walks the model once: the rank
    check reuses the event's view and the reporter's dtype map (no second walk, no stack walk
    through ``_modules``), and maps the view itself when no reporter made one."""
    _, results = two_ranks
    one = {"walks": ["view.py:walk_modules"], "unwraps": ["view.py:of"], "checks": ["view.py:of"]}
    for r in _ok(results, "one_walk"):
        assert r["wrapper"] == "DistributedDataParallel"
        for case in ("reported", "bare"):
            assert r[case] == {**one, "changes": 0}, case


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_plain_loop_disagreement_names_ranks_and_modules(two_ranks):
    _, results = two_ranks
    for r in results["plain_disagree"]:
        assert r is not None and not r["ok"] and r["error"] == "PrecisionError"
        msg = r["message"]
        assert msg.startswith("PrecisionGuardPlugin.setup: the ranks disagree")
        assert "rank 1 differs from rank 0 in 2 module(s)" in msg
        assert (
            "model.multi_modal_projector.linear_1: rank 0 float32 on cpu, 1056 trainable; "
            "rank 1 bfloat16 on cpu, 0 trainable"
        ) in msg


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_trainer_and_callback_on_two_ranks(two_ranks):
    out, results = two_ranks
    r0, r1 = _ok(results, "trainer")
    assert r0["world_size"] == 2
    assert r0["digest"] == r1["digest"] == results["plain_loop"][0]["digest"]
    assert r0["events"] == r1["events"]
    assert [e for e, _ in r0["events"]][:2] == ["on_init_end", "on_train_begin"]
    assert r0["eval_loss"] == r1["eval_loss"]
    assert r0["written"] and r1["written"] == []
    files = {p.name for p in (out / "trainer" / "precision").glob("*.json")}
    assert files == {w for w in r0["written"] if w.endswith(".json")}
    assert "000000-on_train_begin.json" in files


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_trainer_disagreement_stops_at_train_begin(two_ranks):
    _, results = two_ranks
    for r in results["trainer_disagree"]:
        assert r is not None and not r["ok"] and r["error"] == "PrecisionError"
        msg = r["message"]
        assert msg.startswith("PrecisionGuardCallback.on_train_begin: the ranks disagree")
        assert "rank 1 differs from rank 0 in 21 module(s)" in msg
        assert (
            "model.vision_tower.encoder.layers.0.mlp.fc1: rank 0 bfloat16 on cpu, 0 "
            "trainable; rank 1 float16 on cpu, 0 trainable"
        ) in msg


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_fsdp2_on_two_ranks_verifies_without_casting(two_ranks):
    _, results = two_ranks
    r0, r1 = _ok(results, "fsdp2")
    for r in (r0, r1):
        assert r["wrapper"] == "FSDP2" and r["all_dtensor"]
        assert not r["cast"] and not r["cast_by_wrong_policy"]
        assert r["skipped"] == 64 and r["compute"] == ["torch.bfloat16"]
        assert r["sharded"] == r["numel"]  # the map counts whole parameters, not shards
        assert r["logits"] == "torch.bfloat16"
        assert "FSDP2 holds them, so the guard will not cast them" in r["wrong_policy"]
    assert r0["groups"] == r1["groups"] == results["plain_loop"][0]["groups"]
    assert r0["digest"] == r1["digest"] == results["plain_loop"][0]["digest"]
    assert r0["loss"] == r1["loss"]
    assert r0["written"] and r1["written"] == []


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_fsdp1_on_two_ranks(two_ranks):
    _, results = two_ranks
    r0, r1 = _ok(results, "fsdp1")
    assert r0["wrapper"] == r1["wrapper"] == "FSDP" and not r0["cast"]
    assert r0["digest"] != r1["digest"]  # each rank holds another slice of the flat params
    assert r0["digest_no_numel"] == r1["digest_no_numel"]  # what the rank check compares
    assert r0["groups"] == r1["groups"]


# ----------------------------------------------------------------------------- DeepSpeed (CPU)
@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_deepspeed_zero2_and_zero3_fp32_train_with_the_callback(two_ranks):
    _, results = two_ranks
    for name in ("ds_zero2_fp32", "ds_zero3_fp32"):
        r0, r1 = _ok(results, name)
        for r in (r0, r1):
            assert r["engine"] == "DeepSpeedEngine" and r["policy"] == "fp32"
            assert r["warnings"] == [] and all(n == 0 for _, n in r["events"][1:])
        assert r0["eval_loss"] == r1["eval_loss"]
        assert torch.isfinite(torch.tensor([r0["loss"], r0["eval_loss"]])).all()
    assert results["ds_zero2_fp32"][0]["dtypes"] == ["torch.float32"]
    assert results["ds_zero3_fp32"][0]["partition_dtypes"] == ["torch.float32"]


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_deepspeed_zero3_partitioned_load_is_never_cast(two_ranks):
    _, results = two_ranks
    r0, r1 = _ok(results, "ds_zero3_init_bf16")
    for r in (r0, r1):
        assert r["engine"] == "DeepSpeedEngine" and r["partitioned"]
        # Trainer() ran on_init_end: the partitioned parameters were left alone (data and
        # ds_tensor agree, no cast recorded), each one verified and skipped
        assert r["same_after_init"] and r["init_changes"] == 0 and r["init_skipped"] == r["params"]
        assert r["data_vs_partition"] == [["torch.bfloat16", "torch.bfloat16"]]
        assert all(n == 0 for _, n in r["events"]) and r["warnings"] == []
        # dtype maps count whole parameters (ds_numel), not the empty local pieces
        assert r["numel"] == r["sharded"] == 58624
        assert all(n > 0 for sizes in r["groups"].values() for n in sizes)
    assert r0["groups"] == r1["groups"]


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_deepspeed_cast_of_a_keep_fp32_tower_is_warned_and_reported(two_ranks):
    _, results = two_ranks
    r0, r1 = _ok(results, "ds_zero2_bf16_keep_fp32_tower")
    for r in (r0, r1):
        assert r["engine"] == "DeepSpeedEngine" and r["tower"] == ["torch.bfloat16"]
        assert len(r["warnings"]) == 1  # once, at on_train_begin, not at every evaluation
        msg = r["warnings"][0]
        assert msg.startswith(
            "PrecisionGuardCallback.on_train_begin: DeepSpeed holds 39 "
            "parameter(s) in bfloat16 that the policy keeps in float32 "
            "(group_dtypes['vision_encoder']): vision_encoder: 39"
        )
        assert "model.vision_tower.embeddings.class_embedding" in msg and "Fix:" in msg
    # mismatch rows, not neutral drift; DeepSpeed holds them: found, none repaired, all open
    assert r0["cast_rows"] == 39
    assert r0["mismatches"] == {"found": 39, "repaired": 0, "open": 39}
    for r in results["ds_zero2_keep_fp32_tower_raise"]:
        assert r is not None and not r["ok"] and r["error"] == "PrecisionError"
        assert r["message"].startswith(
            "PrecisionGuardCallback.on_train_begin: DeepSpeed holds "
            "39 parameter(s) in bfloat16 that the policy keeps in "
            "float32 (keep_fp32 'model.vision_tower')"
        )


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_deepspeed_zero3_keeps_bf16_adapters_and_opens_no_autocast(two_ranks):
    """TRL under ZeRO-3 makes LoRA with autocast_adapter_dtype=False: bf16 on purpose (fp32
    adapters beside bf16 weights in one all-gather bucket raised a TypeError in DeepSpeed up to
    PR 8073; DeepSpeed keeps fp32 master copies). The bf16 preset leaves them bf16 and says so;
    the guard opens no autocast around the engine and diagnose(autocast=...) refuses one.
    About 9 s in the shared launch on 2 CPU ranks (25 s alone: two steps, an evaluation each)."""
    _, results = two_ranks
    r0, r1 = _ok(results, "ds_zero3_peft_bf16_adapters")
    for r in (r0, r1):
        assert r["engine"] == "DeepSpeedEngine" and r["adapters"] == 8
        assert r["loaded"] == r["after_init"] == r["partitions"] == ["torch.bfloat16"]
        assert "wrapper_master_fp32" in r["kept_rules"] and r["warnings"] == []
        assert all(n == 0 for _, n in r["events"])
        assert torch.isfinite(torch.tensor([r["loss"], r["eval_loss"]])).all()
        assert r["kept_rows"] == 8 and ["wrapper_master_fp32", "default"] in r["kept_json"]
        assert r["autocast_seen"] == [[False, False]]  # no autocast inside the engine's forward
        assert r["diagnose_autocast"].startswith(
            "diagnose(autocast='bf16'): DeepSpeed holds this model (DeepSpeedEngine)"
        )
        assert '"torch_autocast": {"enabled": true' in r["diagnose_autocast"]
    assert r0["setup_lines"] == [
        "hf-precision: nothing cast; kept in their dtype on purpose: 8 (wrapper_master_fp32); "
        "policy bf16 (frozen bfloat16, trainable float32, compute bfloat16; mode=fix); report: "
        + r0["setup_lines"][0].rsplit("report: ", 1)[1]
    ]
    assert r0["eval_loss"] == r1["eval_loss"]


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_deepspeed_json_that_contradicts_the_flag_stops_before_training(two_ranks):
    _, results = two_ranks
    for r in results["ds_json_contradicts_flag"]:
        assert r is not None and not r["ok"] and r["error"] == "PrecisionError"
        assert 'the JSON says "bf16": {"enabled": false} but --bf16 is True' in r["message"]


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_accelerate_fsdp_and_deepspeed_on_gpu(tmp_path):
    """accelerate's FSDP1/FSDP2 (and DeepSpeed ZeRO when installed) on the GPUs there are
    (one is enough: torchrun with one process still makes accelerate wrap the model)."""
    names = ["gpu_fsdp2", "gpu_fsdp1", "gpu_fsdp2_bf16_true"]
    try:
        import deepspeed  # noqa: F401

        names += ["gpu_deepspeed_zero2", "gpu_deepspeed_zero3"]
    except ImportError:
        pass
    nproc = min(2, torch.cuda.device_count())
    results = _launch(tmp_path, names, nproc=nproc, timeout=420)
    for name in names:
        for r in _ok(results, name):
            assert not r["violations"], (name, r)
            assert r["wrapper"] == r["expected_wrapper"], (name, r)
            assert r["loss_finite"], (name, r)
        digests = {r["digest"] for r in results[name]}
        assert len(digests) == 1, (name, digests)


@pytest.mark.multiprocess
@pytest.mark.xdist_group("torchrun")
def test_a_split_model_built_under_zero_init_trains_under_the_guard(tmp_path):
    """ZeRO-3's zero.Init partitions what it can at construction; the weights it did not (fp32)
    join the bf16 partitions (DeepSpeed holds the fp32 master copies), so its one-dtype flatten
    does not assert; the partitions themselves are never written. One process: under zero.Init
    with two CPU ranks transformers' own weight init indexes an empty embedding partition."""
    results = _launch(tmp_path, ["ds_accelerate_zero3_init_split"], nproc=1, timeout=300)
    for r in _ok(results, "ds_accelerate_zero3_init_split"):
        assert r["wrapper"] == "DeepSpeed" and r["loss_finite"], r
        assert not r["violations"], r
