"""Tables and JSON for every ``rdakit bench`` command: one way to print and record figures."""

import json
import math
import pathlib
import re

from rich.console import Console
from rich.table import Table

from rdakit.files import atomic_write

__all__ = ["Report"]


#: What a table key may be: a short snake_case identifier.
_KEY = re.compile(r"[a-z][a-z0-9_]*")


class Report:
    """Collects tables, prints them with rich, and writes them all as one JSON file.

    A bench builds one ``Report``, adds tables (each a list of row dicts with the same keys) and
    scalar figures, and calls :meth:`finish`. Every table has a *key*, a snake_case identifier
    that stays the same whatever the run (its printed *title* is prose and may name the run's
    sizes). The JSON holds ``{"bench": name, "figures": {...}, "tables": {key: [row, ...]},
    "titles": {key: title}}``; the keys of ``figures`` and ``tables`` are documented per bench
    in ``docs/benchmarks.md``.
    """

    def __init__(self, bench, *, console=None):
        self.bench = bench
        self.figures = {}
        self.tables = {}
        self.titles = {}
        # Wide enough for the benches' tables when the output is not a terminal.
        self.console = console or Console(width=None if Console().is_terminal else 160)

    def table(self, title, rows, *, key, columns=None, notes=None):
        """Print ``rows`` (a list of dicts) as a table titled ``title`` and keep them for the
        JSON file under ``key`` (a snake_case identifier, unique within the report)."""
        rows = self.data(key, rows)
        self.titles[key] = title
        columns = columns or (list(rows[0]) if rows else [])
        table = Table(title=title, title_justify="left", caption=notes, caption_justify="left")
        for c in columns:
            table.add_column(c, justify="right" if rows and _numeric(rows[0].get(c)) else "left")
        for r in rows:
            table.add_row(*(_fmt(r.get(c)) for c in columns))
        self.console.print(table)

    def data(self, key, rows):
        """Keep ``rows`` (a list of dicts) for the JSON file under ``key`` without printing
        them (a table too wide to print, e.g. every column of every iteration); returns the
        copy kept. ``key`` is checked as :meth:`table` checks it; such a table has no title."""
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"table key must be a snake_case identifier ([a-z][a-z0-9_]*), "
                             f"not {key!r}")
        if key in self.tables:
            raise ValueError(f"table key must be unique within the report, not {key!r} "
                             f"(already a table of the {self.bench} report)")
        rows = [dict(r) for r in rows]
        self.tables[key] = rows
        return rows

    def figure(self, key, value):
        """Record a headline figure (printed at :meth:`finish`)."""
        self.figures[key] = value

    def finish(self, json_path=None):
        """Print the headline figures and write the JSON file if asked."""
        if self.figures:
            self.table("figures", [{"figure": k, "value": v} for k, v in self.figures.items()],
                       key="figures")
        if json_path is not None:
            path = pathlib.Path(json_path)
            atomic_write(path, json.dumps({"bench": self.bench, "figures": self.figures,
                                           "tables": self.tables, "titles": self.titles},
                                          indent=2, default=_jsonable) + "\n")
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
