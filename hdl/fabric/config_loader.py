"""The configuration loader: parses a bitstream word by word and writes every tile's registers.

The format is ``docs/bitstream.md`` (written by :func:`rdakit.hdl.spec.bitstream.write_bitstream`).
The loader checks the header (magic, version, fabric parameter hash, header CRC) before it
writes anything, writes each record to its tile over the configuration bus as it arrives, and
checks the payload CRC at the end: only then does the fabric count as configured. At the start
of a load it disables every CU, so a bitstream that fails any check leaves no runnable tile.
"""

from amaranth.hdl import Const, Module, Signal
from amaranth.lib import crc, enum, stream, wiring
from amaranth.lib.wiring import In, Out

from rdakit.hdl.spec.bitstream import MAGIC_WORD, VERSION
from rdakit.hdl.spec.config import CU_MAP
from rdakit.hdl.spec.params import FabricParams

__all__ = ["ConfigLoader", "LoadStatus"]


class LoadStatus(enum.Enum, shape=4):
    """Outcome of the last load (``status`` of :class:`ConfigLoader`)."""

    IDLE = 0           #: nothing loaded since reset
    LOADING = 1
    OK = 2
    BAD_MAGIC = 3
    BAD_VERSION = 4
    BAD_PARAMS = 5     #: the fabric parameter hash differs
    HEADER_CRC = 6
    PAYLOAD_CRC = 7
    BAD_TILE = 8       #: a section for a tile outside the grid or not a CU
    BAD_LENGTH = 9     #: the payload ended inside a section or record


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
        Bitstream words, little-endian, header first. Accepted one per cycle.
    bus_we, bus_broadcast : Out(1)
        Write this cycle; to every CU.
    bus_x, bus_y, bus_addr, bus_wdata : Out
        The tile, the word address and the data of the write.
    status : Out(LoadStatus)
        ``LOADING`` from ``begin`` to the end, then ``OK`` or the first error.
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

        header_i = Signal(range(7))
        length = Signal(32)
        payload_crc = Signal(32)
        remaining = Signal(32)
        records = Signal(16)        # records left in the current section
        count = Signal(16)          # data words left in the current record
        addr = Signal(16)
        x = Signal.like(self.bus_x)
        y = Signal.like(self.bus_y)
        running = Signal()

        # Which tiles are CUs: a constant bit per (x, y).
        cu_mask = 0
        cb = p.coord_bits
        for tx, ty in p.tiles("C"):
            cu_mask |= 1 << (ty << cb | tx)
        cu_bits = Const(cu_mask, 1 << (2 * cb))

        m.d.comb += [self.bus_x.eq(x), self.bus_y.eq(y), crc_unit.data.eq(word)]
        with m.If(running):
            m.d.sync += self.cycles.eq(self.cycles + 1)

        def fail(code):
            m.d.sync += [self.status.eq(code), running.eq(0)]
            m.next = "ERROR"

        def begin():
            # A new load: disable every CU, restart the header CRC. Takes priority in every
            # state.
            m.d.comb += [self.bus_we.eq(1), self.bus_broadcast.eq(1),
                         self.bus_addr.eq(CU_MAP.CONTROL), self.bus_wdata.eq(0),
                         crc_unit.start.eq(1)]
            m.d.sync += [self.status.eq(LoadStatus.LOADING), self.configured.eq(0),
                         header_i.eq(0), running.eq(1), self.cycles.eq(0)]
            m.next = "HEADER"

        with m.FSM():
            with m.State("IDLE"):
                with m.If(self.begin):
                    begin()
            with m.State("HEADER"):
                with m.If(self.begin):
                    begin()
                with m.Elif(take):
                    m.d.sync += header_i.eq(header_i + 1)
                    m.d.comb += crc_unit.valid.eq(header_i < 5)
                    with m.Switch(header_i):
                        with m.Case(0):
                            with m.If(word != MAGIC_WORD):
                                fail(LoadStatus.BAD_MAGIC)
                        with m.Case(1):
                            with m.If(word[:16] != VERSION):
                                fail(LoadStatus.BAD_VERSION)
                        with m.Case(2):
                            with m.If(word != self.params_hash):
                                fail(LoadStatus.BAD_PARAMS)
                        with m.Case(3):
                            m.d.sync += [length.eq(word), remaining.eq(word)]
                        with m.Case(4):
                            m.d.sync += payload_crc.eq(word)
                        with m.Case(5):
                            with m.If(word != crc_unit.crc):
                                fail(LoadStatus.HEADER_CRC)
                            with m.Else():
                                m.d.comb += crc_unit.start.eq(1)
                                m.next = "SECTION"
                                with m.If(length == 0):
                                    m.next = "CHECK"
            with m.State("SECTION"):
                with m.If(self.begin):
                    begin()
                with m.Elif(take):
                    m.d.comb += crc_unit.valid.eq(1)
                    m.d.sync += [remaining.eq(remaining - 1), x.eq(word[16:24]),
                                 y.eq(word[24:32]), records.eq(word[:16])]
                    tile_ok = (word[16:24] < p.cols) & (word[24:32] < p.rows) & \
                        cu_bits.bit_select(word[24:24 + cb] << cb | word[16:16 + cb], 1)
                    with m.If(~tile_ok):
                        fail(LoadStatus.BAD_TILE)
                    with m.Elif(remaining == 1):
                        m.next = "CHECK"
                        with m.If(word[:16] != 0):
                            fail(LoadStatus.BAD_LENGTH)
                    with m.Elif(word[:16] != 0):
                        m.next = "RECORD"
            with m.State("RECORD"):
                with m.If(self.begin):
                    begin()
                with m.Elif(take):
                    m.d.comb += crc_unit.valid.eq(1)
                    m.d.sync += [remaining.eq(remaining - 1), addr.eq(word[16:32]),
                                 count.eq(word[:16]), records.eq(records - 1)]
                    with m.If(remaining == 1):
                        with m.If(word[:16] != 0):
                            fail(LoadStatus.BAD_LENGTH)
                        with m.Elif(records != 1):
                            fail(LoadStatus.BAD_LENGTH)
                        with m.Else():
                            m.next = "CHECK"
                    with m.Elif(word[:16] != 0):
                        m.next = "DATA"
                    with m.Elif(records == 1):
                        m.next = "SECTION"
            with m.State("DATA"):
                with m.If(self.begin):
                    begin()
                with m.Elif(take):
                    m.d.comb += [crc_unit.valid.eq(1), self.bus_we.eq(1),
                                 self.bus_addr.eq(addr), self.bus_wdata.eq(word)]
                    m.d.sync += [remaining.eq(remaining - 1), addr.eq(addr + 1),
                                 count.eq(count - 1)]
                    with m.If(remaining == 1):
                        with m.If((count != 1) | (records != 0)):
                            fail(LoadStatus.BAD_LENGTH)
                        with m.Else():
                            m.next = "CHECK"
                    with m.Elif(count == 1):
                        m.next = "RECORD"
                        with m.If(records == 0):
                            m.next = "SECTION"
            with m.State("CHECK"):
                # The CRC unit has taken the last word: compare.
                with m.If(self.begin):
                    begin()
                with m.Elif(crc_unit.crc == payload_crc):
                    m.d.sync += [self.status.eq(LoadStatus.OK), self.configured.eq(1),
                                 running.eq(0)]
                    m.next = "IDLE"
                with m.Else():
                    fail(LoadStatus.PAYLOAD_CRC)
            with m.State("ERROR"):
                with m.If(self.begin):   # words are discarded until the next begin
                    begin()

        return m
