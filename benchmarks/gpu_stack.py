"""GPU check (not a timing): an outer ``torch.autocast('cuda')`` around a DeepSpeed engine step.

DeepSpeed >= 0.17.2 owns autocast (its ``torch_autocast`` section). With an autocast opened
outside the engine it asserts ``torch.autocast is enabled outside DeepSpeed`` (0.17.x) or, from
0.19.8, warns and switches autocast off inside the engine; its check reads CUDA autocast only
(``torch.is_autocast_enabled()`` without a device). The guard never opens one (the CPU test
``tests/engine/wrappers/test_ranks.py::test_deepspeed_zero3_keeps_bf16_adapters_and_opens_no_autocast``);
this script records, on a GPU, what the same ZeRO-3 step does in three arms:

* ``plain``: the guard's setup and wrap events, then ``engine(**batch)``, backward, step;
* ``outer_autocast``: the same step inside ``torch.autocast("cuda", dtype=torch.bfloat16)``;
* ``outer_autocast_ds_autocast``: the same, the engine built with
  ``"torch_autocast": {"enabled": true, "dtype": "bfloat16"}``.

Each arm records whether autocast was on inside the model's forward (a forward pre-hook), the
logits' and loss's dtypes, the loss, the adapters' dtypes after the step (the guard keeps
TRL's bf16 LoRA bf16 under ZeRO-3: rule ``wrapper_master_fp32``), DeepSpeed's warnings or
its assertion. A tiny LLaVA, one process, well under 2 minutes once DeepSpeed is importable
(``DS_BUILD_OPS=0 pip install deepspeed``)::

    PYTHONPATH=. python3 -m benchmarks.gpu_stack --out gpu_stack.json

The lent GPU image has torch, transformers, peft and accelerate but no DeepSpeed: carry wheels
(a pure-Python DeepSpeed wheel, ``DS_BUILD_OPS=0 pip wheel --no-deps deepspeed==0.19.8``, plus
``hjson`` and ``pydantic`` with ``pydantic-core``, ``annotated-types``, ``typing-inspection``).
On the CPU the same arms run with ``DS_ACCELERATOR=cpu`` and ``.cuda()`` as a no-op: autocast
stays off inside the forward in every arm there (CUDA autocast does nothing on a CPU model).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import torch

DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _model() -> Any:
    """A tiny LLaVA in bf16 with TRL's ZeRO-3 LoRA (``autocast_adapter_dtype=False``)."""
    from peft import LoraConfig, get_peft_model

    from hf_precision.tiny import tiny_llava

    model = tiny_llava(torch.bfloat16, seed=0).cuda()
    lora = LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    return get_peft_model(model, lora, autocast_adapter_dtype=False)


def _arm(name: str, outer: bool, ds_autocast: bool) -> dict[str, Any]:
    import deepspeed

    from hf_precision.engine.guard import PrecisionGuard
    from hf_precision.rules.policy.precision_policy import PrecisionPolicy
    from hf_precision.tiny import tiny_batch

    model = _model()
    guard = PrecisionGuard(
        model,
        PrecisionPolicy.from_preset("bf16"),
        deepspeed_dtype=torch.bfloat16,
        deepspeed_stage=3,
        claim=False,
    )
    setup = guard.verify("setup")
    config = dict(DS_CONFIG)
    if ds_autocast:
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    guard.verify("after_wrap", model=engine, wrapper="auto")
    inside: list[tuple[bool, bool]] = []
    model.base_model.model.register_forward_pre_hook(
        lambda *_: inside.append(
            (torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu"))
        )
    )
    batch = {
        k: v.cuda() if torch.is_tensor(v) else v
        for k, v in tiny_batch(model.base_model.model).items()
    }
    ctx = torch.autocast("cuda", dtype=torch.bfloat16, enabled=outer)
    out: dict[str, Any] = {"arm": name, "outer_autocast": outer, "ds_torch_autocast": ds_autocast}
    try:
        with ctx:
            result = engine(**batch)
        engine.backward(result.loss)
        engine.step()
        out.update(
            loss=float(result.loss),
            loss_dtype=str(result.loss.dtype),
            logits_dtype=str(result.logits.dtype),
            finite=bool(torch.isfinite(result.loss)),
        )
    except Exception as err:  # DeepSpeed's assertion (0.17.x) is a result, not a failure
        out["error"] = f"{type(err).__name__}: {err}"
    out["autocast_inside_forward"] = sorted(set(inside))
    adapters = {
        str(getattr(p, "ds_tensor", p).dtype) for n, p in model.named_parameters() if "lora_" in n
    }
    out["adapter_dtypes"] = sorted(adapters)
    out["kept_rules"] = sorted({k[2] for k in setup.kept})
    out["setup_changes"] = len(setup.changes)
    guard.teardown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_stack.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_stack: needs a CUDA GPU")
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29533",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(key, value)
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl")
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("DeepSpeed").addHandler(handler)
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "device": torch.cuda.get_device_name(),
        "arms": [],
    }
    t0 = time.perf_counter()
    for name, outer, ds_autocast in (
        ("plain", False, False),
        ("outer_autocast", True, False),
        ("outer_autocast_ds_autocast", True, True),
    ):
        said.clear()
        arm = _arm(name, outer, ds_autocast)
        arm["deepspeed_autocast_messages"] = [m for m in said if "autocast" in m]
        results["arms"].append(arm)
        print(json.dumps(arm), flush=True)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"gpu_stack: wrote {args.out} ({results['seconds']} s)")


if __name__ == "__main__":
    main()
