"""How tensors lie in MU buffers, and the error every part of the lowering raises."""

import dataclasses

import numpy as np

__all__ = ["LoweringError", "TensorLayout", "layout_of", "as2d", "MASK32", "INT_MIN", "INT_MAX"]

MASK32 = 0xffff_ffff
INT_MIN = 0x8000_0000          # as an unsigned 32-bit word
INT_MAX = 0x7fff_ffff


class LoweringError(ValueError):
    """A graph that cannot be lowered onto the fabric; the message names the node, CU or MU and
    what does not fit."""


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How a tensor lies in an MU buffer.

    A 2-D tensor ``(rows, cols)`` is ``rows`` rows of :attr:`cw` vector words; element
    ``(r, c)`` is lane ``c % lanes`` of word ``r * cw + c // lanes``. A 1-D tensor is one row.
    Every element is one int32 lane whatever the dtype; padding lanes are zero.

    Members
    -------
    rows, cols : int
        Shape (``rows`` is the bound of a dynamic tensor).
    lanes : int
        Lanes of a vector word.
    dtype : str
        The tensor's element type (values are stored as int32).
    dynamic : bool
        Whether the number of rows is known only at run time.
    ndim : int
        1 or 2: the shape :meth:`decode` returns.
    """

    rows: int
    cols: int
    lanes: int
    dtype: str = "int32"
    dynamic: bool = False
    ndim: int = 2

    @property
    def cw(self):
        """Vector words per row."""
        return -(-self.cols // self.lanes)

    @property
    def words(self):
        """Vector words at the bound."""
        return self.rows * self.cw

    def encode(self, value):
        """The vector words (``n x lanes`` int32) holding ``value``."""
        a = np.asarray(value)
        a = a.reshape(1, -1) if self.ndim == 1 else a
        if a.ndim != 2 or a.shape[1] != self.cols or (
                a.shape[0] != self.rows if not self.dynamic else a.shape[0] > self.rows):
            raise ValueError(f"value of shape {np.shape(value)} does not fit the layout "
                             f"{self.describe()}")
        out = np.zeros((a.shape[0], self.cw * self.lanes), dtype=np.int64)
        out[:, :self.cols] = a
        return out.astype(np.int32).reshape(-1, self.lanes)

    def decode(self, words, *, check_padding=False):
        """The tensor held in vector words ``words`` (``n x lanes``), with its dtype; with
        ``check_padding``, raise ``ValueError`` unless every padding lane is zero."""
        w = np.asarray(words, dtype=np.int32).reshape(-1)
        row = self.cw * self.lanes
        if row == 0 or len(w) % row:
            raise ValueError(f"{len(w) // max(self.lanes, 1)} vector words are not whole rows "
                             f"of the layout {self.describe()}")
        if check_padding and np.any(w.reshape(-1, row)[:, self.cols:]):
            raise ValueError(f"padding lanes of a tensor of layout {self.describe()} are not "
                             f"zero")
        a = w.reshape(-1, row)[:, :self.cols].astype(self.dtype)
        return a.reshape(-1) if self.ndim == 1 else a

    def describe(self):
        """The layout in words, for error messages."""
        rows = f"<={self.rows}" if self.dynamic else str(self.rows)
        shape = f"({self.cols},)" if self.ndim == 1 else f"({rows}, {self.cols})"
        return f"{self.dtype}{shape} in {self.cw} words a row"


def layout_of(ttype, lanes, node):
    """The :class:`TensorLayout` of a tensor of type ``ttype`` (node ``node``, for errors)."""
    shape = ttype.shape
    if len(shape) > 2:
        raise LoweringError(f"Node {node!r}: a tensor of {len(shape)} dimensions {shape} cannot "
                            f"be lowered; the CUs hold vectors and matrices (1-D or 2-D)")
    if len(shape) == 1:
        if ttype.dynamic:
            raise LoweringError(f"Node {node!r}: a 1-D tensor with a run-time length cannot be "
                                f"lowered (only rows of a 2-D tensor may be dynamic)")
        return TensorLayout(1, shape[0], lanes, ttype.dtype, False, 1)
    return TensorLayout(shape[0], shape[1], lanes, ttype.dtype, ttype.dynamic, 2)


def as2d(value):
    """``value`` as a 2-D array (a 1-D value is one row)."""
    a = np.asarray(value)
    return a.reshape(1, -1) if a.ndim == 1 else a

