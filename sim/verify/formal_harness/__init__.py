"""Formal harnesses: the properties of the memory unit, the router, reference counting and the
board link's frame receiver.

Each :class:`Property` names a harness (an elaboratable holding the design under proof, an
environment of ``Assume``/``AnySeq`` inputs and the ``Assert`` statements), how it is proven
(``prove`` is k-induction; ``bmc`` a bounded check) and the deliberately broken variants that
must make it fail. :data:`PROPERTIES` is the single list: ``rdakit verify``, the tests in
``tests/formal/`` and the table in ``docs/verification.md`` all read it.

Harnesses observe internal state through the private ``_observe=True`` argument of the
components (documented there). A broken variant is a subclass of the component that overrides
one small step of its ``elaborate``; the variants live beside their harnesses: ``memory``
(free list, memory unit), ``router``, ``mesh``, ``refcount`` (counter-based reference
counting) and ``link`` (the frame receiver, whose properties are bounded checks on its ports).
"""

import dataclasses
from collections.abc import Callable

from rdakit.sim.verify.formal import run_sby
from rdakit.sim.verify.formal_harness.credits import CREDITS_QUEUE_WORDS, credits_conserved
from rdakit.sim.verify.formal_harness.link import (
    ANSWER_BOUND,
    FABRIC_WAIT,
    LINK_PARAMS_TEXT,
    LINK_TIMEOUT,
    link_answers,
    link_checked,
    link_once,
)
from rdakit.sim.verify.formal_harness.memory import (
    FREE_LIST_DEPTH,
    MU_PARAMS_TEXT,
    free_list_exclusive,
    mu_blocks,
    mu_errors,
    mu_read_write,
    mu_responses,
    mu_weights,
)
from rdakit.sim.verify.formal_harness.mesh import MESH_DELIVERY_FORMAL, mesh_delivery, mesh_text
from rdakit.sim.verify.formal_harness.refcount import refcount_counter
from rdakit.sim.verify.formal_harness.router import (
    ROUTER_BOUNDED_CORNER,
    ROUTER_BOUNDED_MIDDLE,
    ROUTER_BOUNDED_SHARED,
    ROUTER_DELIVERY_FIFO,
    ROUTER_DELIVERY_FORMAL,
    ROUTER_DELIVERY_SCAN,
    ROUTER_PARAMS_TEXT,
    bounded_statement,
    router_bounded,
    router_bounded_middle,
    router_bounded_shared,
    router_delivery,
    router_delivery_fifo,
    router_delivery_scan,
    router_links,
    router_observed_queue,
    router_text,
)

__all__ = ["Property", "PROPERTIES", "get_property", "prove", "properties_table",
           "ROUTER_BOUNDED_CORNER", "ROUTER_BOUNDED_SHARED"]


@dataclasses.dataclass(frozen=True)
class Property:
    """One proof: a harness, how it is run, and what it states.

    Members
    -------
    name : str
        Identifier (``unit.what``), also the SymbiYosys task name.
    statement : str
        What is proven, in words.
    harness : callable
        ``harness(fault)`` returns the elaboratable; ``fault`` is ``None`` or one of
        ``faults``.
    params : str
        The parameters of the design under proof.
    mode, depth : str, int
        ``"prove"`` (k-induction of length ``depth``) or ``"bmc"`` (bounded, ``depth`` cycles).
    expect : str
        ``"PASS"``, or ``"FAIL"`` for a property that is expected to have a counterexample (a
        demonstration of a known flaw).
    faults : tuple of str
        Broken variants (``fault`` values) for which the proof must fail.
    fault_depth : int
        Bound of the bounded check run on a broken variant, which must find a counterexample
        from the initial state (``FAIL``), not merely break the induction; ``0`` means
        ``depth``.
    ci : bool
        Part of the subset CI runs.
    """

    name: str
    statement: str
    harness: Callable
    params: str
    mode: str = "prove"
    depth: int = 10
    expect: str = "PASS"
    faults: tuple = ()
    fault_depth: int = 0
    ci: bool = True

    @property
    def where(self):
        return f"{self.harness.__module__}.{self.harness.__qualname__}"



# --- The list ----------------------------------------------------------------------------------

PROPERTIES = [
    Property(
        name="free_list.exclusive",
        statement="Every entry of a free list is exactly one of: held by the environment, on "
                  "the stack, never taken since reset; the head is never held; the count is "
                  "the number of entries not held.",
        harness=free_list_exclusive, params=f"depth={FREE_LIST_DEPTH}", depth=4,
        faults=("pop_keeps",)),
    Property(
        name="mu.blocks",
        statement="Every physical block is exactly one of: free (on the free list or never "
                  "taken) or mapped by one (live buffer, virtual block below its length); "
                  "every slot is live or free; the free-block count and held words match; the "
                  "pipeline's table reads match the tables.",
        harness=mu_blocks, params=MU_PARAMS_TEXT, depth=6,
        faults=("walk_frees_holes",), fault_depth=13),
    Property(
        name="mu.responses",
        statement="Every accepted request gets exactly one response, in request order (tags "
                  "count requests); requests in flight are exactly those in the pipeline; the "
                  "response link holds valid and payload until ready.",
        harness=mu_responses, params=MU_PARAMS_TEXT, depth=6,
        faults=("len_no_response",), fault_depth=11),
    Property(
        name="mu.errors",
        statement="A request refused with an error status changes nothing (tables, free lists, "
                  "scratchpad, counts); under arbitrary requests collected weight never exceeds "
                  "total weight.",
        harness=mu_errors, params=MU_PARAMS_TEXT, depth=6,
        faults=("error_writes", "return_no_overflow"), fault_depth=11),
    Property(
        name="mu.weights",
        statement="Weighted reference counting with the environment as holders of weight "
                  "shares: for every live buffer total = collected + held + in flight; a buffer "
                  "is freed only when collected = total; no holder holds weight of a freed "
                  "buffer.",
        harness=mu_weights, params=MU_PARAMS_TEXT, depth=6,
        faults=("return_frees_early",), fault_depth=11),
    Property(
        name="mu.read_write",
        statement="A READ of a (buffer, index) returns the last word written there by WRITE or "
                  "APPEND, as FETCH_ADD and UNLOCK (by the ticket's holder) then changed it "
                  "(one word chosen by the solver, watched from its write to the free of its "
                  "buffer).",
        harness=mu_read_write, params=MU_PARAMS_TEXT, depth=6,
        faults=("append_no_tail", "fetch_add_stale"), fault_depth=16),
    Property(
        name="router.links",
        statement="With receivers that stall at will and any traffic on all five inputs: a "
                  "router drives a link only towards a queue with room (the link's ready bit "
                  "for the flit's lookahead port); its ejection port holds valid and payload "
                  "until taken.",
        harness=router_links, params=ROUTER_PARAMS_TEXT, depth=4,
        faults=("ignore_room",), fault_depth=6),
    Property(
        name="router.delivery",
        statement="One flit chosen by the environment (any flit, on any of the five inputs, at "
                  "any time), tracked through the router's queues: it is neither lost nor "
                  "duplicated (copies queued + departed = arrived, at most once); every queued "
                  "flit waits for the output XY routing picks and carries the port XY routing "
                  "picks in the next router; it leaves on that output with that lookahead port, "
                  "or on the ejection port only at its destination.",
        harness=router_delivery, params=router_text(ROUTER_DELIVERY_FORMAL), depth=2,
        faults=("grant_keeps", "inject_ignores_room", "yx_local"), fault_depth=4),
    Property(
        name="router.delivery_fifo",
        statement="router.delivery for the `fifo` queue kind: one queue per input, whose "
                  "entries name their output here (every queued flit's output is XY routing's "
                  "and its lookahead port XY routing's at the neighbour that output leads to).",
        harness=router_delivery_fifo,
        params=router_text(ROUTER_DELIVERY_FIFO), depth=2,
        faults=("inject_ignores_room", "yx_local"), fault_depth=4),
    Property(
        name="router.delivery_scan",
        statement="router.delivery for the `scan` queue kind: per-output queues from which the "
                  "oldest flit whose next queue has room leaves, so flits leave out of arrival "
                  "order; every entry of every queue is counted.",
        harness=router_delivery_scan,
        params=router_text(ROUTER_DELIVERY_SCAN), depth=2,
        faults=("grant_keeps", "inject_ignores_room", "yx_local"), fault_depth=4),
    Property(
        name="router.bounded",
        statement=bounded_statement(ROUTER_BOUNDED_CORNER),
        harness=router_bounded, params=router_text(ROUTER_BOUNDED_CORNER.params), depth=7,
        faults=("fixed_priority",), fault_depth=10),
    Property(
        name="router.bounded_shared",
        statement=bounded_statement(ROUTER_BOUNDED_SHARED) + " Here three queues whose flits "
                  "wait for different queues of the next router share the south output; the "
                  "broken variant is the round-robin of earlier versions (the pointer follows "
                  "every grant, past a queue that could not send), under which the flit can "
                  "wait for ever.",
        harness=router_bounded_shared, params=router_text(ROUTER_BOUNDED_SHARED.params),
        depth=9, faults=("pointer_follows",), fault_depth=12),
    Property(
        name="router.bounded_middle",
        statement=bounded_statement(ROUTER_BOUNDED_MIDDLE) + " The middle router: every "
                  "port, up to four queues per output to a neighbour and five for the ejection "
                  "port.",
        harness=router_bounded_middle, params=router_text(ROUTER_BOUNDED_MIDDLE.params),
        depth=12, faults=("fixed_priority",), fault_depth=14, ci=False),
    Property(
        name="mesh.delivery",
        statement="A whole mesh, every tile injecting anything under the stream rules and every "
                  "ejection port stalling at will; one flit chosen by the environment (any "
                  "tile, any time, for any tile of the mesh) is delivered exactly once, on the "
                  "ejection port of its destination: copies in all routers' queues + delivered "
                  "= injected ≤ 1, with router.delivery's invariants in every router and every "
                  "link driven only towards a queue with room.",
        harness=mesh_delivery, params=mesh_text(MESH_DELIVERY_FORMAL), depth=2,
        faults=("grant_keeps", "ignore_room", "yx_local"), fault_depth=4),
    Property(
        name="router.observed_queue",
        statement="The register queue that router.delivery and router.bounded build under "
                  "`_observe` behaves as the SyncFIFO of normal builds: under any writes and "
                  "reads, the same w_rdy and r_rdy, and the same r_data while r_rdy. Bounded "
                  "check of 8 cycles from reset; every state of the pair (levels, pointers, "
                  "live entries) is reached within 3.",
        harness=router_observed_queue, params="2 entries of 3 bits", mode="bmc", depth=8,
        faults=("deeper",)),
    Property(
        name="refcount.counter_gated",
        statement="Counter-based reference counting with acknowledgement gating: holder A "
                  "copies its reference to B with an INCREF and waits for its response before "
                  "handing the copy over; DECREFs and the INCREF cross a network that may "
                  "reorder them. While a holder holds the reference the buffer is not freed. "
                  "The broken variant without gating produces the paper's Figure 1(b): A's "
                  "DECREF overtakes the INCREF and frees the buffer while B holds it.",
        harness=refcount_counter, params=MU_PARAMS_TEXT.replace("weighted", "counter"),
        depth=6, faults=("ungated",), fault_depth=22),
    Property(
        name="cu.credits",
        statement="Credit flow control of streams between CUs: for any sends, network delays, "
                  "pops and message-register stalls, credits held by the producer + words in "
                  "flight + words in the consumer's input queue + credits owed + credits in "
                  "flight = the queue depth; so no word arrives at a full queue and returned "
                  "credits never pass the depth. The broken variant returns a credit twice.",
        harness=credits_conserved, params=f"queue_words={CREDITS_QUEUE_WORDS}", depth=4,
        faults=("returns_twice",), fault_depth=12),
    Property(
        name="link.checked",
        statement="The board link's frame receiver (FrameLink) under any bytes, UART errors "
                  "and gaps: a command reaches the fabric only while the bytes it took since "
                  "the SOF that started the frame are a whole CMD frame without a UART error "
                  "or a gap over the timeout, with at most a command's LEN payload bytes, whose "
                  "payload is the command and whose header check and CRC match the link's CRC "
                  "units, which were started at that SOF and fed exactly SEQ, KIND, LEN and "
                  "SEQ to the end of the payload; an OPEN is applied only for such an OPEN "
                  "frame; frames_ok counts them. Bounded check from reset: OPEN frames and "
                  "commands of up to 4 payload bytes.",
        harness=link_checked, params=LINK_PARAMS_TEXT, mode="bmc", depth=15,
        faults=("crc_unchecked", "header_unchecked")),
    Property(
        name="link.once",
        statement="The board link never gives the fabric the command of the last command "
                  "applied again for a frame with its SEQ (a resend), unless an OPEN was "
                  "applied in between. Bounded check from reset: two frames of commands of up "
                  "to 1 payload byte.",
        harness=link_once, params=LINK_PARAMS_TEXT, mode="bmc", depth=23,
        faults=("applies_twice",), fault_depth=16),
    Property(
        name="link.answers",
        statement=f"The board link does not wedge: with a fabric that takes a command within "
                  f"{FABRIC_WAIT} cycles and offers its reply within {FABRIC_WAIT} more, and a "
                  f"transmit side that takes every byte, every frame or run of bytes in error "
                  f"the link ends (it stops taking bytes) gets one answer, which starts within "
                  f"{ANSWER_BOUND} cycles in which no other answer is being sent; the link "
                  f"stops taking bytes only while it owes an answer, and ends a frame cut short "
                  f"at the latest {LINK_TIMEOUT + 2} cycles after its last byte. Bounded check "
                  f"from reset.",
        harness=link_answers, params=LINK_PARAMS_TEXT, mode="bmc", depth=17,
        faults=("late_timeout", "tx_stuck")),
]


def get_property(name):
    """The :class:`Property` called ``name``.

    Raises
    ------
    ValueError
        If there is no such property.
    """
    for prop in PROPERTIES:
        if prop.name == name:
            return prop
    names = ", ".join(p.name for p in PROPERTIES)
    raise ValueError(f"Property must be one of {names}, not {name!r}")


def prove(prop, *, fault=None, workdir=None, timeout=None):
    """Run ``prop`` (a :class:`Property` or its name), or its broken variant ``fault``, and
    return the :class:`~rdakit.sim.verify.formal.FormalResult`.

    Raises
    ------
    ValueError
        If ``fault`` is not one of the property's broken variants.
    """
    if isinstance(prop, str):
        prop = get_property(prop)
    if fault is not None and fault not in prop.faults:
        raise ValueError(f"Fault of {prop.name} must be one of "
                         f"{', '.join(map(repr, prop.faults)) or 'none'}, not {fault!r}")
    name = prop.name.replace(".", "-") + (f"-{fault}" if fault else "")
    if fault is None:
        mode, depth = prop.mode, prop.depth
    else:
        # A broken variant must show a real counterexample from the initial state.
        mode, depth = "bmc", prop.fault_depth or prop.depth
    return run_sby(prop.harness(fault), name=name, mode=mode, depth=depth, workdir=workdir,
                   timeout=timeout)


def properties_table():
    """The Markdown table of :data:`PROPERTIES` in ``docs/verification.md``."""
    lines = ["| property | states | harness | parameters | mode, depth | broken variants "
             "(bounded check depth) | CI |", "|---|---|---|---|---|---|---|"]
    for prop in PROPERTIES:
        mode = "k-induction" if prop.mode == "prove" else "bounded"
        faults = ", ".join(f"`{f}`" for f in prop.faults) or "-"
        if prop.faults:
            faults += f" ({prop.fault_depth or prop.depth})"
        lines.append(f"| `{prop.name}` | {prop.statement} | `{prop.where}` | {prop.params} "
                     f"| {mode}, {prop.depth} | {faults} | {'yes' if prop.ci else 'no'} |")
    return "\n".join(lines)
