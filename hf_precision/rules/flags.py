"""The user's own words for precision settings: which tool launched the run, and how that tool
spells a flag.

A fix is only useful in the vocabulary the user types: ``bf16: true`` in a LLaMA-Factory or
axolotl YAML, ``--bf16`` on TRL's CLI (or any ``HfArgumentParser`` script), ``--bf16 true`` for
ms-swift, ``bf16=True`` in Python, ``mixed_precision='bf16'`` for accelerate,
``--mixed_precision bf16`` for kohya's sd-scripts (``train_network.py`` and its SDXL, Flux and
SD3 siblings). :func:`detect_tool`
finds the tool from what is there to see (in this order): the ``HF_PRECISION_TOOL`` environment
variable a launcher may set, the ``TrainingArguments`` subclass's module, the name of the
running program (``sys.argv[0]``), and whether the program was given command-line options.

>>> flag("bf16", tool="llamafactory"), flag("bf16", tool="trl"), flag("bf16", tool="swift")
('bf16: true', '--bf16', '--bf16 true')
>>> flag("fp16", False, tool="python"), flag("bf16", tool="accelerate")
('fp16=False', "Accelerator(mixed_precision='bf16')")
>>> flag("bf16", tool="kohya"), flag("full_bf16", tool="kohya"), no_flag(tool="kohya")
('--mixed_precision bf16', '--full_bf16', '--mixed_precision no')
>>> load_dtype("bfloat16", tool="swift")
'--torch_dtype bfloat16'
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any, Literal, get_args

import torch

#: Who launched the run, as far as the spelling of a flag goes.
Tool = Literal["python", "cli", "trl", "llamafactory", "axolotl", "swift", "accelerate", "kohya"]
TOOLS: tuple[Tool, ...] = get_args(Tool)
#: The environment variable a launcher sets to say which tool runs (a :data:`Tool` or an alias).
ENV = "HF_PRECISION_TOOL"

_ALIASES: dict[str, Tool] = {
    "llama-factory": "llamafactory",
    "llamafactory-cli": "llamafactory",
    "lmf": "llamafactory",
    "ms-swift": "swift",
    "transformers": "python",
    "hf": "python",
}
#: a package (first module path component, or a directory of the program's path) -> tool
_PACKAGES: dict[str, Tool] = {
    "llamafactory": "llamafactory",
    "axolotl": "axolotl",
    "swift": "swift",
}
#: the program's file name (no suffix) -> tool
_PROGRAMS: dict[str, Tool] = {
    "llamafactory-cli": "llamafactory",
    "lmf": "llamafactory",
    "axolotl": "axolotl",
    "swift": "swift",
    "trl": "trl",
    "accelerate": "accelerate",
    # kohya-ss sd-scripts: its LoRA trainers (hf_precision.integrations.kohya)
    "train_network": "kohya",
    "sdxl_train_network": "kohya",
    "flux_train_network": "kohya",
    "sd3_train_network": "kohya",
}
_YAML: frozenset[Tool] = frozenset(("llamafactory", "axolotl"))


def _known(name: str) -> Tool | None:
    key = name.strip().lower()
    if key in TOOLS:
        return key  # type: ignore[return-value]
    return _ALIASES.get(key)


def detect_tool(
    args: Any = None,
    *,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Tool:
    """Which tool the user drives the run with (see the module docstring for the order).

    ``args`` is the ``TrainingArguments`` (or ``None``); ``argv`` and ``environ`` default to
    ``sys.argv`` and ``os.environ``.

    >>> detect_tool(argv=["/usr/bin/llamafactory-cli", "train", "qlora.yaml"], environ={})
    'llamafactory'
    >>> detect_tool(argv=["train.py"], environ={"HF_PRECISION_TOOL": "ms-swift"})
    'swift'
    >>> detect_tool(argv=["train.py"], environ={})
    'python'
    >>> detect_tool(argv=["sft_vlm.py", "--output_dir", "out", "--bf16"], environ={})
    'cli'
    """
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    named = _known(environ.get(ENV, ""))
    if named is not None:
        return named
    module = type(args).__module__ if args is not None else ""
    top = module.split(".", 1)[0]
    if top in _PACKAGES:
        return _PACKAGES[top]
    program = PurePath(argv[0]) if argv and argv[0] else None
    if program is not None:
        stem = program.name.removesuffix(".py")
        if stem in _PROGRAMS:
            return _PROGRAMS[stem]
        for part in program.parts[:-1]:  # torchrun children run <pkg>/launcher.py, swift/cli/...
            if part in _PACKAGES:
                return _PACKAGES[part]
    if top == "trl" and _has_options(argv):
        return "trl"
    return "cli" if _has_options(argv) else "python"


def _has_options(argv: Sequence[str]) -> bool:
    """The program was given ``--name value`` options (an ``HfArgumentParser``/TRL script)."""
    return any(a.startswith("--") and len(a) > 2 for a in argv[1:])


def flag(name: str, value: bool | str = True, *, tool: Tool | None = None, args: Any = None) -> str:
    """``name`` set to ``value`` as the user's tool spells it (``name``: a ``TrainingArguments``
    field such as ``bf16``, ``fp16``, ``bf16_full_eval``).

    Under accelerate the mixed-precision flags are ``Accelerator(mixed_precision=...)``. In
    Python, the arguments' own class names the call when ``args`` is given
    (``SFTConfig(bf16=True)``).
    """
    tool = detect_tool(args) if tool is None else tool
    if tool == "accelerate" and name in ("bf16", "fp16"):
        return f"Accelerator(mixed_precision={name if value else 'no'!r})"
    if tool == "kohya" and name in ("bf16", "fp16"):
        return f"--mixed_precision {name if value else 'no'}"
    if tool in _YAML:
        return f"{name}: {str(value).lower()}"
    if tool == "swift":
        return f"--{name} {str(value).lower()}"
    if tool in ("cli", "trl", "kohya"):
        return f"--{name}" if value is True else f"--{name} {value}"
    owner = type(args).__name__ if args is not None and tool == "python" else ""
    return f"{owner}({name}={value!r})" if owner else f"{name}={value!r}"


def set_flag(
    name: str,
    value: bool | str = True,
    *,
    tool: Tool | None = None,
    args: Any = None,
    argv: Sequence[str] | None = None,
) -> str:
    """A flag the user already set, in the words they set it with: :func:`flag`, except that a
    command-line tool's ``--name`` that is not on the command line (``argv``, default
    ``sys.argv``) was set in Python (``TrainingArguments(bf16=True)`` in a script that takes
    other options), and is said so.

    >>> set_flag("bf16", tool="cli", argv=["train.py", "--epochs", "3"])
    'bf16=True'
    >>> set_flag("bf16", tool="cli", argv=["train.py", "--bf16"])
    '--bf16'
    """
    tool = detect_tool(args) if tool is None else tool
    argv = sys.argv if argv is None else argv
    # TRL's CLI: only when this process is `trl` (its configs default bf16=True in Python)
    program = PurePath(argv[0]).name if argv else ""
    typed_here = tool == "cli" or (tool == "trl" and program == "trl")
    if typed_here and not any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv[1:]):
        tool = "python"
    return flag(name, value, tool=tool, args=args)


def no_flag(*, tool: Tool | None = None, args: Any = None) -> str:
    """How the user turns the mixed-precision flags off (the run then keeps the loaded dtypes).

    >>> no_flag(tool="axolotl")
    'bf16: false and fp16: false'
    """
    tool = detect_tool(args) if tool is None else tool
    if tool == "accelerate":
        return "Accelerator(mixed_precision='no')"
    if tool == "kohya":
        return flag("bf16", False, tool=tool)
    return " and ".join(flag(f, False, tool=tool) for f in ("bf16", "fp16"))


def _short(dtype: torch.dtype | str) -> str:
    name = str(dtype).removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name, name)


def load_dtype(dtype: torch.dtype | str, *, tool: Tool | None = None, args: Any = None) -> str:
    """How the user loads the model in ``dtype`` with their tool (what transformers calls
    ``from_pretrained(..., dtype=...)``).

    LLaMA-Factory and axolotl load in the dtype of their precision flag; ms-swift takes
    ``--torch_dtype``; TRL's CLI ``--dtype``.
    """
    tool = detect_tool(args) if tool is None else tool
    name = _short(dtype)
    half = {"bfloat16": "bf16", "float16": "fp16"}.get(name)
    if tool in _YAML:
        return flag(half, tool=tool) if half else no_flag(tool=tool)
    if tool == "swift":
        return f"--torch_dtype {name}"
    if tool in ("cli", "trl"):
        return f"--dtype {name}"
    return f"from_pretrained(..., dtype=torch.{name})"


def quantized_compute(dtype: torch.dtype | str, *, tool: Tool | None = None) -> str:
    """How the user makes quantized layers compute in ``dtype`` with their tool.

    LLaMA-Factory and axolotl quantize with the dtype of their precision flag
    (``bf16: true``); TRL's CLI uses ``--dtype`` for ``bnb_4bit_compute_dtype``; ms-swift
    ``--torch_dtype`` (or ``--bnb_4bit_compute_dtype``); in Python it is the quantization
    config's own field.

    >>> quantized_compute("bfloat16", tool="llamafactory")
    'bf16: true'
    >>> quantized_compute(torch.bfloat16, tool="python")
    'BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.bfloat16) (or quantize in bfloat16)'
    """
    tool = detect_tool() if tool is None else tool
    name = _short(dtype)
    if tool == "python":
        return f"BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.{name}) (or quantize in {name})"
    if tool == "accelerate":
        return f"quantize in {name} (BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.{name}))"
    return load_dtype(name, tool=tool)


__all__ = [
    "ENV",
    "TOOLS",
    "Tool",
    "detect_tool",
    "flag",
    "load_dtype",
    "no_flag",
    "quantized_compute",
    "set_flag",
]
