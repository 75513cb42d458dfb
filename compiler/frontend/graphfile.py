"""Writing an IR graph as a graph file a user can read, edit and compile.

:func:`graph_source` renders a :class:`~rdakit.compiler.graph.DataflowGraph` as a Python file
that :func:`~rdakit.compiler.workloads.load_graph` (``rdakit compile graph.py``) accepts: a
``build()`` that adds every op in the graph's order, with its name, kind, inputs and
attributes. Constants of at most :data:`INLINE_ELEMENTS` elements are written inline; larger
ones are stored in a ``.npz`` beside the file (same stem), which the file names and loads
relative to itself. No torch is needed to read the file back.
"""

import io
import pathlib

import numpy as np

from rdakit.files import atomic_write

__all__ = ["INLINE_ELEMENTS", "graph_source", "write_graph_file", "constants_path"]

#: Constants of at most this many elements are written in the file itself.
INLINE_ELEMENTS = 16


def constants_path(path):
    """The ``.npz`` that holds the large constants of the graph file ``path``."""
    return pathlib.Path(path).with_suffix(".npz")


def _literal(value):
    if isinstance(value, np.integer):
        return repr(int(value))
    if isinstance(value, tuple | list):
        return repr(tuple(int(v) if isinstance(v, np.integer) else v for v in value))
    return repr(value)


def graph_source(graph, *, header="", npz_name=None):
    """The Python source of ``graph`` and its large constants (name -> array).

    Parameters
    ----------
    graph : DataflowGraph
        A validated graph.
    header : str
        Text of the file's docstring (what the graph is, where it came from).
    npz_name : str, optional
        File name of the ``.npz`` beside the graph file (needed if a constant is large).

    Returns
    -------
    (str, dict of str to numpy.ndarray)
    """
    graph.validate()
    big = {}
    body = []
    for n in graph.order():
        kind = graph.kind(n)
        attrs = graph.nx.nodes[n]["attrs"]
        if kind == "input":
            t = graph.type_of(n)
            extra = ", dynamic=True" if t.dynamic else ""
            body.append(f"    g.input({n!r}, {_literal(t.shape)}, {t.dtype!r}{extra})")
        elif kind == "const":
            value = attrs["value"]
            if value.size <= INLINE_ELEMENTS:
                body.append(f"    g.const({n!r}, np.array({value.tolist()!r}, "
                            f"dtype=np.{value.dtype.name}))")
            else:
                big[n] = value
                body.append(f"    g.const({n!r}, CONSTANTS[{n!r}])")
        elif kind == "output":
            body.append(f"    g.output({n!r}, {graph.inputs_of(n)[0]!r})")
        else:
            args = ", ".join([repr(kind)] + [repr(i) for i in graph.inputs_of(n)]
                             + [f"name={n!r}"]
                             + [f"{k}={_literal(v)}" for k, v in attrs.items()])
            body.append(f"    g.add({args})")
    if big and npz_name is None:
        raise ValueError("the graph has large constants: name the .npz file to hold them")
    doc = header.strip().replace('"""', "'''")
    lines = [f'"""{doc}', "", f"Load with rdakit compile FILE.py; {len(graph)} ops.", '"""',
             "", "import pathlib", "", "import numpy as np", "",
             "from rdakit.compiler.graph import DataflowGraph", ""]
    if big:
        lines += [f"#: The constants of more than {INLINE_ELEMENTS} elements, beside this file.",
                  f"with np.load(pathlib.Path(__file__).with_name({npz_name!r})) as _npz:",
                  "    CONSTANTS = dict(_npz)", ""]
    lines += ["", "def build():", f"    g = DataflowGraph({graph.name!r})", *body,
              "    return g", ""]
    return "\n".join(lines), big


def write_graph_file(graph, path, *, header=""):
    """Write ``graph`` as a graph file at ``path`` (and its large constants in
    :func:`constants_path`), each file atomically; returns the paths written."""
    path = pathlib.Path(path)
    npz = constants_path(path)
    source, big = graph_source(graph, header=header, npz_name=npz.name)
    written = []
    if big:
        buf = io.BytesIO()
        np.savez(buf, **big)
        atomic_write(npz, buf.getvalue())
        written.append(npz)
    atomic_write(path, source)
    return [path, *written]
