"""The block table: (buffer slot, virtual block) -> physical block, cleared after every reset."""

from amaranth.hdl import Cat, Module, Signal
from amaranth.lib import data, memory, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from rdakit.hdl.spec.params import MUParams

__all__ = ["BlockTable", "block_entry_layout"]


def block_entry_layout(p: MUParams):
    """One entry of the block table."""
    return data.StructLayout({"valid": 1, "block": p.block_bits})


class BlockTable(wiring.Component):
    """The virtual-to-physical map of a memory unit: ``max_buffers * max_vblocks`` entries.

    A lookup presented in one cycle (``lookup_en``) has its entry on ``entry`` from the next
    cycle on, held until the next lookup. A write in the same cycle as a lookup of the same
    entry is forwarded (the lookup sees the new entry), so a pipeline that writes in its execute
    stage and looks up in its accept stage needs no bypass. After reset the table clears itself,
    one entry per cycle; ``ready`` rises when every entry is invalid.

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
    entry : Out(block_entry_layout(params))
        The entry of the last lookup.
    write_en : In(1)
        Write ``write_entry`` to ``write_slot``, ``write_vblock`` this cycle.
    write_slot, write_vblock : In
        The entry to write.
    write_entry : In(block_entry_layout(params))
        The value written.
    ready : Out(1)
        The table has been cleared since reset.

    Notes
    -----
    The private, test-only argument ``_observe=True`` adds the members ``obs_entries`` (every
    entry, indexed ``slot * max_vblocks + vblock``, through combinational read ports) and
    ``obs_clear`` (entries cleared since reset) for the formal proofs.
    """

    def __init__(self, params, *, _observe=False):
        if not isinstance(params, MUParams):
            raise TypeError(f"Params must be an MUParams, not {params!r}")
        self.params = params
        self._observe = bool(_observe)
        if self._observe:
            depth = params.max_buffers * params.max_vblocks
            self.obs_entries = [Signal(block_entry_layout(params), name=f"obs_entry_{k}")
                                for k in range(depth)]
            self.obs_clear = Signal(range(depth + 1))
        slot = max(1, params.slot_bits)
        vb = max(1, exact_log2(params.max_vblocks))
        entry = block_entry_layout(params)
        super().__init__({
            "lookup_en": In(1),
            "lookup_slot": In(slot),
            "lookup_vblock": In(vb),
            "entry": Out(entry),
            "write_en": In(1),
            "write_slot": In(slot),
            "write_vblock": In(vb),
            "write_entry": In(entry),
            "ready": Out(1),
        })

    def elaborate(self, platform):
        p = self.params
        m = Module()
        depth = p.max_buffers * p.max_vblocks
        sbits = p.slot_bits
        vbits = exact_log2(p.max_vblocks)
        m.submodules.mem = mem = memory.Memory(shape=block_entry_layout(p), depth=depth, init=[])
        wp = mem.write_port()
        rp = mem.read_port(transparent_for=(wp,))

        def address(slot, vblock):
            return Cat(vblock[:vbits], slot[:sbits])

        clear = Signal(range(depth + 1))
        m.d.comb += [
            rp.addr.eq(address(self.lookup_slot, self.lookup_vblock)),
            rp.en.eq(self.lookup_en),
            self.entry.eq(rp.data),
            self.ready.eq(clear == depth),
        ]
        with m.If(clear != depth):
            m.d.comb += [wp.addr.eq(clear), wp.data.eq(0), wp.en.eq(1)]
            m.d.sync += clear.eq(clear + 1)
        with m.Else():
            m.d.comb += [
                wp.addr.eq(address(self.write_slot, self.write_vblock)),
                wp.data.eq(self.write_entry),
                wp.en.eq(self.write_en),
            ]
        if self._observe:
            for k, obs in enumerate(self.obs_entries):
                port = mem.read_port(domain="comb")
                m.d.comb += [port.addr.eq(k), obs.eq(port.data)]
            m.d.comb += self.obs_clear.eq(clear)
        return m
