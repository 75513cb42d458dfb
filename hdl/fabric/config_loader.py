"""The configuration loader: parses a bitstream word by word and writes every tile's registers.

The format and its checks are ``docs/bitstream.md``; the reader
(:func:`rdakit.hdl.spec.bitstream.read_bitstream`) implements the same checks in the same order,
so the loader refuses exactly the bitstreams the reader refuses, with the same
:class:`LoadStatus`, and writes only the addresses of
:func:`~rdakit.hdl.spec.bitstream.writable_ranges`.
The loader checks the header (the magic at once, then the header CRC, then version, flags and
the fabric parameter hash) before it writes anything, writes each record to its tile over the
configuration bus as it arrives, and checks the payload CRC at the end: only then does the
fabric count as configured. At the start of a load it disables every CU; after the first error
in the payload it writes nothing more, and a load that ends refused disables every CU again, so
a refused bitstream leaves no runnable tile.
"""

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import crc, stream, wiring
from amaranth.lib.wiring import In, Out

from rdakit.hdl.spec.bitstream import HEADER, MAGIC_WORD, VERSION, LoadStatus, writable_ranges
from rdakit.hdl.spec.config import CU_MAP
from rdakit.hdl.spec.params import FabricParams

__all__ = ["ConfigLoader", "LoadStatus"]


class ConfigLoader(wiring.Component):
    """Bitstream parser and configuration-bus master.

    Parameters
    ----------
    params : FabricParams
        The fabric (grid, layout; its parameter hash is checked against the bitstream's).
    params_hash : int
        The 32-bit hash of ``params`` (:func:`rdakit.hdl.spec.bitstream.params_hash`).

    Members
    -------
    begin : In(1)
        Start a new load: forget the previous one and disable every CU (broadcast write).
    words : In(stream.Signature(32))
        Bitstream words, little-endian, header first. Accepted one per cycle (``ready`` is
        always 1); words that arrive when no load is under way (before the first ``begin``,
        after an error) are discarded, and a word after the payload of a load that passed
        turns it into ``TRAILING``.
    bus_we, bus_broadcast : Out(1)
        Write this cycle; to every CU.
    bus_x, bus_y, bus_addr, bus_wdata : Out
        The tile, the word address and the data of the write.
    status : Out(LoadStatus)
        ``LOADING`` from ``begin`` to the end, then ``OK`` or the first error. Header errors
        are reported at the word that shows them (the magic at once, the others with the header
        CRC); a payload error at the end of the payload, behind a payload CRC mismatch.
    configured : Out(1)
        The last load passed every check.
    cycles : Out(32)
        Cycles from ``begin`` to the end of the last load.
    """

    def __init__(self, params, *, params_hash):
        if not isinstance(params, FabricParams):
            raise TypeError(f"Params must be a FabricParams, not {params!r}")
        self.params = params
        self.params_hash = params_hash
        cb = params.coord_bits
        super().__init__({
            "begin": In(1),
            "words": In(stream.Signature(32)),
            "bus_we": Out(1),
            "bus_broadcast": Out(1),
            "bus_x": Out(cb),
            "bus_y": Out(cb),
            "bus_addr": Out(16),
            "bus_wdata": Out(32),
            "status": Out(LoadStatus),
            "configured": Out(1),
            "cycles": Out(32),
        })

    def elaborate(self, platform):
        p = self.params
        m = Module()
        m.submodules.crc = crc_unit = crc.catalog.CRC32_ISO_HDLC(data_width=32).create()

        word = self.words.payload
        take = Signal()
        m.d.comb += [self.words.ready.eq(1), take.eq(self.words.valid)]

        n_header = HEADER.size // 4
        header_i = Signal(range(n_header + 1))
        length = Signal(32)
        payload_crc = Signal(32)
        remaining = Signal(32)      # payload words still to come
        last = Signal()             # this word is the payload's last
        records = Signal(16)        # records left in the current section
        count = Signal(16)          # data words left in the current record
        addr = Signal(17)           # 17 bits: a record running past 0xffff does not wrap
        x = Signal.like(self.bus_x)
        y = Signal.like(self.bus_y)
        cb = p.coord_bits
        previous = Signal(2 * cb)   # the last section's tile, y << cb | x
        seen = Signal()             # a section came before
        running = Signal()
        # The first error of the load; reported when the header CRC, or the payload CRC,
        # has been checked (a CRC mismatch comes first).
        pending = Signal(LoadStatus, init=LoadStatus.OK)
        word_error = Signal(LoadStatus)    # what this payload word breaks, OK if nothing

        # Which tiles are CUs: a constant bit per (x, y).
        cu_mask = 0
        for tx, ty in p.tiles("C"):
            cu_mask |= 1 << (ty << cb | tx)
        cu_bits = Const(cu_mask, 1 << (2 * cb))
        # (no ``addr >= 0``: Verilator's lint refuses a comparison that is always true)
        writable = Cat(*[((addr >= lo) if lo else 1) & (addr < hi)
                         for lo, hi in writable_ranges(p)]).any()

        m.d.comb += [self.bus_x.eq(x), self.bus_y.eq(y), crc_unit.data.eq(word),
                     last.eq(remaining == 1), word_error.eq(LoadStatus.OK)]
        with m.If(running):
            m.d.sync += self.cycles.eq(self.cycles + 1)

        def fail(code):
            m.d.sync += [self.status.eq(code), running.eq(0)]
            m.next = "DONE"

        def disable_all():
            m.d.comb += [self.bus_we.eq(1), self.bus_broadcast.eq(1),
                         self.bus_addr.eq(CU_MAP.CONTROL), self.bus_wdata.eq(0)]

        def begin():
            # A new load: disable every CU, restart the header CRC. Takes priority in every
            # state.
            disable_all()
            m.d.comb += crc_unit.start.eq(1)
            m.d.sync += [self.status.eq(LoadStatus.LOADING), self.configured.eq(0),
                         header_i.eq(0), running.eq(1), self.cycles.eq(0),
                         pending.eq(LoadStatus.OK), seen.eq(0)]
            m.next = "HEADER"

        def payload_word():
            # Every payload word: into the CRC; the first error is kept and the rest of the
            # payload skipped (nothing more is written); after the last word, the check.
            m.d.comb += crc_unit.valid.eq(1)
            m.d.sync += remaining.eq(remaining - 1)
            with m.If(word_error != LoadStatus.OK):
                with m.If(pending == LoadStatus.OK):
                    m.d.sync += pending.eq(word_error)
                m.next = "SKIP"
            with m.If(last):
                m.next = "CHECK"

        with m.FSM():
            with m.State("IDLE"):
                with m.If(self.begin):
                    begin()
            with m.State("HEADER"):
                with m.If(self.begin):
                    begin()
                with m.Elif(take):
                    m.d.sync += header_i.eq(header_i + 1)
                    m.d.comb += crc_unit.valid.eq(header_i < n_header - 1)
                    with m.Switch(header_i):
                        with m.Case(0):
                            with m.If(word != MAGIC_WORD):
                                fail(LoadStatus.BAD_MAGIC)
                        with m.Case(1):     # the version, and flags 0
                            with m.If(word != VERSION):
                                m.d.sync += pending.eq(LoadStatus.BAD_VERSION)
                        with m.Case(2):
                            with m.If((word != self.params_hash)
                                      & (pending == LoadStatus.OK)):
                                m.d.sync += pending.eq(LoadStatus.BAD_PARAMS)
                        with m.Case(3):
                            m.d.sync += [length.eq(word), remaining.eq(word)]
                        with m.Case(4):
                            m.d.sync += payload_crc.eq(word)
                        with m.Case(n_header - 1):
                            with m.If(word != crc_unit.crc):
                                fail(LoadStatus.HEADER_CRC)
                            with m.Elif(pending != LoadStatus.OK):
                                fail(pending)
                            with m.Else():
                                m.d.comb += crc_unit.start.eq(1)
                                m.next = "SECTION"
                                with m.If(length == 0):
                                    m.next = "CHECK"
            with m.State("SECTION"):
                with m.If(self.begin):
                    begin()
                with m.Elif(take):
                    nrec, tx, ty = word[:16], word[16:24], word[24:32]
                    tile = Cat(tx[:cb], ty[:cb])
                    m.d.sync += [x.eq(tx), y.eq(ty), records.eq(nrec), previous.eq(tile),
                                 seen.eq(1)]
                    tile_ok = (tx < p.cols) & (ty < p.rows) & cu_bits.bit_select(tile, 1)
                    # Later assignments win: the checks in reverse order of precedence.
                    with m.If(last):
                        m.d.comb += word_error.eq(LoadStatus.BAD_LENGTH)
                    with m.If(nrec == 0):
                        m.d.comb += word_error.eq(LoadStatus.EMPTY)
                    with m.If(seen & (tile <= previous)):
                        m.d.comb += word_error.eq(LoadStatus.BAD_ORDER)
                    with m.If(~tile_ok):
                        m.d.comb += word_error.eq(LoadStatus.BAD_TILE)
                    m.next = "RECORD"
                    payload_word()
            with m.State("RECORD"):
                with m.If(self.begin):
                    begin()
                with m.Elif(take):
                    m.d.sync += [addr.eq(word[16:32]), count.eq(word[:16]),
                                 records.eq(records - 1)]
                    with m.If(last):
                        m.d.comb += word_error.eq(LoadStatus.BAD_LENGTH)
                    with m.If(word[:16] == 0):
                        m.d.comb += word_error.eq(LoadStatus.EMPTY)
                    m.next = "DATA"
                    payload_word()
            with m.State("DATA"):
                with m.If(self.begin):
                    begin()
                with m.Elif(take):
                    with m.If(writable):
                        m.d.comb += [self.bus_we.eq(1), self.bus_addr.eq(addr[:16]),
                                     self.bus_wdata.eq(word)]
                    m.d.sync += [addr.eq(addr + 1), count.eq(count - 1)]
                    with m.If(last & ((count != 1) | (records != 0))):
                        m.d.comb += word_error.eq(LoadStatus.BAD_LENGTH)
                    with m.If(~writable):
                        m.d.comb += word_error.eq(LoadStatus.BAD_ADDRESS)
                    with m.If(count == 1):
                        m.next = "RECORD"
                        with m.If(records == 0):
                            m.next = "SECTION"
                    payload_word()
            with m.State("SKIP"):
                # After a payload error: the rest of the payload only goes through the CRC.
                with m.If(self.begin):
                    begin()
                with m.Elif(take):
                    payload_word()
            with m.State("CHECK"):
                # The CRC unit has taken the last word: compare. A word arriving now is one
                # too many.
                checked = Mux(crc_unit.crc != payload_crc, LoadStatus.PAYLOAD_CRC, pending)
                outcome = Signal(LoadStatus)
                m.d.comb += outcome.eq(checked)
                with m.If(take & (checked == LoadStatus.OK)):
                    m.d.comb += outcome.eq(LoadStatus.TRAILING)
                with m.If(self.begin):
                    begin()
                with m.Else():
                    m.d.sync += [self.status.eq(outcome), running.eq(0),
                                 self.configured.eq(outcome == LoadStatus.OK)]
                    with m.If(outcome != LoadStatus.OK):
                        disable_all()
                    m.next = "DONE"
            with m.State("DONE"):
                # Words are discarded until the next begin; one after a load that passed
                # refuses it.
                with m.If(self.begin):
                    begin()
                with m.Elif(take & (self.status == LoadStatus.OK)):
                    m.d.sync += [self.status.eq(LoadStatus.TRAILING), self.configured.eq(0)]
                    disable_all()

        return m
