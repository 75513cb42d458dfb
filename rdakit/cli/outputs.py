"""The files a command writes, checked before it does any work.

A command declares each option that names a file it writes with :func:`add_output` and each
that names a file it reads with :func:`add_input`; ``rdakit.cli.main`` calls
:func:`check_outputs` after the option checks and before the command runs. An output path is
refused (a :class:`~rdakit.errors.UserError`, exit 2, nothing written) when:

- it is empty, ends in a ``/`` or is an existing folder (an option that names a folder, such as
  ``--build-dir``, is refused when it is an existing file instead);
- it exists and is not a regular file (``/dev/null``, a pipe: the atomic rename would replace
  it), or is read-only;
- its suffix is not what the option writes (``--plot`` and ``--profile`` want an image format
  matplotlib writes, ``.png`` first; ``--waves`` wants ``.vcd``, or ``.fst`` with Verilator);
- its folder cannot be made or written: a missing folder is created when the file is written,
  by every command alike, unless the nearest existing folder above it is the file system's root
  (a new top-level folder is refused) or is not writable, or a file stands in its way;
- it is the same file as an input of the command (``rdakit compile g.py -o g.py``) or as
  another output (``-o x --listing x``), compared by resolved path and by
  :func:`os.path.samefile`.

The command then writes each file with :func:`rdakit.files.atomic_write` or
:func:`rdakit.files.atomic_path` (a temporary file in the same folder, then a rename).
"""

import dataclasses
import os
import pathlib
import tempfile

from rdakit.errors import UserError

__all__ = ["Output", "add_output", "add_input", "check_outputs", "image_suffixes"]


@dataclasses.dataclass(frozen=True)
class Output:
    """An option that names a file (or, with ``folder``, a folder) the command writes.

    Members
    -------
    option : str
        The option as the user types it (``--plot``).
    dest : str
        Its attribute in the parsed arguments.
    suffixes : callable or None
        ``suffixes(args)`` -> ``(what, tuple of suffixes)`` the path must end in, or ``None``
        for any name.
    dash : bool
        Whether ``-`` means standard output.
    folder : bool
        Whether the option names a folder the command fills.
    """

    option: str
    dest: str
    suffixes: object = None
    dash: bool = False
    folder: bool = False


def _register(parser, key, item):
    parser.set_defaults(**{key: (*(parser.get_default(key) or ()), item)})


def add_output(parser, *flags, suffixes=None, dash=False, folder=False, **kwargs):
    """``parser.add_argument(*flags, **kwargs)`` for an option naming a file the command
    writes, checked by :func:`check_outputs` before any work."""
    action = parser.add_argument(*flags, **kwargs)
    option = max(flags, key=len)
    _register(parser, "outputs", Output(option, action.dest, suffixes, dash, folder))
    return action


def add_input(parser, dest, option):
    """Declare that the argument ``dest`` (shown as ``option``) may name a file the command
    reads: no output may be that file."""
    _register(parser, "inputs", (option, dest))


def image_suffixes(args=None):
    """The image formats matplotlib writes (``.png`` first), for ``--plot``-like options."""
    from matplotlib.backend_bases import FigureCanvasBase  # deferred: slow, only for plots

    kinds = sorted(FigureCanvasBase.get_supported_filetypes(), key=lambda k: k != "png")
    return "an image", tuple(f".{k}" for k in kinds)


def _same(a, b):
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_folder(spec, text, folder):
    """Refuse a folder that cannot be made or written (``folder`` is where the output goes)."""
    folder = pathlib.Path(os.path.abspath(folder))
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{spec.option} {text!r}: {existing} is a file, not a folder")
    if existing != folder and existing.parent == existing:
        missing = folder.relative_to(existing).parts[0]
        raise UserError(f"{spec.option} {text!r}: the folder {existing / missing} does not "
                        f"exist, and rdakit does not make folders at the top of the file "
                        f"system; make it first")
    try:                      # a file made and removed: what the writer will need
        with tempfile.TemporaryFile(dir=existing, prefix=".rdakit-check-"):
            pass
    except OSError as e:
        raise UserError(f"{spec.option} {text!r}: cannot write in {existing} "
                        f"({e.strerror})") from None


def _check_one(spec, text, args):
    if text == "":
        raise UserError(f"{spec.option} needs a file name, not ''")
    path = pathlib.Path(text)
    if spec.folder:
        if path.exists() and not path.is_dir():
            raise UserError(f"{spec.option} {text!r} is a file, not a folder")
        _check_folder(spec, text, path if path.exists() else path.parent)
        return
    if text.endswith(("/", os.sep)) or path.is_dir():
        raise UserError(f"{spec.option} {text!r} is a folder; name a file in it")
    if path.exists() or path.is_symlink():
        if not path.exists():
            raise UserError(f"{spec.option} {text!r} is a broken symbolic link")
        if not path.is_file():
            raise UserError(f"{spec.option} {text!r} is not a regular file (rdakit replaces "
                            f"the file it writes)")
        if not os.access(path, os.W_OK):
            raise UserError(f"{spec.option} {text!r} is read-only")
    if spec.suffixes is not None:
        what, suffixes = spec.suffixes(args)
        if path.suffix.lower() not in suffixes:
            raise UserError(f"{spec.option} must name {what} file ending in "
                            f"{', '.join(suffixes)}, not {text!r}")
    _check_folder(spec, text, pathlib.Path(os.path.realpath(path)).parent)


def check_outputs(args):
    """Check every output path of the command (:func:`add_output`) against the rules of this
    module; a UserError naming the option if one is refused."""
    inputs = [(option, getattr(args, dest)) for option, dest in getattr(args, "inputs", ())
              if isinstance(getattr(args, dest, None), str)
              and os.path.isfile(getattr(args, dest))]
    seen = []
    for spec in getattr(args, "outputs", ()):
        text = getattr(args, spec.dest, None)
        if not isinstance(text, str) or (spec.dash and text == "-"):
            continue                            # not given, a flag (--profile), or stdout
        _check_one(spec, text, args)
        for option, path in inputs:
            if _same(text, path):
                raise UserError(f"{spec.option} {text!r} is the input {option} {path!r}: "
                                f"writing it would destroy it")
        for option, other in seen:
            if _same(text, other):
                raise UserError(f"{option} and {spec.option} name the same file {text!r}")
        seen.append((spec.option, text))
