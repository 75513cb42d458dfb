"""Writing a user's files whole or not at all: a temporary file in the same folder, then a rename.

Every command that writes a file the user named (bitstream, listing, Verilog, report and bench
JSON, plots, waveforms) writes it through :func:`atomic_write` or :func:`atomic_path`, so an
interrupted run leaves either the old file or the new one, never half of one. The temporary file
sits in the target's folder (a rename within one file system is atomic), is named after the
target with a random part (``.moe.3f2a9c1e.tmp.png``: hidden, and with the target's suffix so
that a writer choosing the format by the suffix, as matplotlib does, chooses the same), and is
removed when the writing fails. A missing folder is created, as the command-line checks allow
(:mod:`rdakit.cli.outputs`).

This module imports only the standard library: every layer may use it.
"""

import contextlib
import os
import pathlib
import secrets

__all__ = ["atomic_write", "atomic_path"]


def _temporary(path):
    return path.with_name(f".{path.stem}.{secrets.token_hex(4)}.tmp{path.suffix}")


@contextlib.contextmanager
def atomic_path(path):
    """A temporary path beside ``path`` to write to; renamed to ``path`` when the block ends
    without an exception, removed otherwise.

    For writers that take a file name (``savefig``, ``copyfile``, a waveform dump). The
    temporary file is not created in advance.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write(path, data):
    """Write ``data`` (``str``, UTF-8, or ``bytes``) to ``path`` through a temporary file and a
    rename. The new file gets the permissions of any new file (``0o666`` less the umask)."""
    if isinstance(data, str):
        data = data.encode()
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
