"""hf-precision benchmarks: what the guard costs, measured as ratios side by side.

``python -m benchmarks`` (or ``make bench``) runs every CPU figure family, prints a table and
writes ``benchmarks/results.json``; ``benchmarks/RESULTS.md`` records the latest figures, the
machine and the command. One module per family:

* :mod:`benchmarks.step_overhead` — training step with guards ÷ without (CPU, ~100M LLaVA);
* :mod:`benchmarks.audit` — groups + dtype map ÷ a bare parameter pass on full-size meta models,
  linear scaling in depth, and every image-text-to-text architecture transformers ships;
* :mod:`benchmarks.enforce_cost` — ``enforce_policy`` ÷ a raw ``.to(dtype)`` loop; peak memory;
* :mod:`benchmarks.batch_cost` — ``PrecisionCollator`` ÷ the collator it wraps;
* :mod:`benchmarks.gpu` — bf16 LoRA step with guards ÷ without on a ~1B VLM (``--gpu``).

Each family module has ``run(quick: bool = False, reps: int | None = None) -> list[Figure]``.
"""

from __future__ import annotations

from .common import Figure, Runs, interleave, ratio_figure

__all__ = ["Figure", "Runs", "interleave", "ratio_figure"]
