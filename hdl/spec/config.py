"""The configuration bus and every tile's configuration address map, defined once.

The configuration loader (and the host port) reach every tile's registers over one bus of
32-bit words: the fabric decodes the tile from ``tile`` and raises that tile's ``sel``. A write
(``we``) takes effect at the end of the cycle; a read (``re``) returns ``rdata`` in the next
cycle. The bitstream writer, the loader, the host driver and the docs use the addresses below.
"""

from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["config_bus_signature", "CU_MAP", "MU_MAP", "TILE_COUNTERS", "CU_PROFILE",
           "CU_STATUS_BITS", "CU_STATUS", "cu_status_word", "decode_cu_status", "STATUS_BITS"]


def config_bus_signature():
    """A tile's side of the configuration bus (``In`` of this is what a tile has)."""
    return wiring.Signature({
        "sel": Out(1),
        "we": Out(1),
        "re": Out(1),
        "addr": Out(16),
        "wdata": Out(32),
        "rdata": In(32),
    })


class CU_MAP:
    """Word addresses of a compute unit's configuration space."""

    #: Instruction ``pc`` is at ``PROGRAM + 2*pc`` (low 32 bits) and ``+ 1`` (high 32 bits).
    PROGRAM = 0x0000
    #: Initial value of register ``r`` (loaded into the register file at start).
    REGS = 0x2000
    #: Bit 0: the CU takes part in the run (a disabled CU reports done at once).
    CONTROL = 0x3000
    #: Read-only status: bit 0 done, bit 1 error, bits 15:8 error code, bits 31:16 pc.
    STATUS = 0x3001
    #: Read-only counter: cycles stalled in WAIT or RECV (waiting for another CU's token or
    #: reference; part of ``stall_cycles``), reset by start.
    WAIT_CYCLES = 0x3006
    #: Lane ``l`` of local vector word ``w`` is at ``LOCAL + w*lanes + l``.
    LOCAL = 0x8000


class MU_MAP:
    """Word addresses of a memory unit's configuration space (all read-only)."""

    STATUS = 0x3001
    HELD_WORDS = 0x3010
    #: Peak of HELD_WORDS since the last START (since reset before the first).
    PEAK_HELD_WORDS = 0x3011
    LIVE_BUFFERS = 0x3012
    ALLOCS = 0x3013
    FREES = 0x3014
    COPY_CYCLES = 0x3015
    BUSY_CYCLES = 0x3016
    FREE_BLOCKS = 0x3017
    #: Only in a fabric built with ``stamps=True`` (``docs/race.md``), else 0: the tile's
    #: cycle counter (cycles since reset) when it last answered a READ with OK, and when its
    #: FREES counter last rose.
    LAST_READ_CYCLE = 0x3018
    LAST_FREE_CYCLE = 0x3019


#: Counters every tile has (read-only), with their addresses.
TILE_COUNTERS = {
    "busy_cycles": 0x3002,
    "stall_cycles": 0x3003,
    "flits_out": 0x3004,
    "flits_in": 0x3005,
}

#: A CU's cycle-accounting counters (read-only, reset by start), with their addresses: every
#: cycle the CU runs is counted in exactly one category, the first that applies in this order
#: (``docs/compute-unit.md``, Profile):
#:
#: ``step_cycles``: the stream engine executed a step (useful work);
#: ``wait_cycles``: WAIT or RECV, waiting for another CU's token or reference
#: (``CU_MAP.WAIT_CYCLES``);
#: ``fence_cycles``: a fence (SEND, SENDREF, HALT, FADD, UNLOCK) waiting for posted writes;
#: ``mu_cycles``: a blocking MU instruction waiting for its response, or an instruction
#: waiting for a non-blocking one's (ALLOC, READ, LEN: its register, or one at a time);
#: ``stream_idle_cycles``: the sequencer waits for a stream in the engine (a second SRUN, an
#: instruction touching what the stream uses: ``STREAM_HAZARDS``, a register of its reduction)
#: and the stream executes no step
#: (its start-up, the first round trip, starvation, the tail);
#: ``instr_cycles``: an instruction retired (scalar, SCFG, branch, message, posted request);
#: and ``other_cycles``, what is left of ``busy_cycles`` (the message or request register
#: busy), which the host computes.
CU_PROFILE = {
    "step_cycles": 0x3007,
    "wait_cycles": CU_MAP.WAIT_CYCLES,
    "fence_cycles": 0x3008,
    "mu_cycles": 0x3009,
    "stream_idle_cycles": 0x300a,
    "instr_cycles": 0x300b,
}

#: Error codes a CU reports in STATUS bits 15:8.
CU_STATUS_BITS = {
    "NONE": 0,
    "MU_ERROR": 1,          # an MU answered with a status other than OK
    "BAD_INSTRUCTION": 2,   # an undefined opcode
    "PC_OUT_OF_RANGE": 3,   # the pc left the program memory
    "MAILBOX_OVERFLOW": 4,  # a reference arrived at a full mailbox slot
    "TOKEN_OVERFLOW": 5,    # a token counter passed 65535
    "BAD_STREAM": 6,        # a stream configuration that cannot run (N or OUTER zero, ...)
    "BAD_DESTINATION": 7,   # a request to a tile that is not an MU, a message to one not a CU
    "QUEUE_OVERFLOW": 8,    # a stream word found the input queue full, or credits passed its depth
}

#: A CU's STATUS word (``CU_MAP.STATUS``), first field in bit 0: ``done`` (not running:
#: halted, failed or disabled), ``error`` (halted on an error), ``code`` (one of
#: :data:`CU_STATUS_BITS`), ``pc`` (the pc of the instruction that halted). The RTL builds it
#: with ``CU_STATUS.const``-compatible fields; the interpreter and the host use
#: :func:`cu_status_word` and :func:`decode_cu_status`.
CU_STATUS = data.StructLayout({"done": 1, "error": 1, "reserved": 6, "code": 8, "pc": 16})


def cu_status_word(*, done, error, code, pc):
    """The STATUS word of a CU with these fields (``code`` and ``pc`` truncated to their
    widths, as the RTL does)."""
    return CU_STATUS.const({"done": int(done), "error": int(error), "code": code & 0xff,
                            "pc": pc & 0xffff}).as_value().value


def decode_cu_status(word):
    """The fields of a CU's STATUS word as a dict of ints: ``done``, ``error``, ``error_code``
    and ``pc`` (the keys the host's counters use)."""
    c = data.Const(CU_STATUS, word & 0xffff_ffff)
    return {"done": c.done, "error": c.error, "error_code": c.code, "pc": c.pc}


#: Bits of the word the host port's STATUS command returns.
STATUS_BITS = {"configured": 0, "running": 1, "done": 2, "error": 3, "load_error": 4,
               "misrouted": 5}
