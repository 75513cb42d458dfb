# amaranth: UnusedElaboratable=no
"""The board link's formal harness (``link.checked``, ``link.once``, ``link.answers``): what
can be checked without SymbiYosys (default suite). The bounded checks themselves and their
broken variants (marked ``formal``) run in ``test_formal_proofs.py`` with every property:
``pytest -m formal tests/formal/test_formal_proofs.py -k link``."""

import pytest
from amaranth.hdl import Fragment

from rdakit.hdl.host.bridge import FrameLink
from rdakit.sim.verify.formal_harness import get_property
from rdakit.sim.verify.formal_harness.link import (
    LINK_FORMAL,
    LINK_TIMEOUT,
    LINK_VARIANTS,
    link_answers,
    link_checked,
    link_once,
)


@pytest.mark.parametrize("build", [link_checked, link_once, link_answers])
def test_link_harness_refuses_an_unknown_fault(build):
    with pytest.raises(TypeError, match=r"^Fault must be one of 'crc_unchecked', .*not 'x'$"):
        build("x")


@pytest.mark.parametrize("name", ["link.checked", "link.once", "link.answers"])
def test_link_properties_are_registered_with_their_faults(name):
    prop = get_property(name)
    assert prop.mode == "bmc" and prop.faults
    assert all(f in LINK_VARIANTS for f in prop.faults)
    # Every harness and broken variant builds (elaborates) without SymbiYosys.
    for fault in (None, *prop.faults):
        Fragment.get(prop.harness(fault), None)


def test_broken_variants_are_links():
    # The variants are built from FrameLink without changing it: same ports, same parameters.
    for fault, cls in LINK_VARIANTS.items():
        link = cls(LINK_FORMAL, timeout=LINK_TIMEOUT)
        assert isinstance(link, FrameLink)
        assert link.signature == FrameLink(LINK_FORMAL, timeout=LINK_TIMEOUT).signature, fault
