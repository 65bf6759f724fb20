"""kohya-ss sd-scripts' LoRA trainers under the launcher: ``train_network.py``,
``sdxl_train_network.py``, ``flux_train_network.py`` and ``sd3_train_network.py``.

::

    hf-precision run -- accelerate launch train_network.py --network_module networks.lora \\
        --mixed_precision bf16 --output_dir out ...

The scripts build a plain ``Accelerator`` and prepare the UNet, the text encoders and the LoRA
network one by one; the launcher's accelerate hook (:mod:`.accelerate_hook`) guards each. This
module reads the run's own arguments (the ``args`` its ``NetworkTrainer.train`` holds) and
returns a :class:`~.framework_runs.FrameworkRun` that makes the guard speak sd-scripts:

* reports go to ``<--output_dir>/precision`` (kohya's ``Accelerator`` has a ``project_dir`` only
  with ``--logging_dir``);
* the policy is inferred from ``--mixed_precision`` and said so; ``--full_bf16`` /
  ``--full_fp16`` (the LoRA network cast to half, whose updates then round away) are named when
  the guard holds the network's weights in float32, and in ``--mode audit`` the lost-update
  warning offers dropping them first;
* the network is its own group, ``lora_network``; its batch keys ``loss_weights`` and
  ``network_multipliers`` are metadata (one value per sample, never cast);
* ``--fp8_base`` is read as storage and compute (UNet weights fp8 e4m3, compute in the
  ``--mixed_precision`` dtype); on a CPU, where the fp8 UNet's GroupNorm layers cannot run, the
  run is refused when the guard starts (as the models load), before step 1.

Importing this module imports nothing of sd-scripts: :func:`detect` looks at the running
process only.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..rules.groups.diffusion import LORA_NETWORK
from .framework_runs import FrameworkRun

#: sd-scripts' LoRA entry points (their trainers all derive from ``NetworkTrainer``)
ENTRY_POINTS = (
    "train_network.py",
    "sdxl_train_network.py",
    "flux_train_network.py",
    "sd3_train_network.py",
)
#: the group of kohya's LoRA network (``networks.lora.LoRANetwork`` and its siblings)
GROUP = LORA_NETWORK
#: floating batch keys of sd-scripts' datasets: per-sample loss weights and network multipliers
METADATA_KEYS = ("loss_weights", "network_multipliers")
_FULL = {"full_bf16": "bf16", "full_fp16": "fp16"}
_FP8 = ("fp8_base", "fp8_base_unet")


def run_args(depth: int = 40) -> argparse.Namespace | None:
    """The parsed arguments of the sd-scripts run on the call stack (``NetworkTrainer.train``
    and the loaders it calls hold them as ``args``), or ``None``."""
    frame: Any = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        args = frame.f_locals.get("args")
        if isinstance(args, argparse.Namespace) and hasattr(args, "network_module"):
            return args
        frame = frame.f_back
    return None


def _program() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name in ENTRY_POINTS else "train_network.py"


def _fp8_note(args: argparse.Namespace) -> str | None:
    """``--fp8_base``'s three facts (storage, compute, no fp8 matmul: the weights are cast up
    at each layer)."""
    flag = next((f for f in _FP8 if getattr(args, f, False)), None)
    if flag is None:
        return None
    held = "UNet" if flag == "fp8_base_unet" else "UNet and text encoders"
    return (
        f"--{flag}: {held} weights fp8 e4m3 (float8_e4m3fn storage), compute "
        f"{args.mixed_precision} (each layer casts its weights up; no fp8 matmul)"
    )


def _refusal(args: argparse.Namespace, accelerator: Any, program: str) -> str | None:
    flag = next((f for f in _FP8 if getattr(args, f, False)), None)
    if flag is None or str(getattr(accelerator, "device", "cpu")) != "cpu":
        return None
    return (
        f"hf-precision: {program} --{flag} on a CPU: it stores the UNet in float8_e4m3fn (fp8 "
        "e4m3), norms included, and a CPU cannot compute its GroupNorm with fp8 weights (the "
        "first step would stop inside it). Nothing was cast or trained. Fix: drop "
        f"--{flag} on a CPU (fp8 storage needs a GPU)."
    )


def detect(accelerator: Any = None) -> FrameworkRun | None:
    """The :class:`~.framework_runs.FrameworkRun` of the sd-scripts run on the call stack, or
    ``None`` when there is none."""
    args = run_args()
    if args is None:
        return None
    program = _program()
    settings: dict[str, Any] = {"--mixed_precision": args.mixed_precision}
    for name in (*_FULL, *_FP8):
        if getattr(args, name, False):
            settings[f"--{name}"] = True
    full = next((f for f in _FULL if getattr(args, f, False)), None)
    undone: tuple[str, ...] = ()
    own_fix = ""
    if full is not None:
        half = _FULL[full]
        undone = (
            f"undoing --{full}: the guard holds the LoRA network's trainable weights in float32 "
            f"(--{full} casts them to {half}, where most small updates round away)",
        )
        own_fix = (
            f"drop --{full} (sd-scripts then keeps the LoRA network in float32 and computes in "
            f"{half} under --mixed_precision {args.mixed_precision})"
        )
    note = _fp8_note(args)
    return FrameworkRun(
        tool="kohya",
        program=program,
        output_dir=getattr(args, "output_dir", None),
        metadata_keys=METADATA_KEYS,
        settings=settings,
        undone=undone,
        own_fix=own_fix,
        notes=(note,) if note else (),
        refusal=_refusal(args, accelerator, program),
    )


__all__ = ["ENTRY_POINTS", "GROUP", "METADATA_KEYS", "detect", "run_args"]
