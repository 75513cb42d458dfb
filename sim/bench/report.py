"""Tables and JSON for every ``rdakit bench`` command: one way to print and record figures."""

import json
import math
import pathlib

from rich.console import Console
from rich.table import Table

__all__ = ["Report"]


class Report:
    """Collects titled tables, prints them with rich, and writes them all as one JSON file.

    A bench builds one ``Report``, adds tables (each a list of row dicts with the same keys) and
    scalar figures, and calls :meth:`finish`. The JSON holds ``{"bench": name, "figures":
    {...}, "tables": {title: [row, ...]}}``; the keys of ``figures`` are documented per bench in
    ``docs/benchmarks.md``.
    """

    def __init__(self, bench, *, console=None):
        self.bench = bench
        self.figures = {}
        self.tables = {}
        # Wide enough for the benches' tables when the output is not a terminal.
        self.console = console or Console(width=None if Console().is_terminal else 160)

    def table(self, title, rows, *, columns=None, notes=None):
        """Print ``rows`` (a list of dicts) as a table and keep them for the JSON file."""
        rows = [dict(r) for r in rows]
        self.tables[title] = rows
        columns = columns or (list(rows[0]) if rows else [])
        table = Table(title=title, title_justify="left", caption=notes, caption_justify="left")
        for c in columns:
            table.add_column(c, justify="right" if rows and _numeric(rows[0].get(c)) else "left")
        for r in rows:
            table.add_row(*(_fmt(r.get(c)) for c in columns))
        self.console.print(table)

    def figure(self, key, value):
        """Record a headline figure (printed at :meth:`finish`)."""
        self.figures[key] = value

    def finish(self, json_path=None):
        """Print the headline figures and write the JSON file if asked."""
        if self.figures:
            self.table("figures", [{"figure": k, "value": v} for k, v in self.figures.items()])
        if json_path is not None:
            path = pathlib.Path(json_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"bench": self.bench, "figures": self.figures,
                                        "tables": self.tables}, indent=2, default=_jsonable)
                            + "\n")
            self.console.print(f"wrote {path}")


def _numeric(v):
    return isinstance(v, int | float) and not isinstance(v, bool)


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
    return str(v)


def _jsonable(v):
    if hasattr(v, "item"):
        return v.item()
    if hasattr(v, "value"):
        return v.value
    return str(v)
