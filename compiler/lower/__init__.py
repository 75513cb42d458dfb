"""Lowering: a partitioned and placed dataflow graph to CU programs, host buffers and a job.

:func:`lower` turns a validated :class:`~rdakit.compiler.graph.DataflowGraph`, the partition of
its nodes and their :class:`~rdakit.compiler.placement.Placement` into a
:class:`CompiledJob` (a :class:`rdakit.compiler.job.Job`, so that
:func:`~rdakit.sim.runtime.job.run_job` and :func:`~rdakit.sim.runtime.job.run_job_interp` run it
unchanged). The design is in ``docs/compiler.md`` ("Lowering"); in short:

* **Layout.** A tensor of shape ``(R, C)`` (or ``(C,)``, one row) is ``R`` rows of
  ``cw = ceil(C / lanes)`` vector words, one int32 lane per element whatever its dtype, padding
  lanes zero. Every op keeps padding lanes zero (an op that could break that masks them).
* **Buffers.** Graph inputs and the host-written constants are host buffers (the constants a
  CU reads share one *pool* buffer); graph outputs are host buffers the producing CU appends
  to. Every other tensor is allocated at run time (``ALLOC``) by the CU that produces it,
  in an MU near it, with total weight = one share per CU that reads it; a reader returns its
  share (``RETI``) after its last use, so the buffer is freed after the last reader
  (partial-free). Host inputs and constant pools are shared the same way (the host allocates
  them with one share per reading CU), so they too are freed after their last reader.
* **Dependencies.** A run-time buffer's reference goes from producer to consumer by ``SENDREF``
  into a mailbox slot, received at the consumer's first use (``RECV``); slots are reused in
  order, and a producer whose reference would land in a reused slot first waits for a credit
  token the consumer sends when it empties the slot. A tensor in a host buffer written by a CU
  (a graph output read by other CUs, or a KV cache grown in place) is signalled by a token
  (``SEND``/``WAIT``). Every CU runs its ops in one global topological order and every wait
  is for an event earlier in that order, so programs cannot deadlock.
* **Ops** become streams (``SRUN``): see ``docs/compiler.md`` for each kind.

What does not fit raises :class:`LoweringError` naming it (the node, the CU or the MU, and the
numbers): programs longer than ``prog_len``, buffers beyond the MUs' capacity, local-buffer
needs beyond ``local_words``, unsupported op kinds or shapes.

The package, in the order a graph goes through it:

========================  =====================================================================
:mod:`.layout`            :class:`TensorLayout` (a tensor in vector words), :class:`LoweringError`
:mod:`.plan`              the lowered ops and tensors the passes rewrite
:mod:`.passes`            the passes (legalize, fuse-elementwise, place-outputs, ...), ``PIPELINE``
:mod:`.chains`            elementwise chains: stages and their fusion
:mod:`.lowerer`           code generation: buffers, shares, messages, the walk over the ops
:mod:`.templates`         one template per lowered op kind
:mod:`.asm`               the assembler of one CU program
:mod:`.registers`         named registers and the reference cache
:mod:`.capacity`          MU capacity bookkeeping; the host's references on a fresh fabric
:mod:`.result`            :class:`CompiledJob`, :class:`ProgramInfo`
:mod:`.pipeline`          :func:`lower`, :func:`sample_inputs`
========================  =====================================================================
"""

from rdakit.compiler.lower.capacity import replay_refs
from rdakit.compiler.lower.chains import Clip, Stage, append_stage
from rdakit.compiler.lower.layout import LoweringError, TensorLayout
from rdakit.compiler.lower.passes import LOWERABLE_KINDS
from rdakit.compiler.lower.pipeline import lower, sample_inputs
from rdakit.compiler.lower.result import CompiledJob, ProgramInfo

__all__ = [
    "LoweringError", "TensorLayout", "CompiledJob", "ProgramInfo", "lower", "LOWERABLE_KINDS",
    "sample_inputs", "replay_refs",
]

# The names these had when the lowering was one module (tests import them).
_Stage, _Clip, _append_stage = Stage, Clip, append_stage
