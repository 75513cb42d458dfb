"""``rdakit.sim.bench.report.Report``: tables are found in the JSON by a stable key, not by their
printed title (issue 17)."""

import io
import json

import pytest
from rich.console import Console

from rdakit.sim.bench.report import Report


def _report():
    out = io.StringIO()
    return Report("demo", console=Console(file=out, width=200)), out


def test_tables_are_keyed_by_identifier_and_titles_kept(tmp_path):
    report, out = _report()
    report.table("Tiles (iteration 3): utilization = busy / cycles", [{"tile": "C0", "busy": 5}],
                 key="tiles")
    report.table("Area per tile type", [{"unit": "cu", "cells": 100}], key="area",
                 notes="coarse cells")
    report.data("iterations_full", [{"iteration": 1, "tiles": [{"tile": "C0"}]}])
    report.figure("cycles", 42)
    report.finish(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert list(data) == ["bench", "figures", "tables", "titles"]
    assert data["bench"] == "demo" and data["figures"] == {"cycles": 42}
    assert list(data["tables"]) == ["tiles", "area", "iterations_full", "figures"]
    assert data["tables"]["tiles"] == [{"tile": "C0", "busy": 5}]
    assert data["tables"]["iterations_full"][0]["tiles"] == [{"tile": "C0"}]
    assert data["tables"]["figures"] == [{"figure": "cycles", "value": 42}]
    # Every printed table has its title; a table only in the JSON has none.
    assert data["titles"] == {"tiles": "Tiles (iteration 3): utilization = busy / cycles",
                              "area": "Area per tile type", "figures": "figures"}
    # The printed output shows the titles (wrapped to the table's width), not the keys.
    printed = " ".join(out.getvalue().split())
    assert "Tiles (iteration 3): utilization = busy / cycles" in printed
    assert "Area per tile type" in printed and "coarse cells" in printed
    assert "iterations_full" not in printed


@pytest.mark.parametrize("key", ["Tiles", "tiles (iteration 1)", "1st", "_tiles", "tiles-full",
                                 "", "tïles", None, 3])
def test_a_key_must_be_a_snake_case_identifier(key):
    report, out = _report()
    with pytest.raises(ValueError) as e:
        report.table("Tiles", [{"a": 1}], key=key)
    assert str(e.value) == (f"table key must be a snake_case identifier ([a-z][a-z0-9_]*), "
                            f"not {key!r}")
    assert report.tables == {} and report.titles == {} and out.getvalue() == ""


def test_a_key_is_required():
    report, _ = _report()
    with pytest.raises(TypeError, match="key"):
        report.table("Tiles", [{"a": 1}])


@pytest.mark.parametrize("first", ["table", "data"])
def test_a_key_is_used_once(first):
    report, _ = _report()
    if first == "table":
        report.table("Iterations", [{"a": 1}], key="iterations")
    else:
        report.data("iterations", [{"a": 1}])
    message = ("table key must be unique within the report, not 'iterations' (already a table "
               "of the demo report)")
    with pytest.raises(ValueError) as e:
        report.table("Iterations (again)", [{"a": 2}], key="iterations")
    assert str(e.value) == message
    with pytest.raises(ValueError) as e:
        report.data("iterations", [{"a": 2}])
    assert str(e.value) == message
    assert report.tables == {"iterations": [{"a": 1}]}

