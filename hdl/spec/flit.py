"""The flit: what a network-on-chip link carries in one cycle, defined once.

Packets on rdakit's NoC are single flits: a flit is ``{dst: {x, y}, payload}``, the destination
tile's coordinates (``x`` the column, ``y`` the row, first field in the low bits) followed by a
payload of any shape (for the memory network a whole
:func:`~rdakit.hdl.spec.packets.mu_request_layout` or
:func:`~rdakit.hdl.spec.packets.mu_response_layout`). The router, the mesh, the traffic harness, the
models and the testbenches all take the layout from :func:`flit_layout`.

:class:`Port` names the five router ports. Directions follow the picture of a matrix: row 0 is
the north edge, so ``SOUTH`` is ``y + 1``; column 0 is the west edge, so ``EAST`` is ``x + 1``.
"""

import functools

from amaranth.hdl import Shape, ShapeCastable
from amaranth.lib import data, enum

from rdakit.hdl.spec.packets import coord_layout, pack, unpack

__all__ = ["Port", "PORT_DELTA", "DIRECTIONS", "flit_layout", "pack_flit", "unpack_flit",
           "check_coord_bits"]


class Port(enum.Enum, shape=3):
    """A router port: the four mesh directions and the local (tile) port."""

    NORTH = 0
    EAST = 1
    SOUTH = 2
    WEST = 3
    LOCAL = 4


#: The mesh directions, in port-number order (the indices of a router's link arrays).
DIRECTIONS = (Port.NORTH, Port.EAST, Port.SOUTH, Port.WEST)

#: Coordinate step ``(dx, dy)`` of each port's neighbour.
PORT_DELTA = {
    Port.NORTH: (0, -1),
    Port.EAST: (1, 0),
    Port.SOUTH: (0, 1),
    Port.WEST: (-1, 0),
    Port.LOCAL: (0, 0),
}


def check_coord_bits(coord_bits):
    """Raise ``TypeError`` unless ``coord_bits`` is an integer between 1 and 8."""
    if not isinstance(coord_bits, int) or isinstance(coord_bits, bool) \
            or not 1 <= coord_bits <= 8:
        raise TypeError(f"coord_bits must be an integer between 1 and 8, not {coord_bits!r}")


def flit_layout(coord_bits, payload_shape):
    """The flit layout ``{dst: {x, y}, payload}``.

    Parameters
    ----------
    coord_bits : int
        Width of each coordinate, 1 to 8.
    payload_shape : shape-castable
        Shape of the payload (an integer width, a :class:`~amaranth.lib.data.Layout`, ...).

    Raises
    ------
    TypeError
        If ``coord_bits`` is out of range or ``payload_shape`` is not a shape.
    """
    check_coord_bits(coord_bits)
    if not isinstance(payload_shape, ShapeCastable | Shape | int) \
            or isinstance(payload_shape, bool) \
            or (isinstance(payload_shape, int) and payload_shape < 0):
        raise TypeError(f"payload_shape must be a shape-castable object, not {payload_shape!r}")
    return _flit_layout(coord_bits, payload_shape)


@functools.cache
def _flit_layout(coord_bits, payload_shape):
    return data.StructLayout({"dst": coord_layout(coord_bits), "payload": payload_shape})


def pack_flit(layout, x, y, payload):
    """The integer of a flit to ``(x, y)``; ``payload`` an integer or a dict of fields."""
    pshape = layout["payload"].shape
    if isinstance(payload, dict):
        payload = pack(pshape, payload)
    return pack(layout, {"dst": {"x": x, "y": y}, "payload": int(payload)})


def unpack_flit(layout, value):
    """``(x, y, payload)`` of a flit integer; the payload stays an integer."""
    dst = layout["dst"]
    pay = layout["payload"]
    coords = unpack(dst.shape, (value >> dst.offset) & ((1 << dst.width) - 1))
    return coords["x"], coords["y"], (value >> pay.offset) & ((1 << pay.width) - 1)
