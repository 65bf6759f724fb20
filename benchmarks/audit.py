"""Audit cost on full-size models (meta device): groups + dtype map vs one bare parameter pass.

* ``audit_*`` — ``find_module_groups`` + ``dtype_map`` ÷ ``for _ in model.named_parameters()``
  on LLaVA-1.5-7B, Qwen2-VL-72B and the largest image-text-to-text config transformers ships;
* ``audit_scaling`` — audit time of LLaVA-1.5-7B ÷ the same model with a quarter of the layers
  (vision and text), which is linear when it stays near 4 (the bare pass's own ratio beside it);
* ``arch_scan`` — every ``model_type`` of ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` built from
  its default config on the meta device: build time, group rule, audit time.

>>> from benchmarks.audit import audit
>>> from benchmarks.models import build_meta, llava15_7b_config
>>> dmap = audit(build_meta(llava15_7b_config(0.25)))
>>> sorted(dmap.groups)[:2]
['language_model', 'lm_head']
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from torch import nn

from hf_precision import dtype_map, find_module_groups
from hf_precision.model.dtype_maps import DtypeMap

from .common import Figure, calibrate, interleave, param_count, ratio_figure, smoke
from .models import (
    build_meta,
    default_config,
    image_text_to_text_types,
    llava15_7b_config,
    qwen2_vl_72b_config,
)

FAMILY = "audit"
#: A handful of architectures for ``--quick`` (rule-matched and fallback layouts).
QUICK_TYPES = ("llava", "idefics2", "paligemma", "blip-2", "git")


def audit(model: nn.Module) -> DtypeMap:
    """What the guard does to look at a model: find its groups, then map every module."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scan includes models no rule recognises
        return dtype_map(model, find_module_groups(model))


def bare_pass(model: nn.Module) -> None:
    for _ in model.named_parameters():
        pass


def audit_figure(
    fid: str, title: str, model: nn.Module, reps: int, target: float = 3.0, **detail: Any
) -> Figure:
    arms = {"audit": lambda: audit(model), "bare": lambda: bare_pass(model)}
    inner = calibrate(arms)
    runs = interleave(arms, reps=reps, inner=inner)
    n_modules = sum(1 for _ in model.modules())
    return ratio_figure(
        fid,
        title,
        runs,
        "audit",
        "bare",
        target,
        inner=inner,
        params_B=round(param_count(model) / 1e9, 2),
        modules=n_modules,
        **detail,
    )


def _timed_figure(fid: str, title: str, model: nn.Module, reps: int, target: float) -> Figure:
    t0 = time.perf_counter()
    fig = audit_figure(fid, title, model, reps, target=target)
    fig.seconds = round(time.perf_counter() - t0, 1)
    return fig


def scan(
    types: list[str] | tuple[str, ...],
) -> tuple[list[dict[str, Any]], nn.Module | None, str | None]:
    """Build every type on meta and audit it; returns rows, the largest model and its type."""
    rows: list[dict[str, Any]] = []
    largest: tuple[int, nn.Module | None, str | None] = (-1, None, None)
    for mt in types:
        row: dict[str, Any] = {"model_type": mt}
        try:
            t0 = time.perf_counter()
            model = build_meta(default_config(mt))
            row["build_s"] = round(time.perf_counter() - t0, 3)
        except Exception as err:  # a default config that does not build is a row too
            first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
            row["error"] = f"{type(err).__name__}: {first[:120]}"
            rows.append(row)
            continue
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no module groups recognised" is a row, not noise
            groups = find_module_groups(model)
            dmap = dtype_map(model, groups)
        row["audit_s"] = round(time.perf_counter() - t0, 4)
        n = param_count(model)
        row.update(
            params_B=round(n / 1e9, 3),
            modules=len(dmap.records),
            rule=groups.rule,
            groups=",".join(groups.names),
        )
        rows.append(row)
        if n > largest[0]:
            largest = (n, model, mt)
        del model, dmap, groups
    return rows, largest[1], largest[2]


def run(quick: bool = False, reps: int | None = None) -> list[Figure]:
    reps = reps or (2 if quick else 25)
    figures: list[Figure] = []
    # the published models first, each built in a process that built nothing else (as a
    # training process holds its model): the scan's 87 models left behind make every later
    # figure ~30 % slower (a colder, larger heap), so the largest config, which the scan finds,
    # is timed after it against its own, looser target
    published: list[tuple[str, str, Any]] = [
        (
            "audit_llava15_7b",
            "audit ÷ bare pass, LLaVA-1.5-7B (meta)",
            lambda: build_meta(llava15_7b_config(0.25 if quick else 1.0)),
        ),
    ]
    if not quick:
        published.append(
            (
                "audit_qwen2_vl_72b",
                "audit ÷ bare pass, Qwen2-VL-72B (meta)",
                lambda: build_meta(qwen2_vl_72b_config()),
            )
        )
    for fid, title, make in published:
        figures.append(_timed_figure(fid, title, make(), reps, 2.0))
    start = time.perf_counter()
    types = list(QUICK_TYPES) if quick else image_text_to_text_types()
    rows, largest, largest_type = scan(types)
    built = [r for r in rows if "error" not in r]
    figures.append(
        Figure(
            "arch_scan",
            "image-text-to-text architectures built on meta + audited",
            len(built),
            unit="architectures",
            seconds=round(time.perf_counter() - start, 1),
            detail={
                "of": len(rows),
                "build_s_total": round(sum(r["build_s"] for r in built), 1),
                "audit_s_total": round(sum(r["audit_s"] for r in built), 2),
                "audit_s_max": max((r["audit_s"] for r in built), default=0.0),
                "fallback_rule": sum(r["rule"].startswith("fallback") for r in built),
                "rows": rows,
            },
        )
    )
    if not quick and largest is not None:
        title = f"audit ÷ bare pass, largest shipped config ({largest_type}), after the scan"
        figures.append(_timed_figure("audit_largest", title, largest, reps, 3.0))
    largest = None
    t0 = time.perf_counter()
    # x1 = 6 ViT + 8 LM layers, x4 = LLaVA-1.5-7B as published. The bare parameter pass over
    # the same two models is timed beside them: on this machine even that pass grows faster
    # than 4x from 7B to 4x7B (cache misses of a larger object graph), so it is the reference.
    base = 0.125 if quick else 0.25
    small, big = build_meta(llava15_7b_config(base)), build_meta(llava15_7b_config(4 * base))
    arms = {
        "x4": lambda: audit(big),
        "x1": lambda: audit(small),
        "bare_x4": lambda: bare_pass(big),
        "bare_x1": lambda: bare_pass(small),
    }
    runs = interleave(arms, reps=reps, inner=calibrate(arms, 0.03))
    fig = ratio_figure(
        "audit_scaling",
        "audit time, LLaVA-1.5-7B ÷ the same with ¼ of the layers",
        runs,
        "x4",
        "x1",
        4.4,
        modules_x1=sum(1 for _ in small.modules()),
        modules_x4=sum(1 for _ in big.modules()),
        bare_pass_ratio=round(runs.ratio("bare_x4", "bare_x1"), 4),
    )
    fig.seconds = round(time.perf_counter() - t0, 1)
    figures.append(fig)
    return [smoke(f) if f.unit == "ratio" else f for f in figures] if quick else figures
