"""The dtype map drawn. Two pictures:

* :func:`plot_precision` — the report's picture, the one that answers "is my precision right?":
  one row per group and role (frozen / trainable weights), each a bar of the dtypes its
  parameters are in now (a thin bar above it: before this event's casts), with the policy's
  target and a verdict (``✓`` or how many tensors are still off) on the right;
  :func:`picture_rows` gives its numbers;
* :func:`plot_group_bytes` — bytes per dtype, stacked, one bar per group ("how big is each
  group").

A watcher's finding draws itself (:func:`plot_finding`: one bar per group of its numbers), and
the activation dtype trace its strip (:func:`plot_trace`).

Text tables are :mod:`hf_precision.base.tables`' (:meth:`hf_precision.DtypeMap.table`).

matplotlib is imported lazily and drawn on an Agg canvas owned by the figure (no ``pyplot``, no
global backend switch), so it works in notebooks, on headless servers and inside ``Trainer``.

>>> from hf_precision import PrecisionPolicy, dtype_map, enforce_policy
>>> from hf_precision.report.plot import PICTURE_SIZE, picture_rows
>>> from hf_precision.report.plot import plot_group_bytes, plot_precision
>>> from hf_precision.tiny import tiny_llava
>>> model = tiny_llava()
>>> _ = model.model.vision_tower.requires_grad_(False)
>>> policy = PrecisionPolicy.from_preset("bf16")
>>> report = enforce_policy(model, policy)  # frozen tower to bf16, the rest stays fp32
>>> rows = picture_rows(dtype_map(model), policy=policy, report=report)
>>> [(r.group, r.role, r.target, r.verdict) for r in rows][:2]
[('vision_encoder', 'frozen', 'bfloat16', '✓'), ('projector', 'trainable', 'float32', '✓')]
>>> rows[0].casts, dict(rows[0].before) == {"float32": rows[0].numel}
((('float32', 'bfloat16', 39),), True)
>>> png = plot_precision(rows, title="tiny llava")
>>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n", png_size(png) == PICTURE_SIZE
(True, True)
>>> plot_group_bytes(dtype_map(tiny_llava()), title="tiny llava")[:4] == b"\\x89PNG"
True
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..model.dtype_maps import DtypeMap

#: Width and height of the picture in pixels (8 x 4.5 inches at 100 dpi).
PICTURE_SIZE: tuple[int, int] = (800, 450)
_DPI = 100
#: Fixed colours so the same dtype looks the same in every picture of a run.
DTYPE_COLORS: dict[str, str] = {
    "float32": "#4c72b0",
    "bfloat16": "#dd8452",
    "float16": "#55a868",
    "float64": "#8172b3",
    "int8": "#c44e52",
    "uint8": "#937860",
    "float8_e4m3fn": "#da8bc3",
    "float8_e5m2": "#8c8c8c",
}
_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


def _unit(max_bytes: int) -> tuple[int, str]:
    for size, name in _UNITS:
        if max_bytes >= size:
            return size, name
    return 1, "B"


def group_bytes(dmap: DtypeMap) -> tuple[list[str], list[str], dict[str, list[int]]]:
    """``(groups, dtypes, dtype -> bytes per group)``: the numbers behind the picture."""
    groups = list(dmap.groups)
    dtypes = sorted({d for g in dmap.groups.values() for d in g.bytes})
    table = {d: [dmap.groups[g].bytes.get(d, 0) for g in groups] for d in dtypes}
    return groups, dtypes, table


# ---------------------------------------------------------------------------- the report's picture
ROLES = ("frozen", "trainable")
#: A dtype that holds less than this share of a row is still drawn this wide (its exact count
#: is in the row's text and the JSON), so a handful of fp32 norms in a bf16 tower stays visible.
MIN_SHARE = 0.025
_OK, _BAD, _TEXT = "#2a7d2a", "#c0392b", "#333333"


@dataclass(frozen=True)
class PictureRow:
    """One bar of :func:`plot_precision`: the parameters of one group in one role."""

    group: str
    role: str  # "frozen" | "trainable"
    now: tuple[tuple[str, int], ...]  # (dtype, numel) now, largest first
    #: (dtype, numel) before this event's casts; ``None`` when nothing in the row was cast
    before: tuple[tuple[str, int], ...] | None = None
    #: what the policy wants for the row (``None`` without a policy)
    target: str | None = None
    #: (before dtype, after dtype, tensors) cast at this event
    casts: tuple[tuple[str, str, int], ...] = ()
    open: int = 0  # tensors of the row still off the policy after this event (from a report)
    kept_fp32: int = 0  # numel the policy keeps in float32 (keep_fp32 patterns, the model's own)
    #: without a report: parameters in a floating dtype the policy does not want for the row
    off_params: int = 0

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.now)

    @property
    def verdict(self) -> str:
        """``"✓"`` when nothing is off the policy; ``"✗ N tensor(s) off"`` (from a report) or
        ``"✗ N params off"`` (read from the map) otherwise; ``""`` without a policy."""
        if self.open:
            return f"✗ {self.open} tensor(s) off"
        if self.off_params:
            return f"✗ {_count(self.off_params)} params off"
        return "✓" if self.target is not None else ""


def _role_numel(dmap: DtypeMap, group: str) -> dict[str, dict[str, int]]:
    g = dmap.groups[group]
    trainable = dict(g.trainable_numel)
    if not trainable and g.trainable:  # a map read from an older JSON: no per-dtype split
        trainable = {g.dtypes[0]: g.trainable} if len(g.dtypes) == 1 else {}
    frozen = {d: n - trainable.get(d, 0) for d, n in g.numel.items()}
    return {
        "frozen": {d: n for d, n in frozen.items() if n > 0},
        "trainable": {d: n for d, n in trainable.items() if n > 0},
    }


def _off_params(policy: Any, group: str, role: str, now: dict[str, int], kept: int) -> int:
    """Parameters of a row in a floating dtype the policy does not want there (read from the
    map alone: quantized formats and fp8 storage are left to their library)."""
    from ..rules.dtypes import dtype_name

    want = dtype_name(policy.group_dtype(group))
    if role == "trainable" and policy.trainable_dtype is not None:
        want = dtype_name(policy.trainable_dtype)
    ok = {want, "float32"} if role == "trainable" and policy.keep_trainable_fp32 else {want}
    off = 0
    for d, n in now.items():
        if d in ok or ":" in d or d.startswith("float8") or not d.startswith(("float", "bfloat")):
            continue
        off += max(n - kept, 0) if d == "float32" else n
    return off


def _target(policy: Any, group: str, role: str, kept: int) -> str | None:
    if policy is None:
        return None
    from ..rules.dtypes import dtype_name

    frozen = policy.group_dtype(group)
    if role == "trainable":
        dt = dtype_name(policy.trainable_dtype or frozen)
        if policy.keep_trainable_fp32 and dt != "float32":
            dt += " (float32 kept)"
    else:
        dt = dtype_name(frozen)
    if kept and not dt.startswith("float32"):
        dt += f" + {_count(kept)} float32 kept"
    return dt


def _count(n: int) -> str:
    for size, unit in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def picture_rows(
    dmap: DtypeMap,
    *,
    policy: Any = None,
    report: Any = None,
    trainable_names: Iterable[str] = (),
    checked: bool = False,
) -> list[PictureRow]:
    """The numbers behind :func:`plot_precision`: per group, its frozen and its trainable parameters
    (rows without parameters are left out) — the dtypes now, before the casts of ``report`` (an
    applied :class:`~hf_precision.engine.records.EnforceReport`), the policy's target, and how many
    tensors are still off it (the changes of a report that was not applied, and what a wrapper
    cast). ``trainable_names``: the trainable parameters, to place those off-policy tensors the
    report does not hold (a wrapper's). Without a report, the map is read against the policy
    (:attr:`PictureRow.off_params`), unless ``checked``: the caller's audit found nothing off (the
    guard logs clean events without a report; a wrapper such as DeepSpeed may then hold trainable
    weights in its own dtype, which the map alone cannot tell)."""
    applied = bool(getattr(report, "applied", False))
    # the plan behind the report's changes only (a wrapper's report keeps its audit's plan but
    # lists only what it may not hold)
    listed = {id(c) for c in getattr(report, "changes", None) or ()}
    planned = [c for c in getattr(report, "planned", None) or () if id(c.change) in listed]
    trainable_set = set(trainable_names)
    # what this event cast, per (group, role): dtype moves of numel and tensors
    moved: dict[tuple[str, str], dict[tuple[str, str], list[int]]] = {}
    off: dict[tuple[str, str], int] = {}
    held = {id(c.change) for c in planned}
    for c in planned:
        ch = c.change
        if ch.kind != "param" or ch.before == ch.after:
            continue
        role = "trainable" if c.tensor.requires_grad else "frozen"
        if applied:
            cell = moved.setdefault((ch.group, role), {}).setdefault((ch.before, ch.after), [0, 0])
            cell[0] += c.tensor.numel()
            cell[1] += 1
        else:
            off[ch.group, role] = off.get((ch.group, role), 0) + 1
    unplanned = [c for c in getattr(report, "changes", None) or () if id(c) not in held]
    unplanned = [] if applied else unplanned
    for ch in [*unplanned, *(getattr(report, "wrapper_casts", None) or ())]:
        role = "trainable" if ch.name in trainable_set else "frozen"
        off[ch.group, role] = off.get((ch.group, role), 0) + 1
    kept: dict[tuple[str, str], int] = {}
    if policy is not None:
        for rec in dmap.records.values():
            if rec.kept_fp32:
                total = sum(rec.params.values())
                kept[rec.group, "trainable"] = kept.get((rec.group, "trainable"), 0) + rec.trainable
                kept[rec.group, "frozen"] = kept.get((rec.group, "frozen"), 0) + max(
                    total - rec.trainable, 0
                )
    rows = []
    for group in dmap.groups:
        for role, now in _role_numel(dmap, group).items():
            if not now:
                continue
            key = (group, role)
            casts = moved.get(key, {})
            before = None
            if casts:
                was = dict(now)
                for (src, dst), (numel, _) in casts.items():
                    was[dst] = was.get(dst, 0) - numel
                    was[src] = was.get(src, 0) + numel
                before = tuple(sorted(((d, n) for d, n in was.items() if n > 0), key=_largest))
            rows.append(
                PictureRow(
                    group=group,
                    role=role,
                    now=tuple(sorted(now.items(), key=_largest)),
                    before=before,
                    target=_target(policy, group, role, kept.get(key, 0)),
                    casts=tuple((src, dst, t) for (src, dst), (_, t) in sorted(casts.items())),
                    open=off.get(key, 0),
                    kept_fp32=kept.get(key, 0),
                    off_params=(
                        _off_params(policy, group, role, now, kept.get(key, 0))
                        if policy is not None and report is None and not checked
                        else 0
                    ),
                )
            )
    return rows


def _largest(item: tuple[str, int]) -> tuple[int, str]:
    return (-item[1], item[0])


def _shares(parts: tuple[tuple[str, int], ...]) -> list[tuple[str, float]]:
    """Each dtype's share of the bar, at least :data:`MIN_SHARE` wide, summing to 1."""
    total = sum(n for _, n in parts) or 1
    raw = [(d, max(n / total, MIN_SHARE)) for d, n in parts]
    scale = sum(w for _, w in raw)
    return [(d, w / scale) for d, w in raw]


def _color(dtype: str, k: int) -> str:
    return DTYPE_COLORS.get(dtype) or DTYPE_COLORS.get(dtype.rsplit("->", 1)[-1], f"C{k % 10}")


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(
        dtype, dtype
    )


def plot_precision(
    rows: list[PictureRow],
    path: str | os.PathLike[str] | None = None,
    *,
    title: str = "",
    subtitle: str = "",
    size: tuple[int, int] = PICTURE_SIZE,
) -> bytes:
    """Draw :func:`picture_rows` as PNG bytes (also written to ``path`` when given).

    One row per group and role: a bar of the dtypes its parameters are in (each dtype's share,
    small ones drawn at least :data:`MIN_SHARE` wide and named inside when there is room); a
    thin bar above it when this event cast some of them (before the casts); on the right the
    policy's target with ``✓`` (green) or the count of tensors still off it (red), the
    parameter count and the casts. The PNG is exactly ``size`` pixels; everything is drawn
    inside it, whatever the number of rows or the length of the names. The same arguments
    give the same bytes.
    """
    fig = precision_figure(rows, title=title, subtitle=subtitle, size=size)
    return _png(fig, path)


def precision_figure(
    rows: list[PictureRow],
    *,
    title: str = "",
    subtitle: str = "",
    size: tuple[int, int] = PICTURE_SIZE,
) -> Any:
    """The matplotlib ``Figure`` :func:`plot_precision` saves (on its own Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(size[0] / _DPI, size[1] / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    n = max(len(rows), 1)
    font = 8.0 if n <= 10 else max(5.0, 8.0 * 10 / n)
    fig.text(0.01, 0.975, title, fontsize=10, weight="bold", va="top", ha="left")
    if subtitle:
        fig.text(0.01, 0.925, subtitle, fontsize=8, va="top", ha="left", color=_TEXT)
    ax = fig.add_axes((0.2, 0.14, 0.44, 0.72))
    ax.set_xlim(0, 1)
    ax.set_ylim(n - 0.5, -0.6)
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    dtypes: dict[str, str] = {}
    for i, row in enumerate(rows):
        for parts, y, h, alpha in (
            (row.before, i - 0.36, 0.16, 0.55),
            (row.now, i + 0.08, 0.5, 1.0),
        ):
            if not parts:
                continue
            left = 0.0
            for d, w in _shares(parts):
                color = dtypes.setdefault(d, _color(d, len(dtypes)))
                ax.barh(y, w, left=left, height=h, color=color, alpha=alpha, edgecolor="white")
                if h > 0.3 and w >= 0.14:
                    share = dict(parts)[d] / max(sum(p for _, p in parts), 1)
                    label = f"{_short(d)} {share:.0%}" if share < 0.995 else _short(d)
                    ax.text(
                        left + w / 2,
                        y,
                        label,
                        ha="center",
                        va="center",
                        color="white",
                        fontsize=font,
                        weight="bold",
                        clip_on=True,
                    )
                left += w
            if h < 0.3:  # the thin bar: say what it is, inside it
                was = ", ".join(_short(d) for d, _ in parts[:3])
                ax.text(
                    0.006,
                    y,
                    f"before: {was}",
                    ha="left",
                    va="center",
                    fontsize=font - 2,
                    color="#222222",
                    clip_on=True,
                )
        trans = ax.get_yaxis_transform()
        verdict = row.verdict
        head = f"target {row.target}" if row.target is not None else "(no policy)"
        ax.text(
            1.03,
            i - 0.12,
            f"{head}  {verdict}".rstrip(),
            transform=trans,
            fontsize=font,
            va="center",
            ha="left",
            color=_BAD if verdict.startswith("✗") else _OK if verdict else _TEXT,
            weight="bold",
            clip_on=False,
        )
        detail = f"{_count(row.numel)} params"
        if row.casts:
            detail += "; cast " + ", ".join(
                f"{t} {_short(a)}→{_short(b)}" for a, b, t in row.casts[:2]
            )
        ax.text(
            1.03,
            i + 0.24,
            detail,
            transform=trans,
            fontsize=font - 1,
            va="center",
            ha="left",
            color=_TEXT,
            clip_on=False,
        )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r.group}\n{r.role}" for r in rows], fontsize=font)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("share of the row's parameters, by dtype", fontsize=7, color=_TEXT)
    if not rows:
        ax.text(0.5, 0, "no parameters", ha="center", va="center", fontsize=9)
    if any(r.target is not None for r in rows):
        off = sum(r.open for r in rows)
        off_params = sum(r.off_params for r in rows)
        fig.text(
            0.99,
            0.975,
            f"✗ {off} tensor(s) off the policy"
            if off
            else f"✗ {_count(off_params)} params off the policy"
            if off_params
            else "✓ matches the policy",
            fontsize=10,
            weight="bold",
            va="top",
            ha="right",
            color=_BAD if off or off_params else _OK,
        )
    handles = [Patch(color=c, label=d) for d, c in dtypes.items()]
    if any(r.before for r in rows):
        handles.append(
            Patch(color="#bbbbbb", alpha=0.55, label="thin bar: before this event's casts")
        )
    if handles:
        fig.legend(
            handles=handles,
            loc="lower left",
            bbox_to_anchor=(0.01, 0.0),
            ncol=min(len(handles), 5),
            fontsize=7,
            frameon=False,
            handlelength=1.2,
            columnspacing=1.0,
        )
    return fig


# ---------------------------------------------------------------------------- bytes per group
def plot_group_bytes(
    dmap: DtypeMap,
    path: str | os.PathLike[str] | None = None,
    *,
    title: str = "",
    size: tuple[int, int] = PICTURE_SIZE,
) -> bytes:
    """Render the stacked bars as PNG bytes (also written to ``path`` when given).

    The PNG is exactly ``size`` pixels (no tight bounding box, so every event's picture lines up).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups, dtypes, table = group_bytes(dmap)
    fig = Figure(figsize=(size[0] / _DPI, size[1] / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    totals = [sum(table[d][i] for d in dtypes) for i in range(len(groups))]
    scale, unit = _unit(max(totals, default=0))
    bottom = [0.0] * len(groups)
    for k, dt in enumerate(dtypes):
        values = [b / scale for b in table[dt]]
        color = DTYPE_COLORS.get(dt, f"C{k % 10}")
        ax.bar(groups, values, bottom=bottom, label=dt, color=color, edgecolor="white")
        bottom = [a + b for a, b in zip(bottom, values)]
    for i, total in enumerate(totals):
        ax.annotate(
            f"{total / scale:.3g}", (i, total / scale), ha="center", va="bottom", fontsize=8
        )
    ax.set_ylabel(f"{unit} (parameters + buffers)")
    ax.set_title(title or f"bytes per dtype per group ({dmap.model_type or 'model'})", fontsize=10)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    if dtypes:
        ax.legend(title="dtype", fontsize=8, title_fontsize=8, loc="upper right")
    ax.margins(y=0.12)
    fig.subplots_adjust(left=0.1, right=0.97, top=0.9, bottom=0.2)
    return _png(fig, path)


def plot_trace(
    trace: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    title: str = "",
    size: tuple[int, int] = PICTURE_SIZE,
) -> bytes:
    """The activation dtype trace (:class:`hf_precision.watch.trace.TraceResult`) as PNG bytes: a
    strip of modules in execution order (leaf modules and the modules that change the
    stream), each cell coloured by the dtype of its output, the first change marked by a red
    line and named with what did it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    changed = {c.index for c in trace.changes}
    shown = [r for r in trace.records if r.outputs and (r.leaf or r.index in changed)]
    fig = Figure(figsize=(size[0] / _DPI, size[1] / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    dtypes = list(dict.fromkeys(r.outputs[0] for r in shown))
    for x, r in enumerate(shown):
        ax.bar(x, 1, width=1.0, color=_color(r.outputs[0], dtypes.index(r.outputs[0])))
    first = trace.first_change
    if first is not None:
        x = next(i for i, r in enumerate(shown) if r.index == first.index)
        ax.axvline(x - 0.5, color="#d62728", linewidth=2)
        ax.annotate(
            f"{first.module}: {first.before} -> {first.after}\n{first.cause}: {first.detail}",
            (x, 1.02),
            xycoords=("data", "axes fraction"),
            ha="left" if x < len(shown) / 2 else "right",
            va="bottom",
            fontsize=8,
            color="#d62728",
        )
    for k, dt in enumerate(dtypes):
        ax.bar(0, 0, color=_color(dt, k), label=dt)
    ax.set_xlim(-0.5, max(len(shown), 1) - 0.5)
    ax.set_yticks([])
    ax.set_xlabel(f"{len(shown)} modules in execution order (colour: output dtype)", fontsize=8)
    ax.set_title(title or "activation dtype trace", fontsize=10, pad=28)
    if dtypes:
        ax.legend(title="output dtype", fontsize=8, title_fontsize=8, loc="lower right")
    fig.subplots_adjust(left=0.05, right=0.97, top=0.8, bottom=0.15)
    return _png(fig, path)


def plot_finding(
    finding: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    title: str = "",
    size: tuple[int, int] = PICTURE_SIZE,
) -> bytes:
    """A watcher's finding (:class:`hf_precision.watch.finding.Finding`) as PNG bytes: one
    horizontal bar per group of its ``groups`` numbers (the unchanged share of updates per
    group, ...), coloured by the finding's severity, its message wrapped underneath. This is
    the picture of a finding's event, not the dtype map."""
    import textwrap

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    color = {"info": "#4c72b0", "warning": "#dd8452", "error": "#c44e52"}[finding.severity]
    names = list(finding.groups)
    values = [float(finding.groups[g]) for g in names]
    fig = Figure(figsize=(size[0] / _DPI, size[1] / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.25, 0.38, 0.68, 0.5))
    ax.barh(names[::-1], values[::-1], color=color)
    share = bool(values) and all(0.0 <= v <= 1.0 for v in values)
    for y, v in enumerate(values[::-1]):
        ax.annotate(f"{v:.0%}" if share else f"{v:.3g}", (v, y), va="center", fontsize=8)
    if share:
        ax.set_xlim(0, 1.1)
    ax.set_xlabel(finding.measure or "value", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.set_title(title or f"{finding.source} ({finding.severity})", fontsize=10)
    words = "\n".join(textwrap.wrap(finding.message, 130)[:6])
    fig.text(0.02, 0.02, words, fontsize=7, va="bottom", ha="left", wrap=False)
    return _png(fig, path)


def _png(fig: Any, path: Any) -> bytes:
    """The figure's PNG bytes (no software tag: the same figure gives the same bytes), also
    written to ``path`` when given."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    png = buf.getvalue()
    if path is not None:
        with open(path, "wb") as fh:
            fh.write(png)
    return png


def png_size(png: bytes) -> tuple[int, int]:
    """``(width, height)`` read from a PNG header (raises ``ValueError`` if it is not a PNG)."""
    if png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
