# amaranth: UnusedElaboratable=no
"""The SymbiYosys runner and the property list: argument checks (fast, default suite), and the
runner's verdicts on a tiny counter (formal)."""

import gc
import warnings

import pytest
from amaranth.hdl import Assert, Fragment, Module, Signal

from rdakit.sim.verify import formal_harness
from rdakit.sim.verify.formal import run_sby, sby_available
from rdakit.sim.verify.formal_harness import (
    PROPERTIES,
    credits,
    get_property,
    memory,
    prove,
    router,
)


def _counter(limit):
    # Counts 0..9 and wraps; asserts the count stays below `limit`.
    m = Module()
    c = Signal(4)
    m.d.sync += c.eq(c + 1)
    with m.If(c == 9):
        m.d.sync += c.eq(0)
    m.d.comb += Assert(c < limit, "count in range")
    return m


def test_run_sby_wrong_name():
    with pytest.raises(TypeError, match=r"Name must be letters, digits, '_' and '-', "
                                        r"not 'a b'"):
        run_sby(_counter(10), name="a b")


def test_run_sby_wrong_mode():
    with pytest.raises(TypeError, match=r"Mode must be one of 'prove', 'bmc', not 'sim'"):
        run_sby(_counter(10), name="c", mode="sim")


def test_run_sby_wrong_depth():
    with pytest.raises(TypeError, match=r"Depth must be a positive integer, not 0"):
        run_sby(_counter(10), name="c", depth=0)


def test_unknown_property():
    with pytest.raises(ValueError, match=r"Property must be one of .*mu\.blocks.*, "
                                         r"not 'nope'"):
        get_property("nope")


def test_unknown_fault_of_property():
    with pytest.raises(ValueError, match=r"Fault of mu\.blocks must be one of "
                                         r"'walk_frees_holes', not 'len_no_response'"):
        prove("mu.blocks", fault="len_no_response")


def test_fault_hooks_validate():
    # The broken variants live in the harnesses; each harness refuses an unknown one before
    # building anything.
    with pytest.raises(TypeError, match=r"Fault must be one of 'pop_keeps', not 'x'"):
        formal_harness.free_list_exclusive("x")
    with pytest.raises(TypeError, match=r"Fault must be one of 'walk_frees_holes', .*not 'x'"):
        formal_harness.mu_blocks("x")
    with pytest.raises(TypeError, match=r"Fault must be one of 'ignore_room', .*not 'x'"):
        formal_harness.router_links("x")
    with pytest.raises(TypeError, match=r"Fault must be one of .*'pointer_follows', not 'x'"):
        formal_harness.mesh_delivery("x")
    with pytest.raises(TypeError, match=r"Fault must be one of 'returns_twice', not 'x'"):
        formal_harness.credits.credits_conserved("x")


def test_refused_fault_leaves_no_unused_harness():
    # A harness built before its fault was checked warned UnusedElaboratable when collected,
    # which failed an unrelated test later in the run.
    builders = [formal_harness.free_list_exclusive, formal_harness.mu_blocks,
                formal_harness.router_links, formal_harness.router_delivery,
                formal_harness.mesh_delivery, credits.credits_conserved]
    Fragment.get(_counter(10), None)   # amaranth warns only once something was elaborated
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for build in builders:
            with pytest.raises(TypeError, match="Fault must be one of"):
                build("x")
        gc.collect()
    assert [str(w.message) for w in caught] == []


def test_every_broken_variant_is_a_subclass_of_the_design():
    # A broken variant overrides a step of the product class; the product has no fault switch.
    for variants in (memory.FREE_LIST_VARIANTS, memory.MU_VARIANTS, router.ROUTER_VARIANTS,
                     credits.CREDIT_VARIANTS):
        for fault, cls in variants.items():
            assert fault is None or (cls is not variants[None]
                                     and issubclass(cls, variants[None])), fault


def test_property_list_is_consistent():
    names = [p.name for p in PROPERTIES]
    assert len(names) == len(set(names))
    for prop in PROPERTIES:
        assert prop.mode in ("prove", "bmc") and prop.expect in ("PASS", "FAIL")
        assert prop.faults, f"{prop.name} has no broken variant that shows its harness works"
        assert prop.where.startswith("rdakit.sim.verify.formal_harness.")
    table = formal_harness.properties_table()
    for name in names:
        assert f"`{name}`" in table


@pytest.mark.formal
@pytest.mark.skipif(sby_available() is not None, reason=str(sby_available()))
@pytest.mark.parametrize("limit,mode,status", [(10, "prove", "PASS"), (8, "prove", "FAIL"),
                                               (8, "bmc", "FAIL"), (12, "bmc", "PASS")])
def test_runner_verdicts(limit, mode, status, tmp_path):
    result = run_sby(_counter(limit), name="counter", mode=mode, depth=12, workdir=tmp_path)
    assert result.status == status
    if status == "FAIL":
        assert result.failed == ["count in range"]
        assert result.step == 8
        assert result.trace.exists()
    else:
        assert result.failed == [] and result.trace is None
