"""The block table: (buffer slot, virtual block) -> physical block."""

from amaranth.hdl import Cat, Module, Signal
from amaranth.lib import memory, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from rdakit.hdl.spec.params import MUParams

__all__ = ["BlockTable"]


class BlockTable(wiring.Component):
    """The virtual-to-physical map of a memory unit: ``max_buffers * max_vblocks`` entries.

    An entry is a physical block number and nothing else: whether a virtual block is mapped is
    a bit of its buffer's entry in the buffer table (``mapped``), which the memory unit clears
    with the whole entry when it allocates or frees the slot. So the table needs no clearing
    after reset and is ready at once; an entry never written since reset holds whatever the
    memory held, and is never used.

    A lookup presented in one cycle (``lookup_en``) has its entry on ``entry`` from the next
    cycle on, held until the next lookup. A write in the same cycle as a lookup of the same
    entry is forwarded (the lookup sees the new entry), so a pipeline that writes in its execute
    stage and looks up in its accept stage needs no bypass.

    Parameters
    ----------
    params : MUParams
        Sizes (``max_buffers``, ``max_buffer_words``, ``block_words``, ``words``).

    Members
    -------
    lookup_en : In(1)
        Look up ``lookup_slot``, ``lookup_vblock`` this cycle.
    lookup_slot, lookup_vblock : In
        The entry to look up.
    entry : Out(params.block_bits)
        The physical block of the last lookup.
    write_en : In(1)
        Write ``write_block`` to ``write_slot``, ``write_vblock`` this cycle.
    write_slot, write_vblock : In
        The entry to write.
    write_block : In(params.block_bits)
        The physical block written.

    Raises
    ------
    TypeError
        If ``params`` is not an :class:`MUParams`.

    Notes
    -----
    The private, test-only argument ``_observe=True`` adds the member ``obs_entries`` (every
    entry, indexed ``slot * max_vblocks + vblock``, through combinational read ports) for the
    formal proofs.
    """

    def __init__(self, params, *, _observe=False):
        if not isinstance(params, MUParams):
            raise TypeError(f"Params must be an MUParams, not {params!r}")
        self.params = params
        self._observe = bool(_observe)
        if self._observe:
            depth = params.max_buffers * params.max_vblocks
            self.obs_entries = [Signal(params.block_bits, name=f"obs_entry_{k}")
                                for k in range(depth)]
        slot = max(1, params.slot_bits)
        vb = max(1, exact_log2(params.max_vblocks))
        super().__init__({
            "lookup_en": In(1),
            "lookup_slot": In(slot),
            "lookup_vblock": In(vb),
            "entry": Out(params.block_bits),
            "write_en": In(1),
            "write_slot": In(slot),
            "write_vblock": In(vb),
            "write_block": In(params.block_bits),
        })

    def elaborate(self, platform):
        p = self.params
        m = Module()
        depth = p.max_buffers * p.max_vblocks
        sbits = p.slot_bits
        vbits = exact_log2(p.max_vblocks)
        m.submodules.mem = mem = memory.Memory(shape=p.block_bits, depth=depth, init=[])
        wp = mem.write_port()
        rp = mem.read_port(transparent_for=(wp,))

        def address(slot, vblock):
            return Cat(vblock[:vbits], slot[:sbits])

        m.d.comb += [
            rp.addr.eq(address(self.lookup_slot, self.lookup_vblock)),
            rp.en.eq(self.lookup_en),
            self.entry.eq(rp.data),
            wp.addr.eq(address(self.write_slot, self.write_vblock)),
            wp.data.eq(self.write_block),
            wp.en.eq(self.write_en),
        ]
        if self._observe:
            for k, obs in enumerate(self.obs_entries):
                port = mem.read_port(domain="comb")
                m.d.comb += [port.addr.eq(k), obs.eq(port.data)]
        return m
