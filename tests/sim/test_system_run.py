"""sim/flows/system.py's pieces that need no simulation: the injected load's program rewrite,
the busy times and their calibration, and the run spec's checks."""

import re

import numpy as np
import pytest

from rdakit.hdl.cluster.system import SystemParams
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import Instr, Op, decode
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.flows.system import SystemRunSpec, busy_times, calibrated, inject_load


def system():
    return SystemParams(fabric_params(2, 2, cluster_bits=1, coord_bits=2, prog_len=16),
                        clusters=2)


def test_injected_load_moves_branches_and_restores_the_register():
    fp = system().fabric
    program = [Instr(Op.LI, rd=1, imm=3), Instr(Op.ALUI, rd=15, ra=15, imm=1),
               Instr(Op.LOOP, ra=1, imm=1), Instr(Op.JMP, imm=5), Instr(Op.NOP),
               Instr(Op.HALT)]
    cfg = FabricConfig(fp, {(0, 0): TileConfig(program, {15: 7}),
                            (1, 1): TileConfig([Instr(Op.HALT)], enabled=False)})
    out = inject_load(cfg, 40)
    t = out.tiles[(0, 0)]
    words = [decode(w) for w in t.words()]
    assert words[0] == Instr(Op.LOOP, ra=15, imm=0)
    assert words[1] == Instr(Op.LI, rd=15, imm=7)
    assert words[4] == Instr(Op.LOOP, ra=1, imm=3) and words[5] == Instr(Op.JMP, imm=7)
    assert words[2:4] == program[:2] and words[6:] == program[4:]
    assert t.regs == {15: 40}
    assert out.tiles[(1, 1)] is cfg.tiles[(1, 1)]
    assert cfg.tiles[(0, 0)].program == program      # the input is not changed


def test_injected_load_errors():
    fp = system().fabric
    cfg = FabricConfig(fp, {(0, 0): TileConfig([Instr(Op.NOP)] * 15)})
    with pytest.raises(ValueError, match=re.escape(
            "tile (0, 0): no room for the injected load's 2 instructions (15 of prog_len 16 "
            "used)")):
        inject_load(cfg, 10)
    with pytest.raises(ValueError, match="an injected load must be from 1 to 2"):
        inject_load(cfg, 0)


def test_busy_times_skip_clusters_that_did_not_run():
    counters = [{(0, 0): {"busy_cycles": 100, "wait_cycles": 30},
                 (1, 1): {"busy_cycles": 90, "wait_cycles": 0},
                 (1, 0): {"live_buffers": 0}},
                {(0, 0): {"busy_cycles": 500, "wait_cycles": 0}}]
    assert busy_times(counters, 2, {0: 1, 1: 1}) == [90, 500]
    assert busy_times(counters, 2, {0: 1}) == [90, 0]


def test_calibration_compares_busiest_cu_with_work_per_cu():
    # Cluster 0 ran as modelled at 3 cycles per unit of work per CU, cluster 1 four times
    # slower; a cluster without work stays 0.
    t = calibrated([100, 50, 0], [150, 300, 0], [2, 1, 0])
    assert np.allclose(t, [50, 100, 0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(iterations=0), "iterations must be a positive integer, not 0"),
    (dict(delays={2: 5}), "an injected load names cluster 2, but the system has clusters 0 to 1"),
    (dict(delays={1: -1}), "the injected load of cluster 1 must be a number of cycles >= 0"),
    (dict(cus=[2]), "cus must give one number per cluster (2), not [2]"),
])
def test_spec_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SystemRunSpec("mlp", system(), **kwargs)
