"""Hostile inputs to the compiler (issue 19): bounded work, fit checks before the expensive
steps, and graphs that compute nothing.

Scaling is checked by counting operations (the function calls cProfile sees), which do not
depend on the machine's load, never by wall-clock thresholds: a near-linear pass does about 4
times the calls on a 4 times larger graph, a quadratic one 16 times.
"""

import cProfile
import pstats

import numpy as np
import pytest
from conftest import hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.compiler.compile import compile_workload
from rdakit.compiler.graph import DataflowGraph
from rdakit.compiler.lower.capacity import Account
from rdakit.compiler.partition import Targets, partition
from rdakit.compiler.placement import Fabric, place
from rdakit.hdl.spec.params import fabric_params

BIG = fabric_params(4, 4, prog_len=4096, mu_words=1 << 16, max_buffers=256, local_words=256)


def calls(fn):
    """Function calls made by ``fn()`` (an operation count that does not depend on timing)."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        fn()
    finally:
        profile.disable()
    return pstats.Stats(profile).total_calls


def chain_graph(n, width=4, dead=0):
    """About ``n`` live nodes: ``width`` chains of elementwise ops (the kind the lowering fuses)
    from one input to one output each, plus a chain of ``dead`` additions nobody reads (not
    fused: each adds the input)."""
    g = DataflowGraph(f"chain{n}")
    x = g.input("x", (4, 8), "int8")
    three = g.const("three", np.array([[3]], dtype=np.int32))
    for c in range(width):
        h = x
        for i in range((n - 2 - 2 * width) // width):
            h = (g.add("add", h, three) if i % 4 == 0 else g.add("relu", h) if i % 4 == 1
                 else g.add("mul", h, three) if i % 4 == 2 else g.add("shr", h, shift=1))
        g.output(f"y{c}", h)
    h = x
    for _ in range(dead):
        h = g.add("add", h, x)
    return g.validate()


def deep_mlp(n, d=8, batch=4):
    """About ``n`` nodes: fully connected layers (7 nodes each), a buffer per constant."""
    rng = np.random.default_rng(0)
    g = DataflowGraph(f"deep{n}")
    x = g.input("x", (batch, d), "int8")
    for i in range(max(1, (n - 2) // 7)):
        h = g.add("matmul", x, g.const(f"w{i}", rng.integers(-8, 8, (d, d), dtype=np.int8)))
        h = g.add("add", h, g.const(f"b{i}", rng.integers(-64, 64, (d,), dtype=np.int32)))
        x = g.add("clip", g.add("shr", g.add("relu", h), shift=4), dtype="int8")
    g.output("y", x)
    return g.validate()


# --- bounded work: near-linear passes -----------------------------------------------------

def test_compile_work_grows_about_linearly_with_the_graph():
    # The elementwise fusion restarted its scan after every fold and dead-op elimination
    # rescanned every op per dead level: 600 -> 2,400 nodes took 10 times the calls.
    small = chain_graph(600, dead=150)
    large = chain_graph(2400, dead=600)
    work = [calls(lambda g=g: compile_workload(g, params=BIG, place_steps=200))
            for g in (small, large)]
    assert work[1] / work[0] < 6, work


class ScanAccount:
    """The capacity bound as a scan of every buffer of the MU at each query (what Account
    computed before it kept its totals incrementally): the reference it must agree with."""

    def __init__(self):
        self.bufs = {}

    def add(self, m, key, units, weight):
        self.bufs.setdefault(m, []).append([key, units, weight, []])

    def ret(self, key, stamp):
        for bufs in self.bufs.values():
            for b in bufs:
                if b[0] == key:
                    b[3].append(stamp)

    def live(self, m, stamp, reserve):
        u = s = 0
        for _key, units, weight, rets in self.bufs.get(m, []):
            dead = weight is not None and len(rets) == weight and all(
                Account.before(r, stamp) for r in rets)
            if not dead or reserve:
                u += units
            if not dead:
                s += 1
        return u, s


EVENTS = st.lists(st.tuples(st.sampled_from(["alloc", "ret", "send", "live"]),
                            st.integers(0, 3), st.integers(0, 3), st.integers(0, 30),
                            st.sampled_from([None, 0, 1, 2, 3])), max_size=60)


@pytest.mark.parametrize("mode", ["virtual", "reserve"])
@hostile(30)
@given(events=EVENTS)
def test_capacity_account_agrees_with_a_scan_of_every_buffer(mode, events):
    params = fabric_params(2, 4, alloc_mode=mode)
    cus = params.tiles("C")
    acct, ref = Account(params, cus), ScanAccount()
    keys, sent = [], []
    for what, a, b, n, weight in events:
        cu, other, m = cus[a % len(cus)], cus[b % len(cus)], acct.mus[b % len(acct.mus)]
        if what == "alloc":
            key = f"t{len(keys)}"
            stamp = acct.tick(cu)
            assert acct.live(m, stamp) == ref.live(m, stamp, mode == "reserve")
            acct.alloc(m, key, n, weight, stamp)
            ref.add(m, key, n, weight)
            keys.append(key)
        elif what == "ret" and keys:
            stamp = acct.tick(cu)
            acct.ret(keys[n % len(keys)], stamp)
            ref.ret(keys[n % len(keys)], stamp)
            for mu in acct.mus:       # a return does not happen before itself
                assert acct.live(mu, stamp) == ref.live(mu, stamp, mode == "reserve")
        elif what == "send":
            sent.append(acct.tick(cu))
            acct.merge(other, sent[n % len(sent)])
            acct.tick(other)
        else:
            stamp = acct.tick(cu)
            for mu in acct.mus:
                assert acct.live(mu, stamp) == ref.live(mu, stamp, mode == "reserve")


def test_capacity_account_work_grows_linearly_with_the_allocations():
    # A pipeline: one CU allocates, another receives and returns each buffer. Scanning every
    # earlier buffer of the MU at each ALLOC made this quadratic (16 times the calls for 4
    # times the buffers).
    def pipeline(n):
        params = fabric_params(2, 2)
        a, b = params.tiles("C")
        acct = Account(params, [a, b])
        m = acct.mus[0]
        for i in range(n):
            stamp = acct.tick(a)
            acct.fits(m, 1, stamp)
            acct.alloc(m, i, 1, 1, stamp)
            acct.merge(b, acct.tick(a))
            acct.ret(i, acct.tick(b))
            acct.merge(a, acct.tick(b))
        return acct
    work = [calls(lambda n=n: pipeline(n)) for n in (1000, 4000)]
    assert work[1] / work[0] < 5, work


def test_annealing_step_costs_the_same_on_a_larger_graph():
    # A partition move summed the cost of every buffer the partition touches: a step cost
    # about 4 times more on a 4 times larger graph. Now it costs O(MUs).
    fabric = Fabric(4, 4, mu_words=1 << 20, cu_program=4096)

    def per_step(n):
        g = deep_mlp(n)
        r = partition(g, Targets(8), "round_robin")
        return (calls(lambda: place(g, r, fabric, steps=2001))
                - calls(lambda: place(g, r, fabric, steps=1))) / 2000
    small, large = per_step(250), per_step(1000)
    assert large < 1.5 * small, (small, large)
