"""The layer rule of docs/architecture.md, checked by import-linter on the package's sources.

The package is assembled from top-level folders (``hdl/`` is :mod:`rdakit.hdl`, ...), which
import-linter's graph builder cannot follow: it walks a top-level package's own folder. So the
test copies the sources into the shape of an installed package and runs ``lint-imports`` with
the contracts of ``pyproject.toml`` there. Imports inside functions count as imports.
"""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Top-level folders and where they sit in the package.
FOLDERS = {"hdl": "hdl", "sim": "sim", "compiler": "compiler", "boards": "boards"}


def _assemble(into):
    pkg = into / "rdakit"
    shutil.copytree(ROOT / "rdakit", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for folder, name in FOLDERS.items():
        shutil.copytree(ROOT / folder, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", into / "pyproject.toml")


def _lint_imports():
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    return str(exe) if exe.exists() else shutil.which("lint-imports")


def test_imports_follow_the_layers(tmp_path):
    exe = _lint_imports()
    if exe is None:
        pytest.fail("lint-imports not found: install the test extra (pip install -e '.[test]')")
    _assemble(tmp_path)
    run = subprocess.run([exe, "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert ", 0 broken." in run.stdout


def test_a_broken_layer_is_caught(tmp_path):
    """The check can fail: a model that imports the CLI breaks the layer contract."""
    exe = _lint_imports()
    if exe is None:
        pytest.fail("lint-imports not found: install the test extra (pip install -e '.[test]')")
    _assemble(tmp_path)
    with open(tmp_path / "rdakit" / "sim" / "models" / "mu.py", "a") as f:
        f.write("\nimport rdakit.cli  # noqa: E402,F401\n")
    run = subprocess.run([exe, "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert run.returncode != 0
    assert "rdakit.sim.models.mu -> rdakit.cli" in run.stdout


def test_old_host_driver_path_still_works():
    """Scripts written against ``rdakit.sim.host`` keep working after the move."""
    import rdakit.sim.host as old
    import rdakit.sim.runtime.host as new

    assert old.HostDriver is new.HostDriver
    assert set(old.__all__) == set(new.__all__)
