"""The dtype map drawn: a picture (bytes per dtype, stacked, one bar per group). Text tables
are :mod:`hf_precision.tables`' (:meth:`hf_precision.DtypeMap.table`).

matplotlib is imported lazily and drawn on an Agg canvas owned by the figure (no ``pyplot``, no
global backend switch), so it works in notebooks, on headless servers and inside ``Trainer``.

>>> from hf_precision import dtype_map
>>> from hf_precision.plot import PICTURE_SIZE, plot_group_bytes
>>> from hf_precision.tiny import tiny_llava
>>> png = plot_group_bytes(dtype_map(tiny_llava()), title="tiny llava")
>>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
True
"""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .dtype_maps import DtypeMap

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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
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
