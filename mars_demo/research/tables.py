"""The one fixed-width text table the commands print (``eval``, ``bench``, ``validate``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Column = tuple[str, str, str]  # (key, header, format), e.g. ("tau", "tau", "{:.2f}")


def cell(value, fmt: str) -> str:
    """One value through its format; "-" for None (a figure that does not apply)."""
    return "-" if value is None else fmt.format(value)


def text_table(rows: Sequence[Mapping], columns: Sequence[Column], *, left: int = 0) -> str:
    """Rows as a header, a rule and one line each; the first ``left`` columns left-aligned, the rest right-aligned."""
    lines = [[header for _, header, _ in columns]]
    lines += [[cell(row.get(key), fmt) for key, _, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    text = [
        "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
        for line in lines
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)
