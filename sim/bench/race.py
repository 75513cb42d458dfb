"""Race injection on the full fabric: reference counting schemes under random link delays.

The seed paper's Figure 1(b) race, played by CU programs on a whole fabric whose NoC links
stall at random (``Fabric(..., jitter=True)``): a holder passes a reference to another CU and
drops its own; with plain counters the receiver's INCREF travels a longer path (holder →
receiver → MU) than the holder's DECREF (holder → MU) and can arrive after it, freeing the
buffer while the receiver still holds it. See ``docs/race.md`` for the schemes, the programs, the
detection and the measured table.

A :class:`Scenario` is one random case: scheme, holder tree (``pair`` A→B, ``chain`` A→B→C,
``fanout`` A→{B, C}), which CU plays which holder, per-holder delays and reads, the initial
weight and ADD_WEIGHT amounts (partial-free), the MU's weight bits, and the jitter seed and
rate. :func:`race_job` turns it into a :class:`~rdakit.compiler.job.Job`;
:func:`run_scenario` runs it on a fabric's Verilog under cocotb and classifies the outcome;
:func:`summarize` makes the per-scheme table of ``rdakit bench race``.
"""

import dataclasses
import json
import pathlib
import random
import tempfile

import numpy as np

from rdakit.compiler.job import HostBuffer, Job, Ref
from rdakit.hdl.fabric.config_loader import LoadStatus
from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig, write_bitstream
from rdakit.hdl.spec.config import CU_MAP, CU_STATUS_BITS, MU_MAP, TILE_COUNTERS, decode_cu_status
from rdakit.hdl.spec.isa import assemble
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.models.interp import DeadlockError
from rdakit.sim.runtime.job import prepare_interp
from rdakit.sim.verify.runner import run_cocotb

__all__ = ["SCHEMES", "TOPOLOGIES", "WEIGHT_BITS", "COUNTER_WEIGHT_BITS", "RACE_FABRIC",
           "Scenario", "make_scenario", "race_params", "race_job", "expected_messages",
           "classify", "run_interp", "run_scenario", "build_key", "summarize", "BAD_PC"]

#: Reference-counting schemes: counters without gating (the positive control), counters with
#: the copier's INCREF acknowledged before it sends the reference, counters with the receiver's
#: INCREF acknowledged by a token before the sender drops its count, and partial-free.
SCHEMES = ("counter", "gated", "token", "partial")
TOPOLOGIES = ("pair", "chain", "fanout")
#: Weight bits of the partial-free builds (scenarios cycle through them).
WEIGHT_BITS = (2, 3, 4)
#: Count bits of the counter build.
COUNTER_WEIGHT_BITS = 4
#: The fabric: 2x2, CUs at (0, 0), (1, 0), (0, 1), the MU at (1, 1); one 32-bit lane.
RACE_FABRIC = dict(rows=2, cols=2, layout="CC/CM", lanes=1, prog_len=64, local_words=1,
                   outstanding=2, mu_words=64, block_words=8, max_buffers=4)
#: Where a holder jumps when a word it read differs from what the host wrote (the CU halts
#: with PC_OUT_OF_RANGE and this pc).
BAD_PC = 0xBAD0
#: Words of the shared buffer.
WORDS = 4

_CHILDREN = {"pair": {0: [1]}, "chain": {0: [1], 1: [2]}, "fanout": {0: [1, 2]}}


def race_params(refcount, weight_bits):
    """The :class:`~rdakit.hdl.spec.params.FabricParams` of the race fabric."""
    return fabric_params(**RACE_FABRIC, refcount=refcount, weight_bits=weight_bits)


def build_key(scheme, weight_bits):
    """``(refcount, weight_bits)``: the build a scenario runs on."""
    if scheme == "partial":
        return "weighted", weight_bits
    return "counter", COUNTER_WEIGHT_BITS


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One random race case (see the module docstring)."""

    index: int
    scheme: str
    topology: str
    holders: tuple           # (x, y) of holder 0 (A), 1 (B), 2 (C) as used
    delays: tuple            # per holder: cycles of work between passing on and dropping
    reads: tuple             # per holder: word indices it reads (and checks)
    data: tuple              # the buffer's words
    weight: int              # partial: the initial weight A holds (counter: 1)
    addw: tuple              # partial: per holder, the ADD_WEIGHT amount when its share is 1
    weight_bits: int
    jitter_seed: int
    jitter_rate: int

    def children(self, h):
        return _CHILDREN[self.topology].get(h, [])

    def parent(self, h):
        return next((p for p, cs in _CHILDREN[self.topology].items() if h in cs), None)

    @property
    def copies(self):
        return len(self.holders) - 1

    def as_dict(self):
        return dataclasses.asdict(self)


def make_scenario(scheme, index, *, seed=0, weight_bits=None, max_delay=24):
    """Random scenario number ``index`` of ``scheme`` (deterministic in ``seed``)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, not {scheme!r}")
    rng = random.Random(f"{seed}:{scheme}:{index}")
    topology = rng.choice(TOPOLOGIES)
    n = 2 if topology == "pair" else 3
    cus = [(0, 0), (1, 0), (0, 1)]
    rng.shuffle(cus)
    holders = tuple(cus[:n])
    if scheme == "partial":
        wb = weight_bits or WEIGHT_BITS[index % len(WEIGHT_BITS)]
    else:
        wb = COUNTER_WEIGHT_BITS
    max_weight = (1 << wb) - 1
    copies = n - 1
    # Each copy adds weight at most once (its giver's ADD_WEIGHT amount), so the total stays
    # within weight_bits when W + sum of those amounts <= max_weight.
    weight = rng.randint(1, max_weight - copies) if scheme == "partial" else 1
    slack = max_weight - weight - copies
    addw = tuple(1 + rng.randint(0, slack // copies) for _ in range(n))
    data = tuple(rng.getrandbits(32) for _ in range(WORDS))
    return Scenario(
        index=index, scheme=scheme, topology=topology, holders=holders,
        delays=tuple(rng.randint(0, max_delay) for _ in range(n)),
        reads=tuple(tuple(rng.sample(range(WORDS), rng.randint(1, 2))) for _ in range(n)),
        data=data, weight=weight, addw=addw, weight_bits=wb,
        jitter_seed=rng.getrandbits(32), jitter_rate=rng.choice([0, 32, 64, 96, 128, 160, 192]))


def _cu_id(params, xy):
    return params.mu_id(*xy)      # a CU's ID is its coordinates, like an MU's


def _program(params, sc, h):
    """Assembly of holder ``h``. Registers: r1 the reference, r2 its weight (partial), r11 the
    delay + 1 (from the bitstream), r3..r10 scratch."""
    scheme = sc.scheme
    counter = scheme != "partial"
    lines = []
    read_lines = []
    for j in sc.reads[h]:
        read_lines += [f"LI r7, {j}", "READ 0, r8, r1, r7", f"LI r9, {sc.data[j]}",
                       "ALU XOR, r8, r8, r9", "BNZ r8, bad"]
    if h == 0:
        lines += read_lines            # A uses the buffer before passing it on
    else:
        lines.append("RECV 0, r1")     # r1 = reference, r2 = its weight
        if scheme == "token":
            lines += ["INCREF r1", f"LI r4, {_cu_id(params, sc.holders[sc.parent(h)])}",
                      "SEND 0, r4, 1"]  # acknowledged: the sender may drop its count now
    for k, c in enumerate(sc.children(h)):
        dst = _cu_id(params, sc.holders[c])
        if scheme == "gated":
            lines.append("INCREF r1")  # blocking: its response is the acknowledgement
        if counter:
            lines += [f"LI r4, {dst}", "SENDREF 0, r4, r1, r0"]
        else:
            lines += [
                "LI r9, 1",
                f"BLT r9, r2, split{k}",           # weight > 1: split it
                f"ADDW r1, {sc.addw[h]}",          # weight exhausted: mint more
                f"ALUI ADD, r2, r2, {sc.addw[h]}",
                f"split{k}:",
                "ALUI SHRU, r3, r2, 1",            # give half, keep the rest
                "ALU SUB, r2, r2, r3",
                f"LI r4, {dst}",
                "SENDREF 0, r4, r1, r3",
            ]
    if h != 0 and scheme == "counter":
        # No gating: nobody waits for this. (It comes after passing the reference on, so a
        # holder whose INCREF fails never leaves its children waiting.)
        lines.append("INCREF r1")
    lines += ["work:", "LOOP r11, work"]
    if h != 0:
        lines += read_lines
    if scheme == "token" and sc.children(h):
        lines.append(f"WAIT 0, {len(sc.children(h))}")
    lines += ["DECREF r1" if counter else "RET r1, r2", "HALT", f"bad: JMP {BAD_PC}"]
    return "\n".join(lines)


def race_job(params, sc):
    """The :class:`~rdakit.compiler.job.Job` of scenario ``sc`` on ``params`` (a race fabric
    of the scenario's build): the host allocates the buffer with weight ``sc.weight`` (count 1)
    and hands all of it to holder A."""
    mu = params.tiles("M")[0]
    data = np.array(sc.data, dtype=np.uint32).astype(np.int32).reshape(-1, 1)
    weight = sc.weight if sc.scheme == "partial" else 1
    buf = HostBuffer("buf", mu, data, weight=weight, cu_returns=weight)
    tiles = {}
    for h, xy in enumerate(sc.holders):
        regs = {11: sc.delays[h] + 1}
        if h == 0:
            regs.update({1: Ref("buf"), 2: weight})
        tiles[xy] = TileConfig(program=assemble(_program(params, sc, h)), regs=regs)
    return Job(FabricConfig(params, tiles), [buf], [], {}, cus_used=len(sc.holders),
               description=f"race {sc.scheme} {sc.topology} #{sc.index}")


def _addw_count(sc):
    """ADD_WEIGHTs of a partial-free scenario (the weights flow the same under any timing)."""
    w = {0: sc.weight}
    n = 0
    for h in range(len(sc.holders)):          # parents come before their children
        for c in sc.children(h):
            if w[h] == 1:
                w[h] += sc.addw[h]
                n += 1
            w[c] = w[h] >> 1
            w[h] -= w[c]
    return n


def expected_messages(sc):
    """What a run without a premature free sends: ``{"reads", "refcount", "addw", "refs",
    "tokens"}`` (MU requests: reads and reference counting; CU to CU: references and
    tokens). Every MU request also gets one response."""
    n = len(sc.holders)
    reads = sum(len(r) for r in sc.reads)
    if sc.scheme == "partial":
        addw = _addw_count(sc)
        refcount = n + addw                       # one RETURN a holder, the ADD_WEIGHTs
    else:
        addw = 0
        refcount = sc.copies + n                  # one INCREF a copy, one DECREF a holder
    tokens = sc.copies if sc.scheme == "token" else 0
    return {"reads": reads, "refcount": refcount, "addw": addw, "refs": sc.copies,
            "tokens": tokens}


def classify(sc, cu_status, mu):
    """Outcome of a run from the CUs' STATUS words (``{(x, y): word}``) and the MU's
    counters after it (``frees``, ``live_buffers``, ``last_read``, ``last_free``): a dict
    with ``premature`` (a holder used the buffer after it was freed: an MU error, i.e. BAD_REF
    of a stale reference, or a word that differs), ``leak`` (a buffer still live), ``double``
    (freed more than once), ``other_error`` (any other CU error) and ``free_before_use`` (the
    MU's free stamp before its last good READ)."""
    premature = other = 0
    for xy in sc.holders:
        st = decode_cu_status(cu_status[xy])
        if not st["error"]:
            continue
        code, pc = st["error_code"], st["pc"]
        if code == CU_STATUS_BITS["MU_ERROR"] or (
                code == CU_STATUS_BITS["PC_OUT_OF_RANGE"] and pc == BAD_PC):
            premature += 1
        else:
            other += 1
    early = int(mu["frees"] > 0 and mu["last_free"] < mu["last_read"])
    return {"premature": int(premature > 0 or early), "failed_holders": premature,
            "other_error": other, "leak": int(mu["live_buffers"] != 0),
            "double": int(mu["frees"] > 1), "missing_free": int(mu["frees"] == 0),
            "free_before_use": early}


def run_interp(sc, *, seed=0):
    """Run ``sc`` on the functional interpreter with a random schedule (no time: only the
    interleaving of the CUs varies). Returns ``(classify(...), interpreter)``; the MU stamps
    are not modelled (``last_read`` = ``last_free`` = 0)."""
    params = race_params(*build_key(sc.scheme, sc.weight_bits))
    interp, _ = prepare_interp(race_job(params, sc), schedule="random", seed=seed)
    try:
        result = interp.run(max_steps=100_000)
        hung = 0
    except DeadlockError as e:
        result, hung = e.result, 1
    mu_model = interp.mu(*params.tiles("M")[0])
    status = {xy: result.cu(*xy).status for xy in sc.holders}
    mu = {"frees": mu_model.frees, "live_buffers": len(mu_model.live_buffers()),
          "last_read": 0, "last_free": 0}
    return {**classify(sc, status, mu), "hung": hung}, interp


async def run_scenario(dut, host, params, sc, *, reset, max_cycles=20_000):
    """Run ``sc`` on a race fabric's Verilog under cocotb (built with ``jitter`` and
    ``stamps``): reset (``reset()``), fill, load, start with the scenario's jitter, wait,
    and read the outcome. Returns the row of :func:`summarize`."""
    job = race_job(params, sc)
    dut.jitter_rate.value = 0
    dut.jitter_seed.value = sc.jitter_seed
    await reset()
    buf = job.buffers[0]
    ref = await host.alloc(buf.mu, buf.weight)
    await host.append_vectors(ref, buf.data)
    status, _ = await host.load(write_bitstream(job.bind({"buf": ref})))
    if status is not LoadStatus.OK:
        raise RuntimeError(f"race bitstream rejected: {status.name}")
    mx, my = buf.mu
    before = await host.cfg_read(mx, my, TILE_COUNTERS["flits_in"])
    dut.jitter_rate.value = sc.jitter_rate
    await host.start()
    try:
        # A holder's error is an outcome to classify once the others have run to the end.
        await host.wait_done(max_cycles=max_cycles, poll=16, stop_on_error=False)
        hung = 0
    except TimeoutError:           # a holder waits for a message a failed holder never sent
        hung = 1
    dut.jitter_rate.value = 0
    cycles = await host.run_cycles()
    cu_status, cu_out = {}, 0
    for xy in sc.holders:
        cu_status[xy] = await host.cfg_read(*xy, CU_MAP.STATUS)
        cu_out += await host.cfg_read(*xy, TILE_COUNTERS["flits_out"])
    mu = {name: await host.cfg_read(mx, my, addr) for name, addr in (
        ("frees", MU_MAP.FREES), ("live_buffers", MU_MAP.LIVE_BUFFERS),
        ("last_read", MU_MAP.LAST_READ_CYCLE), ("last_free", MU_MAP.LAST_FREE_CYCLE),
        ("flits_in", TILE_COUNTERS["flits_in"]))}
    mu_requests = mu.pop("flits_in") - before
    row = {"index": sc.index, "scheme": sc.scheme, "topology": sc.topology,
           "weight_bits": sc.weight_bits, "jitter_rate": sc.jitter_rate, "holders": len(
               sc.holders), "copies": sc.copies, "cycles": cycles,
           "mu_requests": mu_requests, "cu_messages": cu_out - mu_requests, "hung": hung,
           **mu,
           **classify(sc, cu_status, mu)}
    exp = expected_messages(sc)
    row.update({f"expected_{k}": v for k, v in exp.items()})
    clean = not (row["premature"] or row["other_error"] or row["leak"] or row["double"]
                 or row["missing_free"] or hung)
    row["clean"] = int(clean)
    row["latency"] = mu["last_free"] - mu["last_read"] if clean else None
    return row


def _stats(values):
    if not values:
        return None, None, None
    a = np.array(values)
    return float(a.mean()), float(np.percentile(a, 50)), int(a.max())


def summarize(rows):
    """Per-scheme table of run rows: scenarios, premature frees, leaks, double frees, other
    errors, reference-counting messages, last-use → free latency, ADD_WEIGHTs, run cycles."""
    out = []
    for scheme in SCHEMES:
        rs = [r for r in rows if r["scheme"] == scheme]
        if not rs:
            continue
        clean = [r for r in rs if r["clean"]]
        copies = sum(r["copies"] for r in clean) or 1
        refcount = sum(r["mu_requests"] - r["expected_reads"] for r in clean)
        tokens = sum(r["cu_messages"] - r["expected_refs"] for r in clean)
        # Beyond the one release (DECREF or RETURN) every holder needs under every scheme.
        extra = refcount + tokens - sum(r["holders"] for r in clean)
        mean, p50, mx = _stats([r["latency"] for r in clean])
        out.append({
            "scheme": scheme, "scenarios": len(rs),
            "racing": sum(r["premature"] for r in rs),
            "premature_frees": sum(r["premature"] for r in rs),
            "leaks": sum(r["leak"] for r in rs), "double_frees": sum(r["double"] for r in rs),
            "other_errors": sum(r["other_error"] for r in rs),
            "hung": sum(r["hung"] for r in rs),
            "msgs_per_scenario": (refcount + tokens) / max(len(clean), 1),
            "extra_msgs_per_copy": extra / copies,
            "addw": sum(r["expected_addw"] for r in clean),
            "latency_mean": mean, "latency_p50": p50, "latency_max": mx,
            "cycles_mean": float(np.mean([r["cycles"] for r in clean])) if clean else None,
            "count_mismatches": sum(
                (r["mu_requests"] != r["expected_reads"] + r["expected_refcount"])
                or (r["cu_messages"] != r["expected_refs"] + r["expected_tokens"])
                for r in clean),
        })
    for r in out:
        del r["racing"]
    return out


def plan(n, *, schemes=SCHEMES, seed=0, weight_bits=None):
    """``{(refcount, weight_bits): [(scheme, index), ...]}``: ``n`` scenarios of every scheme,
    grouped by the build they run on (partial-free on ``weight_bits`` only, if given)."""
    groups = {}
    for scheme in schemes:
        for i in range(n):
            sc = make_scenario(scheme, i, seed=seed, weight_bits=weight_bits)
            groups.setdefault(build_key(scheme, sc.weight_bits), []).append((scheme, i))
    return dict(sorted(groups.items()))


def run_race(n, *, simulator="verilator", schemes=SCHEMES, seed=0, weight_bits=None,
             optimize=False, workdir=None):
    """Run ``n`` scenarios of every scheme in ``schemes`` on ``simulator`` (one build per
    refcount mode and weight bits; partial-free only on ``weight_bits`` if given); return the
    rows of every scenario."""
    rows = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        groups = plan(n, schemes=schemes, seed=seed, weight_bits=weight_bits)
        for (refcount, wb), scenarios in groups.items():
            out = pathlib.Path(tmp) / f"{refcount}-{wb}.json"
            run_cocotb(Fabric(race_params(refcount, wb), jitter=True, stamps=True),
                       simulator=simulator, test_module="race_tb",
                       test_dir=pathlib.Path(__file__).parent,
                       build_name=f"race-{refcount}-w{wb}{'-opt' if optimize else ''}",
                       optimize=optimize,
                       config={"refcount": refcount, "weight_bits": wb, "seed": seed,
                               "partial_weight_bits": weight_bits, "scenarios": scenarios,
                               "out": str(out)})
            rows += json.loads(out.read_text())
    return rows
