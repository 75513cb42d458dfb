"""Jobs: what the compiler hands the runtime.

A :class:`Job` is everything needed to run a program on a fabric through the host port: the
:class:`~rdakit.hdl.spec.bitstream.FabricConfig`, the buffers the host allocates and fills
before loading (their references are bound into the CUs' initial registers when the bitstream
is written, so a job runs on a fabric in any state), the buffers read back after done, and the
expected outputs. The lowering (:mod:`rdakit.compiler.lower`) and the hand-written kernels of
the tests (:mod:`rdakit.sim.verify.kernels`) make them; :mod:`rdakit.sim.runtime.job` runs them.
"""

import dataclasses

import numpy as np

from rdakit.hdl.spec.bitstream import FabricConfig

__all__ = ["HostBuffer", "Job", "Ref", "SystemJob"]


@dataclasses.dataclass(frozen=True)
class Ref:
    """An initial register value that is the reference of host buffer ``name``, bound when
    the job's bitstream is written (:meth:`Job.bind`)."""

    name: str


@dataclasses.dataclass
class HostBuffer:
    """A buffer the host allocates (in this order) in MU ``mu`` with total weight ``weight``
    and fills with ``data`` (n × lanes int32, or ``None`` for an empty buffer), or, for a
    *reference table*, with the references of the host buffers ``refs`` names (allocated
    before it), one a word in lane 0: a CU's references beyond those its initial registers
    pass (:meth:`contents`)."""

    name: str
    mu: tuple
    data: np.ndarray | None = None
    weight: int = 1
    #: Weight the CUs return; the host returns the rest after reading the outputs.
    cu_returns: int = 0
    #: A reference table: the host buffers whose references it holds, word by word.
    refs: tuple = ()

    @property
    def words(self):
        """Words the host fills it with (a reference table: one a reference)."""
        if self.refs:
            return len(self.refs)
        return 0 if self.data is None else len(self.data)

    def contents(self, refs, lanes):
        """What the host fills the buffer with (``None``: nothing), given the references of
        the buffers allocated before it (``refs``: name -> reference)."""
        if not self.refs:
            return self.data
        table = np.zeros((len(self.refs), lanes), np.int32)
        table[:, 0] = [refs[name] for name in self.refs]
        return table


@dataclasses.dataclass
class Job:
    config: FabricConfig
    buffers: list                    # HostBuffer, allocated in order
    outputs: list                    # names of buffers read back after the run
    expected: dict                   # name -> n × lanes int32 array
    macs: int = 0                    # multiply-accumulates, for lower bounds
    cus_used: int = 1
    description: str = ""

    @property
    def params(self):
        return self.config.params

    def bind(self, refs):
        """The configuration with every :class:`Ref` register replaced by ``refs[name]``."""
        tiles = {}
        for xy, tile in self.config.tiles.items():
            regs = {r: refs[v.name] if isinstance(v, Ref) else v for r, v in tile.regs.items()}
            tiles[xy] = dataclasses.replace(tile, regs=regs)
        return FabricConfig(self.params, tiles)


@dataclasses.dataclass
class SystemJob:
    """A job for a system of clusters: host buffers in any cluster's MUs (``HostBuffer.mu``
    is ``(x, y, cluster)``), one :class:`~rdakit.hdl.spec.bitstream.FabricConfig` per
    cluster whose registers may hold :class:`~rdakit.compiler.job.Ref` placeholders, the
    outputs read back and their numpy expectation."""

    configs: list
    buffers: list
    outputs: list
    expected: dict
    description: str = ""

    def bind(self, refs):
        """The configurations with every :class:`Ref` register replaced by ``refs[name]``."""
        out = []
        for config in self.configs:
            if config is None:
                out.append(None)
                continue
            tiles = {xy: dataclasses.replace(tile, regs={
                r: refs[v.name] if isinstance(v, Ref) else v for r, v in tile.regs.items()})
                for xy, tile in config.tiles.items()}
            out.append(FabricConfig(config.params, tiles))
        return out
