"""The one text-table renderer: ``rich`` when it is installed, plain aligned columns otherwise.

Dtype maps (:meth:`hf_precision.DtypeMap.table`), the reporter's log tables and the CLI all
print through :func:`render_table`.

>>> print(render_table(["group", "params"], [["projector", "1,024"]], right=(1,), use_rich=False))
group      params
---------  ------
projector   1,024
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence


def fmt_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for size, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def render_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    title: str = "",
    right: Iterable[int] = (),
    use_rich: bool | None = None,
    width: int = 110,
) -> str:
    """``rows`` under ``columns`` as text (``right``: indexes of right-aligned columns).
    ``use_rich``: ``None`` draws with rich when it is installed, ``True`` requires it,
    ``False`` prints plain columns."""
    rows = [list(r) for r in rows]
    right = set(right)
    if use_rich is None or use_rich:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            if use_rich:
                raise
        else:
            table = Table(title=title or None, title_justify="left")
            for i, col in enumerate(columns):
                table.add_column(col, justify="right" if i in right else "left")
            for r in rows:
                table.add_row(*r)
            console = Console(file=io.StringIO(), width=width, color_system=None)
            console.print(table)
            text = console.file.getvalue()  # type: ignore[attr-defined]
            return "\n".join(line.rstrip() for line in text.rstrip().splitlines())
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    out = [title] if title else []
    out += [line(columns), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)
