"""Golden listings of the lowering: each file under ``golden/`` holds the command (its ``# RUN:``
line), and the output expected from it: what ``rdakit compile`` prints (without its ``wrote``
lines), then the listing it writes. Any change in the lowered programs shows up as a diff here.

To accept a deliberate change, run with ``RDAKIT_UPDATE_GOLDEN=1`` and review the diff.
"""

import os
import pathlib
import shlex
import subprocess
import sys

import pytest

GOLDEN = pathlib.Path(__file__).parent / "golden"
CASES = sorted(GOLDEN.glob("*.lst"))


def _split(text):
    """The RUN command's arguments and the expected output of a golden file."""
    header, expected = [], []
    for line in text.splitlines(keepends=True):
        (header if line.startswith("#") and not expected else expected).append(line)
    run = [h for h in header if h.startswith("# RUN: rdakit ")]
    assert len(run) == 1, "a golden file must have one '# RUN: rdakit ...' line"
    return shlex.split(run[0][len("# RUN: rdakit "):]), header, "".join(expected)


def _run(args, tmp_path):
    listing = tmp_path / "listing.lst"
    proc = subprocess.run([sys.executable, "-m", "rdakit", *args, "--listing", str(listing)],
                          capture_output=True, text=True, check=True)
    printed = [line for line in proc.stdout.splitlines(keepends=True)
               if not line.startswith("wrote ")]
    return "".join(printed) + listing.read_text()


def test_golden_files_exist():
    assert CASES, f"no golden listings under {GOLDEN}"


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_lowered_listing_matches_golden(path, tmp_path):
    args, header, expected = _split(path.read_text())
    got = _run(args, tmp_path)
    if os.environ.get("RDAKIT_UPDATE_GOLDEN"):
        path.write_text("".join(header) + got)
        return
    assert got == expected, f"the lowering of {path.name} changed; see its RUN line"
