"""What a training tool with its own loop tells the launcher about one run.

The launcher meets kohya's sd-scripts, OneTrainer and the like as a plain ``Accelerator`` (or no
accelerator at all). What it says is only useful in the tool's terms: reports where the tool's
user looks (its output folder), its batch keys known (not warned about), its precision flags as
typed (the source of an inferred policy), the flag the guard undoes named, and the tool's own
fix offered before the guard's. A tool's adapter module (one per tool in this folder) returns
one :class:`FrameworkRun`; :func:`detect` asks the adapters of the tools whose modules are
imported in this process (:data:`DETECTORS`).

>>> run = FrameworkRun("kohya", "train_network.py", output_dir="/runs/lora")
>>> run.report_dir()
'/runs/lora/precision'
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: a module that only a tool's process imports -> ``"module:function"``, the tool's adapter:
#: ``function(accelerator)`` returns a :class:`FrameworkRun`, or ``None`` when this process is
#: not that tool's run
DETECTORS: dict[str, str] = {
    "library.train_util": "hf_precision.integrations.kohya:detect",  # kohya-ss sd-scripts
}


@dataclass(frozen=True)
class FrameworkRun:
    """One run of a tool, in the tool's own words.

    Args:
        tool: how :mod:`hf_precision.rules.flags` spells its flags (``"kohya"``).
        program: what the user launched (``"train_network.py"``), for messages.
        output_dir: the tool's output folder: reports go to ``<output_dir>/precision``.
        metadata_keys: floating batch keys its loop passes that are no activations (never
            cast, not warned about: :func:`~hf_precision.register_metadata_key`).
        settings: its precision flags as typed (``{"--mixed_precision": "bf16", "--full_bf16":
            True}``): the provenance record, and the source of an inferred policy.
        undone: one sentence per flag of the tool the guard's policy undoes, naming it.
        own_fix: the tool's own fix for half-precision trainable weights, offered first.
        notes: what the tool's flags mean for precision, said with the guard line (``--fp8_base:
            UNet weights fp8 e4m3, compute bf16``) and in the event's ``provenance``.
        refusal: a run that cannot work: the one line it is refused with before anything is
            cast or trained.
    """

    tool: str
    program: str
    output_dir: str | None = None
    metadata_keys: tuple[str, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    undone: tuple[str, ...] = ()
    own_fix: str = ""
    notes: tuple[str, ...] = ()
    refusal: str | None = None

    def report_dir(self) -> str | None:
        """``<output_dir>/precision``, or ``None`` when the tool has no output folder."""
        return os.path.join(self.output_dir, "precision") if self.output_dir else None

    @property
    def said(self) -> str:
        """The flags an inferred policy follows, as typed: ``train_network.py's
        --mixed_precision bf16``, and the flags the guard undoes."""
        from ..watch.provenance import typed_words

        words = f"{self.program}'s {typed_words(self.settings)}"
        return words + "".join(f"; {u}" for u in self.undone)

    def register(self) -> None:
        """Register its batch keys and record its flags (the event's ``provenance``)."""
        from ..rules.batch_keys import register_metadata_key
        from ..watch import provenance

        for key in self.metadata_keys:
            register_metadata_key(key)
        if self.settings:
            note = "; ".join((*self.notes, *self.undone))
            provenance.record(self.program, self.settings, note, typed=True)

    def provenance(self, mixed_precision: str) -> dict[str, Any]:
        """The ``provenance`` section of the run's events (the Trainer path's record)."""
        from types import SimpleNamespace

        from ..watch.provenance import precision_provenance

        return precision_provenance(SimpleNamespace(mixed_precision=mixed_precision), None)


def detect(accelerator: Any = None) -> FrameworkRun | None:
    """The run of the first tool of :data:`DETECTORS` whose module this process imported and
    whose adapter recognises the run, or ``None``."""
    for module, entry in DETECTORS.items():
        if module not in sys.modules:
            continue
        target, _, name = entry.partition(":")
        run = getattr(importlib.import_module(target), name)(accelerator)
        if run is not None:
            return run
    return None


__all__ = ["DETECTORS", "FrameworkRun", "detect"]
