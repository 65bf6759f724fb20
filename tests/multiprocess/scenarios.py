"""Multi-process scenarios, run by ``tests/engine/wrappers/test_ranks.py`` in ONE torchrun launch::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 tests/multiprocess/scenarios.py \
        OUT_DIR plain_loop plain_disagree trainer trainer_disagree fsdp2 fsdp1

Each scenario runs on every rank (gloo, CPU) and writes ``OUT_DIR/<scenario>/rank<r>.json``:
what it observed, or the error it raised. The pytest side asserts on those files. Scenarios run
one after another in the same processes (imports dominate the cost), separated by barriers.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

warnings.simplefilter("ignore")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(1)

SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {}


def scenario(fn: Callable[[Path], dict[str, Any]]) -> Callable[[Path], dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


def rank() -> int:
    return dist.get_rank()


def group_dtypes(model: torch.nn.Module) -> dict[str, list[str]]:
    from hf_precision import dtype_map

    return {g: list(s.dtypes) for g, s in dtype_map(model).groups.items()}


def split_llava(freeze_projector: bool = False) -> torch.nn.Module:
    """The planted split: vision tower loaded in fp16 and frozen, the rest fp32 and trained."""
    from hf_precision.tiny import tiny_llava

    model = tiny_llava(seed=0)
    model.model.vision_tower.to(torch.float16).requires_grad_(False)
    if freeze_projector:
        model.model.multi_modal_projector.requires_grad_(False)
    return model


def rows_of(model: torch.nn.Module, n: int = 4) -> list[dict[str, torch.Tensor]]:
    from hf_precision.tiny import tiny_batch

    batch = tiny_batch(model, batch_size=2)
    return [{k: v[i % 2] for k, v in batch.items()} for i in range(n)]


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def loop(accelerator: Any, model: Any, optimizer: Any, loader: Any) -> float:
    loss = torch.tensor(float("nan"))
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return float(loss)


# ----------------------------------------------------------------------------- plain loop
@scenario
def plain_loop(out: Path) -> dict[str, Any]:
    from accelerate import Accelerator

    from hf_precision import PrecisionGuardPlugin, dtype_map
    from hf_precision.frontends.accelerate_plugin import POLICY_FILE

    accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(out))
    model = split_llava()
    loader = torch.utils.data.DataLoader(rows_of(model), batch_size=2)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    guard = PrecisionGuardPlugin()
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)
    loss = loop(accelerator, model, optimizer, loader)
    first = next(iter(loader))
    with guard.evaluating(model), torch.no_grad():
        inputs = {k: v for k, v in first.items() if k != "labels"}
        generated = accelerator.unwrap_model(model).generate(**inputs, max_new_tokens=2)
    ckpt = out / "ckpt"
    accelerator.save_state(str(ckpt))
    accelerator.wait_for_everyone()
    accelerator.load_state(str(ckpt))
    return {
        "wrapped": type(model).__name__,
        "loss": loss,
        "generated": list(generated.shape),
        "digest": dtype_map(model).digest(),
        "groups": group_dtypes(model),
        "policy": guard.policy.name if guard.policy else None,
        "events": guard.events,
        "written": [p.name for p in guard._reporter.written],
        "policy_file": (ckpt / POLICY_FILE).is_file(),
        "steps": guard.steps,
    }


@scenario
def plain_disagree(out: Path) -> dict[str, Any]:
    """Rank 1 freezes the projector too (code under a rank-dependent branch)."""
    from accelerate import Accelerator

    from hf_precision import PrecisionGuardPlugin

    accelerator = Accelerator(cpu=True, mixed_precision="bf16", project_dir=str(out))
    model = split_llava(freeze_projector=rank() == 1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    guard = PrecisionGuardPlugin(report=False)
    guard.prepare(accelerator, model, optimizer)  # raises on both ranks, before DDP exists
    return {"wrapped": "no error"}


@scenario
def one_walk(out: Path) -> dict[str, Any]:
    """One event of an engine on a DDP model, on both ranks: the view's one walk, unwrap and
    model check serve the plan, the guards, the reporter's dtype map and the rank check
    (``check_model_ranks(view=, dmap=)``); without a reporter the rank check maps the view."""
    from torch.nn.parallel import DistributedDataParallel
    from walks import counting_walks

    from hf_precision import PrecisionPolicy
    from hf_precision.engine.guard import PrecisionGuard
    from hf_precision.report.reporter import PrecisionReporter

    model = split_llava()
    seen: dict[str, Any] = {}
    for case, reporter in (("reported", PrecisionReporter(out / "precision")), ("bare", None)):
        guard = PrecisionGuard(
            model, PrecisionPolicy.from_preset("bf16"), reporter=reporter, claim=False
        )
        guard.verify("setup", check_ranks=True)  # cast before the wrapper exists
        ddp = DistributedDataParallel(model)
        guard.mark_wrapped(ddp)
        with counting_walks(ddp) as walks:
            report = guard.verify("check", model=ddp, wrapper="auto", check_ranks=True)
        seen[case] = {**walks.as_dict(), "changes": len(report.changes)}
    seen["wrapper"] = type(ddp).__name__
    return seen


# ----------------------------------------------------------------------------- Trainer
def training_args(out: Path, **kw: Any) -> Any:
    """Two steps of batch 2 on CPU/gloo, an evaluation after each, no checkpoints, no trackers."""
    from transformers import TrainingArguments

    defaults: dict[str, Any] = dict(
        output_dir=str(out),
        use_cpu=True,
        report_to=[],
        max_steps=2,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="no",
        remove_unused_columns=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        learning_rate=1e-3,
        seed=0,
        ddp_backend="gloo",
        ddp_timeout=60,
    )
    return TrainingArguments(**{**defaults, **kw})


def _trainer(out: Path, callback: Any, model: torch.nn.Module, bf16: bool = True) -> Any:
    from transformers import Trainer

    args = training_args(out, bf16=bf16)
    data = rows_of(model)
    return Trainer(
        model=model, args=args, train_dataset=data, eval_dataset=data, callbacks=[callback]
    )


@scenario
def trainer(out: Path) -> dict[str, Any]:
    from hf_precision import PrecisionGuardCallback, dtype_map

    model = split_llava()
    cb = PrecisionGuardCallback()
    t = _trainer(out, cb, model)
    result = t.train()
    metrics = t.evaluate()
    return {
        "world_size": t.args.world_size,
        "loss": result.training_loss,
        "eval_loss": metrics["eval_loss"],
        "digest": dtype_map(model).digest(),
        "groups": group_dtypes(model),
        "events": cb.events,
        "written": [p.name for p in cb._reporter.written],
    }


@scenario
def trainer_disagree(out: Path) -> dict[str, Any]:
    """A policy read from a per-rank setting: rank 1 keeps the vision encoder in fp16. DDP would
    broadcast rank 0's bf16 bytes into rank 1's fp16 tensors without a word. No bf16 flag: under
    bf16=True rank 1's fp16 group would be refused at on_init_end (on that rank alone)."""
    from hf_precision import PrecisionGuardCallback, PrecisionPolicy

    policy = PrecisionPolicy.from_preset(
        "bf16", group_dtypes={"vision_encoder": "fp16"} if rank() == 1 else {}
    )
    cb = PrecisionGuardCallback(policy, report=False)
    _trainer(out, cb, split_llava(), bf16=False).train()
    return {"trained": True}


# ----------------------------------------------------------------------------- FSDP
def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


@scenario
def fsdp2(out: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from hf_precision import PrecisionError, PrecisionGuardPlugin, dtype_map
    from hf_precision.base.wrapper_kinds import detect_wrapper, wrapper_compute_dtypes
    from hf_precision.tiny import tiny_batch

    model = split_llava()
    guard = PrecisionGuardPlugin("bf16", report_dir=str(out / "precision"))
    guard.setup(model)  # casts before sharding: the vision tower fp16 -> bf16
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = _mesh()
    for layer in model.model.language_model.layers:
        fully_shard(layer, mp_policy=mp, mesh=mesh)
    fully_shard(model, mp_policy=mp, mesh=mesh)
    before = {n: (str(p.dtype), type(p).__name__) for n, p in model.named_parameters()}
    report = guard.verify(model, "after_wrap")  # FSDP2 detected: verify, never cast
    after = {n: (str(p.dtype), type(p).__name__) for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = tiny_batch(model)
    out_ = model(**batch)
    out_.loss.backward()
    optimizer.step()
    with guard.evaluating(model), torch.no_grad():
        logits_dtype = str(model(**batch).logits.dtype)
    dmap = dtype_map(model)
    # A guard whose policy computes in fp16 meets FSDP computing in bf16: explained, not cast
    # (the first guard steps aside: two guards with different policies are refused)
    guard.remove()
    try:
        PrecisionGuardPlugin("fp16", report=False).verify(model, "after_wrap")
        wrong = "no error"
    except PrecisionError as err:
        wrong = str(err)
    unchanged = {n: (str(p.dtype), type(p).__name__) for n, p in model.named_parameters()}
    return {
        "wrapper": detect_wrapper(model),
        "cast": before != after,
        "cast_by_wrong_policy": after != unchanged,
        "skipped": len(report.skipped),
        "all_dtensor": all(t == "DTensor" for _, t in after.values()),
        "compute": sorted({str(d) for d in wrapper_compute_dtypes(model).values()}),
        "groups": group_dtypes(model),
        "digest": dmap.digest(),
        "sharded": sum(r.sharded for r in dmap),
        "numel": dmap.total_params,
        "loss": float(out_.loss),
        "logits": logits_dtype,
        "wrong_policy": wrong,
        "written": [p.name for p in guard._reporter.written],
    }


@scenario
def fsdp1(out: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    from hf_precision import PrecisionGuardPlugin
    from hf_precision.base.wrapper_kinds import detect_wrapper
    from hf_precision.engine.wrappers.ranks import rank_digest
    from hf_precision.model.dtype_maps import dtype_map
    from hf_precision.tiny import tiny_batch

    model = split_llava()
    guard = PrecisionGuardPlugin("bf16", report=False)
    guard.setup(model)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = dict(device_id=torch.device("cpu"), use_orig_params=True, mixed_precision=mp)
    # FSDP1 flattens one dtype per unit: the frozen bf16 vision tower gets its own unit
    model.model.vision_tower = FullyShardedDataParallel(model.model.vision_tower, **kw)
    wrapped = FullyShardedDataParallel(model, **kw)
    before = [str(p.dtype) for p in wrapped.parameters()]
    guard.verify(wrapped, "after_wrap")
    after = [str(p.dtype) for p in wrapped.parameters()]
    out_ = wrapped(**tiny_batch(model))
    out_.loss.backward()
    dmap = dtype_map(wrapped)
    return {
        "wrapper": detect_wrapper(wrapped),
        "cast": before != after,
        "loss": float(out_.loss),
        "digest": dmap.digest(),
        "digest_no_numel": rank_digest(dmap, with_numel=False),
        "groups": group_dtypes(wrapped),
    }


# ----------------------------------------------------------------------------- DeepSpeed (CPU)
# Real DeepSpeed on CPU: DS_ACCELERATOR=cpu (set by the launcher) selects its CPU accelerator,
# which uses gloo when the oneCCL bindings are absent. TrainingArguments(use_cpu=True,
# deepspeed=<dict>) makes the Trainer build a real DeepSpeedEngine on the two ranks.
def ds_config(stage: int, **extra: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:  # partition tiny tensors too, and gather them for save_pretrained
        zero.update(
            stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True
        )
    return {
        "zero_optimization": zero,
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        # the Trainer's torch AdamW, not DeepSpeed's CPU Adam (a compiled op)
        "zero_force_ds_cpu_optimizer": False,
        **extra,
    }


def ds_args(out: Path, stage: int, *, bf16: bool, config: dict[str, Any] | None = None) -> Any:

    return training_args(out, bf16=bf16, deepspeed=ds_config(stage, **(config or {})))


def ds_done() -> None:
    """Forget the ZeRO-3 config transformers keeps globally (later models must not be
    partitioned at construction)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def ds_run(
    out: Path,
    model: torch.nn.Module,
    args: Any,
    cb: Any,
    rows: list[dict[str, torch.Tensor]],
    after_init: Callable[[], None] | None = None,
    after_train: Callable[[Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    from transformers import Trainer

    from hf_precision import PrecisionWarning

    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", PrecisionWarning)
            t = Trainer(
                model=model, args=args, train_dataset=rows, eval_dataset=rows, callbacks=[cb]
            )
            if after_init is not None:
                after_init()
            result = t.train()
            metrics = t.evaluate()
            extra = after_train(t) if after_train is not None else {}
    finally:
        warnings.simplefilter("ignore")
        ds_done()
    return {
        **extra,
        "engine": type(t.model_wrapped).__name__,
        "loss": result.training_loss,
        "eval_loss": metrics["eval_loss"],
        "events": cb.events,
        "warnings": [str(w.message) for w in seen if w.category is PrecisionWarning],
    }


@scenario
def ds_zero2_fp32(out: Path) -> dict[str, Any]:
    from hf_precision import PrecisionGuardCallback

    model = split_llava()
    rows = rows_of(model)
    cb = PrecisionGuardCallback(report=False)
    res = ds_run(out, model, ds_args(out, 2, bf16=False), cb, rows)
    return {
        **res,
        "policy": cb.policy.name if cb.policy else None,
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


@scenario
def ds_zero2_bf16_keep_fp32_tower(out: Path) -> dict[str, Any]:
    """The policy keeps the frozen vision tower fp32; DeepSpeed bf16 casts the whole model at
    engine init. The guard says so at on_train_begin and reports the rows as mismatches."""
    from hf_precision import PrecisionGuardCallback, PrecisionPolicy

    model = split_llava()
    rows = rows_of(model)
    policy = PrecisionPolicy.from_preset("bf16", group_dtypes={"vision_encoder": "fp32"})
    cb = PrecisionGuardCallback(policy, report_dir=str(out / "precision"))
    res = ds_run(out, model, ds_args(out, 2, bf16=True), cb, rows)
    report = json.loads((out / "precision" / "000000-on_train_begin.json").read_text())
    return {
        **res,
        "tower": sorted({str(p.dtype) for p in model.model.vision_tower.parameters()}),
        "mismatches": report["mismatches"],
        "cast_rows": sum(
            r["mismatch"] and r["reason"].startswith("cast by DeepSpeed") for r in report["drift"]
        ),
    }


@scenario
def ds_zero2_keep_fp32_tower_raise(out: Path) -> dict[str, Any]:
    from hf_precision import PrecisionGuardCallback, PrecisionPolicy

    model = split_llava()
    model.model.vision_tower.float()  # as the policy wants it: nothing to cast at on_init_end
    rows = rows_of(model)
    policy = PrecisionPolicy.from_preset("bf16", keep_fp32=("model.vision_tower",), mode="raise")
    ds_run(
        out, model, ds_args(out, 2, bf16=True), PrecisionGuardCallback(policy, report=False), rows
    )
    return {"trained": True}


def _zero3_load(out: Path, *, bf16: bool) -> tuple[Any, Any, list[dict[str, torch.Tensor]]]:
    """Save a tiny LLaVA, make ZeRO-3 TrainingArguments, then from_pretrained: transformers
    builds the model under deepspeed.zero.Init, so every parameter is partitioned before the
    Trainer exists."""
    import deepspeed
    from transformers import LlavaForConditionalGeneration

    from hf_precision.tiny import tiny_llava

    ckpt = out / "ckpt"
    source = tiny_llava(torch.bfloat16 if bf16 else None, seed=0)
    rows = rows_of(source)
    if rank() == 0:
        source.save_pretrained(ckpt)
    dist.barrier()
    args = ds_args(out, 3, bf16=bf16)
    # zero.Init sizes its config from deepspeed.comm's world: join DeepSpeed's comm to the gloo
    # group torchrun made (without it zero.Init sees one process and rejects the batch sizes).
    deepspeed.init_distributed(dist_backend="gloo")
    model = LlavaForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.bfloat16 if bf16 else torch.float32
    )
    model.model.vision_tower.requires_grad_(False)
    return model, args, rows


def _storage(model: torch.nn.Module) -> dict[str, list[str]]:
    return {
        n: [str(p.dtype), str(p.ds_tensor.dtype), str(p.numel())]
        for n, p in model.named_parameters()
    }


@scenario
def ds_zero3_init_bf16(out: Path) -> dict[str, Any]:
    from hf_precision import PrecisionGuardCallback, dtype_map

    model, args, rows = _zero3_load(out, bf16=True)
    before = _storage(model)
    partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    cb = PrecisionGuardCallback(report_dir=str(out / "precision"))
    seen: dict[str, Any] = {}

    def after_init() -> None:  # Trainer() ran on_init_end: what did the guard do?
        seen["same_after_init"] = _storage(model) == before
        report = cb.last_report
        seen["init_changes"] = len(report.changes) if report is not None else None
        seen["init_skipped"] = len(report.skipped) if report is not None else None

    res = ds_run(out, model, args, cb, rows, after_init)
    dmap = dtype_map(model)
    return {
        **res,
        **seen,
        "partitioned": partitioned,
        "params": len(before),
        "numel": dmap.total_params,
        "sharded": sum(r.sharded for r in dmap),
        "groups": {g: [s.numel.get(d, 0) for d in s.dtypes] for g, s in dmap.groups.items()},
        "data_vs_partition": sorted(
            {(str(p.dtype), str(p.ds_tensor.dtype)) for p in model.parameters()}
        ),
    }


@scenario
def ds_zero3_fp32(out: Path) -> dict[str, Any]:
    from hf_precision import PrecisionGuardCallback

    model, args, rows = _zero3_load(out, bf16=False)
    cb = PrecisionGuardCallback(report=False)
    res = ds_run(out, model, args, cb, rows)
    return {
        **res,
        "policy": cb.policy.name if cb.policy else None,
        "partition_dtypes": sorted({str(p.ds_tensor.dtype) for p in model.parameters()}),
    }


@scenario
def ds_zero3_peft_bf16_adapters(out: Path) -> dict[str, Any]:
    """TRL under ZeRO-3: a partitioned bf16 load, LoRA made with PEFT's
    ``autocast_adapter_dtype=False`` (bf16 on purpose), Trainer(bf16=True) with the callback.
    The guard leaves the adapters bf16 (rule wrapper_master_fp32) and opens no autocast around
    the engine; ``diagnose(engine, autocast=...)`` refuses."""
    import logging

    from peft import LoraConfig, get_peft_model

    from hf_precision import PrecisionError, PrecisionGuardCallback
    from hf_precision.tools.diagnostics import diagnose

    model, args, rows = _zero3_load(out, bf16=True)
    lora = LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    peft = get_peft_model(model, lora, autocast_adapter_dtype=False)
    adapters = [p for n, p in peft.named_parameters() if "lora_" in n]
    loaded = sorted({str(p.dtype) for p in adapters})
    autocast_seen: set[tuple[bool, bool]] = set()
    peft.base_model.model.register_forward_pre_hook(
        lambda *_: autocast_seen.add(
            (torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"))
        )
    )
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("hf_precision").addHandler(handler)
    cb = PrecisionGuardCallback(report_dir=str(out / "precision"))
    seen: dict[str, Any] = {}

    def after_init() -> None:
        seen["after_init"] = sorted({str(p.dtype) for p in adapters})
        report = cb.last_report
        seen["kept_rules"] = sorted({k[2] for k in report.kept}) if report is not None else []

    def after_train(t: Any) -> dict[str, Any]:  # the guard's diagnose on the engine itself
        batch = {k: v.unsqueeze(0) for k, v in rows[0].items()}
        try:
            diagnose(t.model_wrapped, batch, autocast="bf16", backward=False)
            return {"diagnose_autocast": "ran under autocast"}
        except PrecisionError as err:
            return {"diagnose_autocast": str(err)}
        except Exception as err:  # an autocast was opened around the engine: what happened
            return {"diagnose_autocast": f"ran under autocast: {type(err).__name__}: {err}"}

    try:
        res = ds_run(out, peft, args, cb, rows, after_init, after_train)
    finally:
        logging.getLogger("hf_precision").removeHandler(handler)
    dist.barrier()  # rank 0 writes the reports
    event = json.loads((out / "precision" / "000000-on_init_end.json").read_text())
    return {
        **res,
        **seen,
        "loaded": loaded,
        "adapters": len(adapters),
        "partitions": sorted({str(p.ds_tensor.dtype) for p in adapters}),
        "kept_json": sorted({(k["rule"], k["name"].split(".")[-2]) for k in event["kept"]}),
        "kept_rows": sum(k["rule"] == "wrapper_master_fp32" for k in event["kept"]),
        "setup_lines": [line for line in lines if "wrapper_master_fp32" in line],
        "autocast_seen": sorted(autocast_seen),
    }


@scenario
def ds_json_contradicts_flag(out: Path) -> dict[str, Any]:
    from hf_precision import PrecisionGuardCallback

    model = split_llava()
    args = ds_args(out, 2, bf16=True, config={"bf16": {"enabled": False}})
    ds_run(out, model, args, PrecisionGuardCallback(report=False), rows_of(model))
    return {"trained": True}


# ----------------------------------------------------------------------------- GPU (accelerate)
def _gpu_run(out: Path, *, fsdp: int = 0, zero: int = 0, bf16_true: bool = False) -> dict[str, Any]:
    """accelerate wraps the model itself (FSDP1/FSDP2/DeepSpeed): the guard casts before and
    verifies after; accelerate's fp32 upcast of trainable weights is expected."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    from hf_precision import PrecisionGuardPlugin, dtype_map
    from hf_precision.base.wrapper_kinds import wrapper_of
    from hf_precision.engine.wrappers.check import check_wrapped
    from hf_precision.engine.wrappers.ranks import rank_digest
    from hf_precision.tiny import tiny_llava

    kw: dict[str, Any] = {}
    if fsdp:
        kw["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=fsdp,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer", "CLIPEncoderLayer"],
            **({"use_orig_params": True} if fsdp == 1 else {}),
        )
    if zero:
        kw["deepspeed_plugin"] = DeepSpeedPlugin(
            hf_ds_config={
                "zero_optimization": {"stage": zero},
                "bf16": {"enabled": "auto"},
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 1,
            }
        )
    accelerator = Accelerator(mixed_precision="bf16", **kw)
    model = tiny_llava(dtype=torch.bfloat16 if bf16_true else None)
    loader = torch.utils.data.DataLoader(rows_of(model), batch_size=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = PrecisionGuardPlugin(
        "bf16-true" if bf16_true else None, report_dir=str(out / "precision")
    )
    model, optimizer, loader = guard.prepare(accelerator, model, optimizer, loader)
    loss = loop(accelerator, model, optimizer, loader)
    with guard.evaluating(model), torch.no_grad():
        model(**next(iter(loader)))
    wrapper = wrapper_of(model) or ("DeepSpeed" if zero else None)
    assert guard.policy is not None
    check = check_wrapped(
        model, guard.policy, wrapper=wrapper, deepspeed_dtype=guard.deepspeed_dtype
    )
    return {
        "wrapper": wrapper,
        "expected_wrapper": "DeepSpeed" if zero else f"FSDP{fsdp}".replace("FSDP1", "FSDP"),
        "violations": check.violations,
        "expected": check.expected,
        "loss_finite": bool(torch.isfinite(torch.tensor(loss))),
        "events": guard.events,
        "digest": rank_digest(dtype_map(model), with_numel=wrapper == "FSDP2"),
    }


@scenario
def gpu_fsdp2(out: Path) -> dict[str, Any]:
    return _gpu_run(out, fsdp=2)


@scenario
def gpu_fsdp1(out: Path) -> dict[str, Any]:
    return _gpu_run(out, fsdp=1)


@scenario
def gpu_fsdp2_bf16_true(out: Path) -> dict[str, Any]:
    return _gpu_run(out, fsdp=2, bf16_true=True)


@scenario
def ds_accelerate_zero3_init_split(out: Path) -> dict[str, Any]:
    """accelerate's DeepSpeed plugin at stage 3 turns on ``deepspeed.zero.Init`` before the model
    is built: a split tiny LLaVA comes out with 59 trainable partitions in bf16 and 5 weights
    (projector, lm_head) unpartitioned in fp32, which ZeRO-3 cannot flatten into one buffer
    (``defragment`` asserts) with or without a plain guard. The guard casts the 5 to bf16
    (rule ``wrapper_master_fp32``: DeepSpeed keeps the fp32 master copies) and leaves the
    partitions alone. The same run as ``gpu_deepspeed_zero3``, on the CPU (gloo)."""
    return _gpu_run(out, zero=3)


@scenario
def gpu_deepspeed_zero2(out: Path) -> dict[str, Any]:
    return _gpu_run(out, zero=2)


@scenario
def gpu_deepspeed_zero3(out: Path) -> dict[str, Any]:
    return _gpu_run(out, zero=3)


# ----------------------------------------------------------------------------- harness
def skip_shm_comm_build() -> None:
    """DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce (``deepspeed_shm_comm``,
    g++ on first use, ~50 s on 2 idle cores and minutes on a busy CI machine) when its first engine
    starts. It is a CPU speed path with no bearing on dtypes; marked incompatible, DeepSpeed falls
    back to plain torch.distributed (gloo), as it does on platforms without the op."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main() -> None:
    out_dir = Path(sys.argv[1])
    names = sys.argv[2:] or [n for n in SCENARIOS if not n.startswith("gpu_")]
    if any(n.startswith("ds_") for n in names):
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
        if os.environ["DS_ACCELERATOR"] == "cpu":
            skip_shm_comm_build()
    backend = "nccl" if any(n.startswith("gpu_") for n in names) else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    for name in names:
        where = out_dir / name
        where.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            result = {"ok": True, **SCENARIOS[name](where)}
        except Exception as err:  # recorded for the pytest side, which asserts on it
            result = {
                "ok": False,
                "error": type(err).__name__,
                "message": str(err),
                "traceback": traceback.format_exc(),
            }
        result["seconds"] = round(time.perf_counter() - t0, 2)
        (where / f"rank{rank()}.json").write_text(json.dumps(result, indent=1, default=str))
        reset_accelerate()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
