"""The compute unit's instruction set: the one definition of opcodes, fields and encodings.

The RTL decoder, the functional interpreter (:mod:`rdakit.sim.models.interp`), the compiler's code
generator, the bitstream disassembler and the table in ``docs/compute-unit.md`` all come from
here. An instruction is 64 bits (first field in the low bits)::

    [5:0] op   [9:6] rd   [13:10] ra   [17:14] rb   [21:18] fn   [31:22] aux   [63:32] imm

Registers are 32-bit scalars ``r0`` .. ``r{regs-1}``; ``V`` is the CU's staging vector (one
vector word, ``lanes`` 32-bit elements). Memory is reached through references held in
registers: a reference is ``{mu, buf}`` packed as in :func:`~rdakit.hdl.spec.packets.ref_layout`
(``mu`` in the low bits), and an MU's ID is its tile's coordinates (``y << coord_bits | x``, with
the cluster above them in a system of clusters), so the CU routes a request from the reference
alone.
"""

import dataclasses
import re

from amaranth.lib import data, enum

__all__ = [
    "Op", "AluFn", "StreamField", "Post", "post", "SAT8_MIN", "SAT8_MAX", "BMode", "DMode",
    "INSTR_LAYOUT", "INSTR_BITS", "OP_INFO",
    "Instr", "encode", "decode", "assemble", "disassemble", "alu", "AssemblyError",
]

INSTR_BITS = 64

#: The instruction word.
INSTR_LAYOUT = data.StructLayout({
    "op": 6, "rd": 4, "ra": 4, "rb": 4, "fn": 4, "aux": 10, "imm": 32,
})


class Op(enum.Enum, shape=6):
    """Opcodes."""

    NOP = 0
    HALT = 1
    LI = 2
    ALU = 3
    ALUI = 4
    JMP = 5
    BNZ = 6
    BZ = 7
    BLT = 8
    LOOP = 9
    ALLOC = 10
    READ = 11
    VREAD = 12
    VWRITE = 13
    VAPPEND = 14
    VSET = 15
    VCLR = 16
    LEN = 17
    RET = 18
    RETI = 19
    ADDW = 20
    INCREF = 21
    DECREF = 22
    SEND = 23
    WAIT = 24
    SENDREF = 25
    RECV = 26
    SCFG = 27
    SCFGI = 28
    SRUN = 29
    SELF = 30
    FADD = 31
    UNLOCK = 32
    LGET = 33
    LSET = 34


class AluFn(enum.Enum, shape=4):
    """Functions of the scalar ALU and of every lane of the stream datapath (32-bit, two's
    complement, results wrap modulo 2**32)."""

    ADD = 0
    SUB = 1
    MUL = 2      #: low 32 bits of the product
    AND = 3
    OR = 4
    XOR = 5
    SHL = 6      #: a << (b & 31)
    SHR = 7      #: arithmetic a >> (b & 31)
    SHRU = 8     #: logical a >> (b & 31)
    MIN = 9      #: signed
    MAX = 10     #: signed
    SLT = 11     #: 1 if a < b (signed) else 0
    SEQ = 12     #: 1 if a == b else 0
    RELU = 13    #: max(a, 0)
    PASS = 14    #: a
    SEL = 15     #: a if b != 0 else 0


class StreamField(enum.Enum, shape=4):
    """Stream configuration registers, written by SCFG/SCFGI and used by SRUN.

    A stream runs ``OUTER`` times an inner loop of ``N`` steps. Step ``(o, i)`` reads vector
    word ``A_BASE + o*A_OSTRIDE + i*A_STRIDE`` of buffer ``A_REF``; its second operand is
    chosen by ``B_MODE``; the result of every lane is
    ``post(fn(a, b) >> SHIFT)`` (arithmetic shift; ``post``, by the bits of ``POST``
    (:class:`Post`): ReLU, then saturation to int8, :func:`post`); ``D_MODE`` says where
    results go. ``k`` counts steps over the whole stream. In ``PACK_SUM`` a step's result is
    ``fn(a, b)`` and ``SHIFT`` and ``POST`` apply to each inner loop's sum instead (a
    matmul's requantization, ``clip(relu(sum >> s))``, in the stream that computes it); in
    ``OUTER_SUM``, to each sum over the outer loop.

    An ``A_REF`` whose low ``2 * coord_bits`` bits are this CU's own ID (``SELF``) names no
    MU buffer but the CU's *input queue*: operand A of each step is the next word another CU's
    stream sent it (``DMode.QUEUE``), ``A_BASE``, ``A_STRIDE`` and ``A_OSTRIDE`` are unused,
    and the stream ends early after the step that takes a word marked as its producer's last
    (end of stream); such a stream writes the number of steps it ran to the first register
    after those its reduction writes (``r[rd]``, or ``r[rd+1]`` for SUM and MAX, ``r[rd+2]``
    for ARGMAX).
    """

    A_REF = 0
    A_BASE = 1
    A_STRIDE = 2
    A_OSTRIDE = 3
    N = 4
    OUTER = 5
    B_MODE = 6
    B_VAL = 7
    B_STRIDE = 8
    B_OSTRIDE = 9
    D_MODE = 10
    D_REF = 11
    D_BASE = 12
    D_STRIDE = 13
    SHIFT = 14
    POST = 15


#: The range ``Post.SAT8`` clamps a result to (int8).
SAT8_MIN, SAT8_MAX = -128, 127


class Post(enum.IntFlag):
    """Bits of the ``POST`` stream field: what follows a result's ``SHIFT``, in this order."""

    RELU = 1     #: max(v, 0)
    SAT8 = 2     #: clamp to [-128, 127] (int8)


def post(v, shift, bits):
    """Reference semantics of a stream's output stage on one signed value: ``v >> shift``
    (arithmetic, ``shift`` modulo 32), then ReLU if ``bits & Post.RELU``, then saturation to
    int8 if ``bits & Post.SAT8``; a signed result."""
    v >>= shift & 31
    if bits & Post.RELU and v < 0:
        v = 0
    if bits & Post.SAT8:
        v = min(max(v, SAT8_MIN), SAT8_MAX)
    return v


class BMode(enum.Enum, shape=2):
    """Second operand of a stream step."""

    ZERO = 0     #: b = 0
    LOCAL = 1    #: b = local[B_VAL + o*B_OSTRIDE + i*B_STRIDE]
    SCALAR = 2   #: b = B_VAL in every lane
    ELEM = 3     #: b = element e = B_VAL + o*B_OSTRIDE + i*B_STRIDE of the local buffer in
    #:              every lane (lane e mod lanes of word e / lanes, as LGET names it): a
    #:              scalar per step, such as attention's p[o] times row o of V


class DMode(enum.Enum, shape=4):
    """Destination of a stream's results."""

    DISCARD = 0
    WRITE = 1      #: WRITE word D_BASE + k*D_STRIDE of D_REF
    APPEND = 2     #: APPEND to D_REF
    LOCAL = 3      #: local[D_BASE + k*D_STRIDE] = result
    LOCAL_ACC = 4  #: local[D_BASE + k*D_STRIDE] += result (lane-wise)
    SUM = 5        #: rd = sum of every lane of every result
    MAX = 6        #: rd = largest element (signed)
    ARGMAX = 7     #: rd = largest element, r[rd+1] = its index k*lanes + lane (first one)
    PACK_SUM = 8   #: per outer iteration, the sum of its results (then SHIFT and POST) goes to
    #:              the next lane of V; a full V is appended to D_REF, and a partial one at
    #:              the end (zero-padded)
    QUEUE = 9      #: each result goes to the input queue of the CU whose ID is D_REF (as SEND
    #:              names it), one credit a word; the stream's last result is marked last
    OUTER_SUM = 10  #: per inner step i, its results added up over the outer loop (lane-wise)
    #:               in local word D_BASE + i*D_STRIDE (the first outer iteration writes
    #:               it); the last outer iteration appends the sums to D_REF instead, through
    #:               SHIFT and POST (a row of scalars times a matrix, sum_o b_o * A row o,
    #:               requantized, in one stream); a stream reading the input queue that
    #:               ends before its last outer iteration appends nothing


#: Per opcode: (assembly syntax, semantics, cycles). The docs table is generated from this.
OP_INFO = {
    Op.NOP: ("NOP", "nothing", "1"),
    Op.HALT: ("HALT", "stop; the CU reports done", "1"),
    Op.LI: ("LI rd, imm", "rd = imm", "1"),
    Op.ALU: ("ALU fn, rd, ra, rb", "rd = fn(ra, rb)", "1"),
    Op.ALUI: ("ALUI fn, rd, ra, imm", "rd = fn(ra, imm)", "1"),
    Op.JMP: ("JMP imm", "pc = imm", "1"),
    Op.BNZ: ("BNZ ra, imm", "if ra != 0: pc = imm", "1"),
    Op.BZ: ("BZ ra, imm", "if ra == 0: pc = imm", "1"),
    Op.BLT: ("BLT ra, rb, imm", "if ra < rb (signed): pc = imm", "1"),
    Op.LOOP: ("LOOP ra, imm", "ra = ra - 1; if ra != 0: pc = imm", "1"),
    Op.ALLOC: ("ALLOC rd, ra, imm", "rd = new buffer in the MU whose ID is ra, total weight imm",
               "1; rd a round trip later"),
    Op.READ: ("READ fn, rd, ra, rb", "rd = lane fn of word rb of buffer ra",
              "1; rd a round trip later"),
    Op.VREAD: ("VREAD ra, rb", "V = word rb of buffer ra", "1 + round trip"),
    Op.VWRITE: ("VWRITE ra, rb", "word rb of buffer ra = V", "1 + round trip"),
    Op.VAPPEND: ("VAPPEND rd, ra", "append V to buffer ra; rd = its index", "1 + round trip"),
    Op.VSET: ("VSET fn, ra", "lane fn of V = ra", "1"),
    Op.VCLR: ("VCLR", "V = 0", "1"),
    Op.LEN: ("LEN rd, ra", "rd = length of buffer ra (words)", "1; rd a round trip later"),
    Op.RET: ("RET ra, rb", "return weight rb of buffer ra (partial-free)", "1 + round trip"),
    Op.RETI: ("RETI ra, imm", "return weight imm of buffer ra", "1 + round trip"),
    Op.ADDW: ("ADDW ra, imm", "add weight imm to buffer ra's total", "1 + round trip"),
    Op.INCREF: ("INCREF ra", "count of buffer ra + 1 (counter baseline)", "1 + round trip"),
    Op.DECREF: ("DECREF ra", "count of buffer ra - 1 (counter baseline)", "1 + round trip"),
    Op.SEND: ("SEND aux, ra, imm", "send imm tokens on channel aux to the CU whose ID is ra",
              "1"),
    Op.WAIT: ("WAIT aux, imm", "wait until channel aux has imm tokens; take them",
              "1 + waiting"),
    Op.SENDREF: ("SENDREF aux, rd, ra, rb",
                 "send reference ra with weight rb to mailbox slot aux of the CU whose ID is rd",
                 "1"),
    Op.RECV: ("RECV aux, rd", "wait for mailbox slot aux; rd = its reference, r[rd+1] = its "
                              "weight; empty the slot", "1 + waiting"),
    Op.SCFG: ("SCFG fn, ra", "stream field fn = ra", "1"),
    Op.SCFGI: ("SCFGI fn, imm", "stream field fn = imm", "1"),
    Op.SRUN: ("SRUN fn, rd", "run the configured stream with function fn (see D_MODE for rd; "
                             "a stream reading the input queue writes its step count after)",
              "1; the stream then runs in the engine beside the next instructions: N*OUTER "
              "steps, 1 a cycle reading, 2 a cycle writing to an MU, + round trip"),
    Op.SELF: ("SELF rd", "rd = this CU's ID (y << coord_bits | x)", "1"),
    Op.FADD: ("FADD rd, ra, rb, imm",
              "atomically: rd = lane 0 of word rb of buffer ra, and that word += imm "
              "(sign-extended to the word)", "1 + round trip"),
    Op.UNLOCK: ("UNLOCK rd, ra, rb",
                "release the ticket lock whose served ticket is word rb of buffer ra, holding "
                "ticket rd (MU_ERROR, NOT_OWNER, if rd is not the one served)",
                "1 + round trip"),
    Op.LGET: ("LGET rd, rb, imm", "rd = element r[rb] + imm of the local buffer "
                                  "(lane e mod lanes of word e / lanes)", "2"),
    Op.LSET: ("LSET ra, rb, imm", "element r[rb] + imm of the local buffer = ra", "1"),
}


class AssemblyError(ValueError):
    """An instruction that cannot be encoded, or assembly text that cannot be parsed."""


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction with its fields as integers (``imm`` may be negative)."""

    op: Op
    rd: int = 0
    ra: int = 0
    rb: int = 0
    fn: int = 0
    aux: int = 0
    imm: int = 0

    def __post_init__(self):
        if not isinstance(self.op, Op):
            raise AssemblyError(f"op must be an Op, not {self.op!r}")
        for name, width in (("rd", 4), ("ra", 4), ("rb", 4), ("fn", 4), ("aux", 10)):
            v = int(getattr(self, name))
            if not 0 <= v < 1 << width:
                raise AssemblyError(f"{name} of {self.op.name} must be between 0 and "
                                    f"{(1 << width) - 1}, not {v!r}")
        if not -(1 << 31) <= int(self.imm) < 1 << 32:
            raise AssemblyError(f"imm of {self.op.name} must fit 32 bits, not {self.imm!r}")
        object.__setattr__(self, "imm", int(self.imm) & 0xffff_ffff)   # stored unsigned

    def __str__(self):
        return disassemble_one(self)


def encode(instr):
    """The 64-bit word of ``instr``."""
    f = INSTR_LAYOUT
    word = 0
    for name in ("rd", "ra", "rb", "fn", "aux"):
        word |= int(getattr(instr, name)) << f[name].offset
    word |= instr.op.value << f["op"].offset
    word |= (int(instr.imm) & 0xffff_ffff) << f["imm"].offset
    return word


#: ``(offset, mask)`` of each field of :data:`INSTR_LAYOUT`, for :func:`decode` (asking the
#: layout for a field's offset and width costs microseconds: the performance model decodes
#: every program at each start).
_FIELDS = {name: (f.offset, (1 << f.width) - 1) for name, f in INSTR_LAYOUT}


def decode(word):
    """The :class:`Instr` of a 64-bit word; raises :class:`AssemblyError` for an unknown
    opcode."""
    def get(name):
        offset, mask = _FIELDS[name]
        return (word >> offset) & mask

    try:
        op = Op(get("op"))
    except ValueError:
        raise AssemblyError(f"Opcode {get('op')} is not defined (word {word:#018x})") from None
    imm = get("imm")
    return Instr(op, get("rd"), get("ra"), get("rb"), get("fn"), get("aux"), imm)


def _signed(v):
    v &= 0xffff_ffff
    return v - (1 << 32) if v & (1 << 31) else v


#: Each ALU function by its value and by itself (``AluFn(fn)`` costs microseconds, and the
#: interpreters call :func:`alu` for every lane of every stream step).
_ALU_FNS = {**{f.value: f for f in AluFn}, **{f: f for f in AluFn}}


def alu(fn, a, b):
    """Reference semantics of an ALU function on 32-bit values (returns an unsigned 32-bit
    integer)."""
    a &= 0xffff_ffff
    b &= 0xffff_ffff
    sa, sb = _signed(a), _signed(b)
    fn = _ALU_FNS.get(fn) or AluFn(fn)
    if fn is AluFn.ADD:
        r = a + b
    elif fn is AluFn.SUB:
        r = a - b
    elif fn is AluFn.MUL:
        r = a * b
    elif fn is AluFn.AND:
        r = a & b
    elif fn is AluFn.OR:
        r = a | b
    elif fn is AluFn.XOR:
        r = a ^ b
    elif fn is AluFn.SHL:
        r = a << (b & 31)
    elif fn is AluFn.SHR:
        r = sa >> (b & 31)
    elif fn is AluFn.SHRU:
        r = a >> (b & 31)
    elif fn is AluFn.MIN:
        r = min(sa, sb)
    elif fn is AluFn.MAX:
        r = max(sa, sb)
    elif fn is AluFn.SLT:
        r = int(sa < sb)
    elif fn is AluFn.SEQ:
        r = int(a == b)
    elif fn is AluFn.RELU:
        r = max(sa, 0)
    elif fn is AluFn.PASS:
        r = a
    else:  # SEL
        r = a if b != 0 else 0
    return r & 0xffff_ffff


# --- Assembly text ---------------------------------------------------------------------------

def _operands(op):
    # Which field each operand of the syntax column of OP_INFO fills.
    syntax = OP_INFO[op][0].split(None, 1)
    return [t.strip() for t in syntax[1].split(",")] if len(syntax) > 1 else []


def _fn_enum(op):
    if op in (Op.ALU, Op.ALUI, Op.SRUN):
        return AluFn
    if op in (Op.SCFG, Op.SCFGI):
        return StreamField
    return None


def disassemble_one(instr):
    names = _operands(instr.op)
    parts = []
    for name in names:
        if name == "fn" and _fn_enum(instr.op) is not None:
            parts.append(_fn_enum(instr.op)(instr.fn).name)
        elif name in ("rd", "ra", "rb"):
            parts.append(f"r{getattr(instr, name)}")
        elif name == "imm":
            parts.append(str(_signed(instr.imm) if instr.imm >= 1 << 31 else instr.imm))
        else:
            parts.append(str(getattr(instr, name)))
    return instr.op.name + (" " + ", ".join(parts) if parts else "")


def disassemble(words):
    """Assembly text of a list of instruction words, one line each, with addresses."""
    return "\n".join(f"{pc:4d}: {decode(w)}" for pc, w in enumerate(words))


_TOKEN = re.compile(r"^r(\d+)$")


def assemble(text):
    """Instructions of assembly text: one instruction a line, ``#`` comments, ``label:`` lines,
    labels usable wherever an immediate is. Returns a list of :class:`Instr`."""
    lines = []
    labels = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        while line and re.match(r"^[A-Za-z_]\w*:", line):
            label, line = line.split(":", 1)
            labels[label] = len(lines)
            line = line.strip()
        if line:
            lines.append((number, line))
    out = []
    for number, line in lines:
        head, _, rest = line.partition(" ")
        try:
            op = Op[head.upper()]
        except KeyError:
            raise AssemblyError(f"line {number}: unknown instruction {head!r}") from None
        args = [a.strip() for a in rest.split(",")] if rest.strip() else []
        names = _operands(op)
        if len(args) != len(names):
            raise AssemblyError(f"line {number}: {op.name} takes {len(names)} operands "
                                f"({OP_INFO[op][0]}), not {len(args)}")
        fields = {}
        for name, arg in zip(names, args, strict=True):
            fields[name] = _operand(op, name, arg, labels, number)
        try:
            out.append(Instr(op, **fields))
        except AssemblyError as e:
            raise AssemblyError(f"line {number}: {e}") from None
    return out


def _operand(op, name, arg, labels, number):
    if name in ("rd", "ra", "rb"):
        m = _TOKEN.match(arg)
        if not m:
            raise AssemblyError(f"line {number}: {name} of {op.name} must be a register r0.."
                                f"r15, not {arg!r}")
        return int(m.group(1))
    if name == "fn" and _fn_enum(op) is not None and not arg.lstrip("-").isdigit():
        try:
            return _fn_enum(op)[arg.upper()].value
        except KeyError:
            raise AssemblyError(f"line {number}: {arg!r} is not a {_fn_enum(op).__name__}") \
                from None
    if arg in labels:
        return labels[arg]
    try:
        return int(arg, 0)
    except ValueError:
        raise AssemblyError(f"line {number}: {name} of {op.name} must be a number or a label, "
                            f"not {arg!r}") from None
