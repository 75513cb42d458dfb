"""Where rdakit keeps its build caches, and how their entries are written safely when several
runs build at once.

The cache root (:func:`cache_root`) is the user's cache folder (``platformdirs``:
``~/.cache/rdakit`` on Linux), not a folder of the checkout the package came from;
``RDAKIT_CACHE_DIR`` (or its older name ``RDAKIT_BUILD_DIR``) moves it.

An *entry* (:func:`publish`) is a folder named by its label and a digest of everything that goes
into it (sources, tool versions, options): ``<kind>/<label>-<digest>``. It is built in a fresh
temporary folder beside it and renamed into place when complete (``os.rename`` is atomic), so an
entry that exists is complete, and a build that fails or is interrupted leaves none. A second
builder of the same key waits on the entry's lock (``fcntl.flock``, released by the kernel when a
process dies) and then takes the first one's entry; a builder that got past the lock all the
same (a lock file removed under it) loses the rename to the complete entry and drops its copy.
A user of an entry holds the lock shared (:func:`use`), so that eviction, which keeps the newest
:data:`KEEP` entries of a label, never removes an entry a run is using.

Each run works in a folder of its own (:func:`run_folder`), so two runs never share a log, a
results file or a waveform.
"""

import contextlib
import errno
import fcntl
import os
import pathlib
import shutil
import tempfile
import time

import platformdirs

from rdakit.errors import UserError

__all__ = ["CACHE_ENV", "KEEP", "CacheError", "cache_root", "make_folder", "locked", "publish",
           "use", "run_folder"]

#: Environment variables that move the cache root, first found first; empty counts as unset.
CACHE_ENV = ("RDAKIT_CACHE_DIR", "RDAKIT_BUILD_DIR")

#: Entries kept per label (the newest by last use) when a new one is published.
KEEP = 2


class CacheError(UserError):
    """The cache folder cannot be created or written (a bad ``RDAKIT_CACHE_DIR``, a full or
    read-only disk)."""


def cache_root():
    """The folder of rdakit's caches and run folders: ``$RDAKIT_CACHE_DIR``, else
    ``$RDAKIT_BUILD_DIR``, else ``platformdirs.user_cache_dir("rdakit")``; always absolute
    (simulators run in other folders). Nothing is created here."""
    for var in CACHE_ENV:
        value = os.environ.get(var, "")
        if value.strip():
            return pathlib.Path(value).expanduser().absolute()
    return pathlib.Path(platformdirs.user_cache_dir("rdakit")).absolute()


def _origin():
    for var in CACHE_ENV:
        if os.environ.get(var, "").strip():
            return f" (the cache folder, from {var})"
    return " (the cache folder)"


def make_folder(path):
    """Create the folder ``path`` and its parents if missing; a :class:`CacheError` naming it
    if that fails. Returns ``path``."""
    path = pathlib.Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:          # ValueError: a NUL character
        reason = getattr(e, "strerror", None) or str(e)
        raise CacheError(f"Cannot create {path}{_origin()}: {reason}") from None
    return path


@contextlib.contextmanager
def locked(path, *, shared=False):
    """Hold ``fcntl.flock`` on the file ``path`` (created if missing), exclusive unless
    ``shared``; the kernel releases it if the process dies. A lock file may be removed by
    its holder (:func:`publish`'s eviction): a waiter that then gets the lock of the removed file
    takes the new one instead."""
    path = pathlib.Path(path)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


def _try_lock(path):
    """The file descriptor of an exclusive lock on the file ``path`` if it exists and nobody
    holds it, else None."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)
    return None


def _label_of(name):
    label, _, digest = name.rpartition("-")
    return label if digest else None


#: Seconds after which a leftover of an interrupted eviction is removed.
_STALE = 3600


def _evict(base, label, keep):
    """Remove the entries of ``label`` in ``base`` beyond the ``keep`` newest (by last use),
    skipping those in use, and what interrupted evictions left."""
    entries, now = [], time.time()
    for p in base.iterdir():
        with contextlib.suppress(FileNotFoundError):
            if p.name.startswith(".") and p.name.endswith(".old"):
                if now - p.stat().st_mtime > _STALE:
                    shutil.rmtree(p, ignore_errors=True)
            elif p.is_dir() and not p.name.startswith(".") and _label_of(p.name) == label:
                entries.append((p.stat().st_mtime, p))
    entries.sort(reverse=True)
    for _mtime, entry in entries[keep:]:
        lock = base / f"{entry.name}.lock"
        fd = _try_lock(lock)
        if fd is None:
            continue
        try:
            # Renamed out of the way first, so that the entry disappears at once and whole.
            trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".old",
                                                  dir=base))
            try:
                os.rename(entry, trash / "entry")
            except FileNotFoundError:
                pass                # another run evicted it first
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)


def publish(base, label, digest, build, *, keep=KEEP):
    """The folder of the entry ``base/<label>-<digest>``, built by ``build(folder)`` first if
    it does not exist.

    ``build`` fills a fresh empty folder; when it returns, the folder is renamed to the entry's
    name. An exception (or ``KeyboardInterrupt``) in ``build`` removes the folder and leaves no
    entry. Builders of the same entry wait for each other; builders of other entries do not.
    After a build, the entries of ``label`` beyond the ``keep`` newest are removed, except those
    in use (:func:`use`).

    Parameters
    ----------
    base : pathlib.Path
        The folder of the entries of one kind (created if missing).
    label : str
        What the entry is, for people and for eviction (``mu-virtual-icarus``).
    digest : str
        Digest of everything the entry depends on.
    build : callable
        ``build(folder)`` writes the entry into ``folder``.

    Returns
    -------
    pathlib.Path
    """
    base = make_folder(base)
    name = f"{label}-{digest}"
    final = base / name
    if final.is_dir():
        return final
    with locked(base / f"{name}.lock"):
        if final.is_dir():
            return final
        # Under the lock nobody builds this entry: folders of its name are what builders that
        # were killed (SIGKILL, power) left.
        for stale in base.glob(f".{name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=base))
        try:
            build(tmp)
            try:
                os.rename(tmp, final)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.is_dir():
                    raise
                shutil.rmtree(tmp)      # another builder's complete entry is already there
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    _evict(base, label, keep)
    return final


@contextlib.contextmanager
def use(base, label, digest, build, *, keep=KEEP):
    """:func:`publish`, then hold the entry for the ``with`` block: eviction by other runs
    waits until the block ends. Marks the entry as used now (eviction keeps the newest)."""
    name = f"{label}-{digest}"
    while True:
        final = publish(base, label, digest, build, keep=keep)
        with locked(base / f"{name}.lock", shared=True):
            if not final.is_dir():
                continue            # evicted between its publication and our lock: again
            now = time.time()
            with contextlib.suppress(OSError):
                os.utime(final, (now, now))
            yield final
            return


def run_folder(root, name):
    """A new empty folder ``root/runs/<name>-XXXXXXXX`` for one run's files (logs, results,
    waveforms): never shared with another run."""
    runs = make_folder(pathlib.Path(root) / "runs")
    try:
        return pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-", dir=runs))
    except OSError as e:
        raise CacheError(f"Cannot create a run folder in {runs}: {e.strerror or e}") from None

