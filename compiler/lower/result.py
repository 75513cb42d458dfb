"""What the lowering gives: a :class:`CompiledJob` and a :class:`ProgramInfo` per CU."""

import dataclasses

from rdakit.compiler.job import Job

__all__ = ["ProgramInfo", "CompiledJob"]


@dataclasses.dataclass
class ProgramInfo:
    """What the lowering put on one CU.

    Members
    -------
    cu : tuple
        ``(x, y)``.
    instructions : int
        Program length (prologue, ops, messages, epilogue).
    ops : list
        ``(lowered op, kind, graph node, first pc, end pc)`` of each op, in program order (the
        messages sent for other CUs' ops lie between them).
    host_buffers : list
        Host buffers whose references the CU gets in its initial registers.
    table_mu : tuple or None
        The MU of the CU's reference table (None: every reference fitted in registers).
    local_constants : int
        Words of the local buffer taken by constants.
    """

    cu: tuple
    instructions: int
    ops: list
    host_buffers: list
    table_mu: tuple | None
    local_constants: int

    def op_at(self, pc):
        """The lowered op whose code holds ``pc`` (None: prologue, messages, epilogue)."""
        for name, _, _, a, b in self.ops:
            if a <= pc < b:
                return name
        return None


@dataclasses.dataclass
class CompiledJob(Job):
    """A :class:`~rdakit.compiler.job.Job` made by :func:`lower`, with what is needed to feed it
    other inputs and to read its outputs as tensors.

    Members
    -------
    graph : DataflowGraph
        The lowered graph.
    input_layouts, output_layouts : dict
        Graph input (output) name -> ``(host buffer name, TensorLayout)``.
    programs : dict
        ``(x, y)`` -> :class:`ProgramInfo` of every CU with a program.
    mu_usage : dict
        ``(x, y)`` of every MU -> ``host_buffers`` (names), ``host_words`` (words the host
        writes), ``bound_words`` and ``bound_slots`` (the capacity check's bound, run-time
        buffers included).
    lowered : list
        ``(lowered op, kind, CU, graph nodes it implements)`` in the global order.
    streamed : frozenset
        The tensors (graph nodes) sent as streams between CUs
        (:mod:`rdakit.compiler.lower.streams`); every other edge between CUs goes through an MU.
    workload : Workload or None
        The workload compiled (set by :func:`~rdakit.compiler.compile.compile_workload`).
    """

    graph: object = None
    input_layouts: dict = dataclasses.field(default_factory=dict)
    output_layouts: dict = dataclasses.field(default_factory=dict)
    programs: dict = dataclasses.field(default_factory=dict)
    mu_usage: dict = dataclasses.field(default_factory=dict)
    lowered: list = dataclasses.field(default_factory=list)
    streamed: frozenset = frozenset()
    workload: object = None

    def expected_outputs(self, inputs):
        """The expected contents of the output buffers (the graph evaluated in numpy)."""
        values = self.graph.evaluate(inputs)
        out = {}
        for name, (buf, lay) in self.output_layouts.items():
            out[buf] = lay.encode(values[name])
        return out

    def with_inputs(self, inputs):
        """The same job on other input values (same shapes; dynamic inputs may have fewer
        rows, up to their bound)."""
        missing = sorted(set(self.input_layouts) - set(inputs))
        if missing:
            raise ValueError(f"inputs must give a value for {', '.join(missing)}")
        self.graph.evaluate(inputs)       # checks dtypes and shapes
        buffers = []
        for b in self.buffers:
            for name, (buf, lay) in self.input_layouts.items():
                if buf == b.name:
                    b = dataclasses.replace(b, data=lay.encode(inputs[name]))
            buffers.append(b)
        job = dataclasses.replace(self, buffers=buffers)
        job.expected = job.expected_outputs(inputs)
        return job

    def decode(self, outputs, *, check_padding=False):
        """Graph outputs (numpy arrays of their dtype and shape) from the output buffers read
        back (buffer name -> ``n x lanes`` words); see :meth:`TensorLayout.decode`."""
        return {name: lay.decode(outputs[buf], check_padding=check_padding)
                for name, (buf, lay) in self.output_layouts.items()}
