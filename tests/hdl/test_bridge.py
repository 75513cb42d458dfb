# amaranth: UnusedElaboratable=no
"""The inter-cluster link: serialization over any width, wire latency, credit flow control (no
drop, no duplication, in order under random stalls), throughput, and its parameter errors."""

import itertools
import random

import pytest
from amaranth.lib import data

from rdakit.hdl.cluster.bridge import Link, link_beats, link_depth
from rdakit.sim.verify.amaranth_sim import StreamDriver
from rdakit.sim.verify.runner import generate_verilog

BITS = 37
SHAPE = data.StructLayout({"word": BITS})


def payloads(n, seed=0):
    rng = random.Random(seed)
    return [rng.getrandbits(BITS) for _ in range(n)]


@pytest.mark.parametrize("width,latency,depth,idle,backpressure", [
    (BITS, 1, None, None, None),
    (10, 4, None, "cycle", 0.5),      # 4 beats, the last one partial
    (1, 2, None, None, "cycle"),      # one wire
    (16, 20, 2, 0.7, 0.3),            # too few credits for the latency: slower, still exact
    (37, 7, 1, None, 0.2),            # a single credit
])
def test_every_packet_arrives_once_in_order(width, latency, depth, idle, backpressure):
    link = Link(SHAPE, width=width, latency=latency, depth=depth)
    sent = payloads(40, seed=width + latency)
    drv = StreamDriver(link, link.i, link.o, idle=idle, backpressure=backpressure, seed=latency)
    got = [v for _, v in drv.run(sent)]
    assert got == sent


@pytest.mark.parametrize("width,latency", [(BITS, 1), (10, 3), (8, 20), (1, 5)])
def test_latency_and_full_throughput(width, latency):
    link = Link(SHAPE, width=width, latency=latency)
    beats = link_beats(BITS, width)
    drv = StreamDriver(link, link.i, link.o)
    sent = payloads(12)
    assert [v for _, v in drv.run(sent)] == sent
    # Zero load: the first packet comes out beats + latency + 2 cycles after it went in.
    assert drv.received[0][0] - drv.sent[0][0] == beats + latency + 2
    # With the default credits the link never stops: one packet every `beats` cycles.
    gaps = {b[0] - a[0] for a, b in itertools.pairwise(drv.received)}
    assert gaps == {beats}


def test_credits_bound_what_is_in_flight():
    # One credit and a 10-cycle wire: a packet every round trip, not every beat.
    link = Link(SHAPE, width=BITS, latency=10, depth=1)
    drv = StreamDriver(link, link.i, link.o)
    drv.run(payloads(6))
    gaps = {b[0] - a[0] for a, b in itertools.pairwise(drv.received)}
    assert min(gaps) > 2 * 10
    assert link_depth(BITS, BITS, 10) > 1


def test_verilog_converts():
    assert "module top" in generate_verilog(Link(SHAPE, width=9, latency=3))


@pytest.mark.parametrize("kwargs,message", [
    ({"width": 0, "latency": 1}, r"^width must be an integer from 1 to 37, not 0$"),
    ({"width": 38, "latency": 1}, r"^width must be an integer from 1 to 37, not 38$"),
    ({"width": True, "latency": 1}, r"^width must be an integer"),
    ({"width": 8, "latency": 0}, r"^latency must be an integer from 1 to 256, not 0$"),
    ({"width": 8, "latency": 257}, r"^latency must be an integer from 1 to 256, not 257$"),
    ({"width": 8, "latency": 1, "depth": 0},
     r"^depth must be an integer from 1 to 1024, not 0$"),
])
def test_wrong_parameters(kwargs, message):
    with pytest.raises(TypeError, match=message):
        Link(BITS, **kwargs)


def test_wrong_shape():
    with pytest.raises(TypeError, match=r"^shape must be a shape-castable object, not 'x'$"):
        Link("x", width=1, latency=1)
