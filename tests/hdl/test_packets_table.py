"""pack and unpack read their field table once per layout (issue 21, M3): they must agree with
Amaranth's own layouts (``Layout.const`` and ``Layout.from_bits``) on every packet layout."""

import pytest
from amaranth.lib import data as data_
from amaranth.lib import enum
from conftest import hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.hdl.spec import packets
from rdakit.hdl.spec.params import MUParams

PARAMS = (MUParams(), MUParams(cluster_bits=2))
LAYOUTS = [(name, getattr(packets, name)(p))
           for p in PARAMS
           for name in ("mu_request_layout", "mu_response_layout", "msg_layout",
                        "host_cmd_layout", "host_reply_layout")]
IDS = [f"{name}-{i // 5}" for i, (name, _) in enumerate(LAYOUTS)]


def _amaranth_unpack(layout, value):
    """The fields of ``value`` read by asking Amaranth's layout for each field (the reference:
    what unpack did before its table)."""
    out = {}
    for name, field in layout:
        v = (value >> field.offset) & ((1 << field.width) - 1)
        if isinstance(field.shape, data_.StructLayout):
            v = _amaranth_unpack(field.shape, v)
        elif isinstance(field.shape, enum.EnumMeta):
            v = {m.value: m for m in field.shape}.get(v, v)
        out[name] = v
    return out


@pytest.mark.parametrize("layout", [layout for _, layout in LAYOUTS], ids=IDS)
@hostile(30)
@given(data=st.data())
def test_pack_and_unpack_agree_with_amaranth(layout, data):
    value = data.draw(st.integers(0, (1 << layout.size) - 1))
    fields = packets.unpack(layout, value)
    assert fields == _amaranth_unpack(layout, value)
    assert packets.pack(layout, fields) == value
    try:
        const = layout.const(fields).as_bits()
    except ValueError:   # an encoding outside an enum: Amaranth refuses it, pack keeps it
        return
    assert const == value


def test_pack_refuses_a_value_wider_than_its_field():
    layout = packets.mu_request_layout(MUParams())
    width = dict(layout)["index"].width
    with pytest.raises(ValueError, match=f"'index' of width {width} cannot hold {1 << width}"):
        packets.pack(layout, {"index": 1 << width})
    with pytest.raises(ValueError, match="'data' of width"):
        packets.pack(layout, {"data": -1})
