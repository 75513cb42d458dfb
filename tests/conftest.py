"""What the tests share: the marks that split the suite, and helpers more than one file needs.

The suite in three loops (README.md, "Tests"):

* the inner loop, ``pytest -m "not cosim and not slow and not long and not formal"``
  (``scripts/run-tests.sh --quick``): every module in Amaranth's simulator, the models and the
  compiler;
* the default suite (``pytest``, what CI runs): the inner loop, the ``long`` tests (a minute or
  more each, listed in :data:`LONG`) and co-simulation of the small designs on Icarus and
  Verilator;
* ``-m slow``: board builds, 4x4 fabrics and meshes, long random streams. ``formal`` (the
  SymbiYosys proofs) runs on its own, ``-m formal``.

Marks come from two places. A test file of co-simulation (``tests/cosim/``) is ``cosim`` as a
whole (:func:`pytest_collection_modifyitems`); a long test is ``slow`` where it is written
(``@pytest.mark.slow``, ``pytest.param(..., marks=pytest.mark.slow)``) or, for the ones that
became long without their files saying so, in :data:`SLOW` here with the reason.

Helpers are plain functions, imported by name (``from conftest import wrap32``): pytest puts
this folder on ``sys.path`` to load this file (the tests are not a package).
"""

import collections
import pathlib

import numpy as np
import pytest
from amaranth.back import verilog
from amaranth.sim import Simulator

from rdakit.hdl.fabric.top import Fabric
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver
from rdakit.sim.runtime.job import run_job_interp

HERE = pathlib.Path(__file__).resolve().parent

if __name__ != "conftest":
    # A second copy of this module (``tests.conftest``) would have its own globals:
    # ``--hostile-examples`` set in pytest's copy would not reach the tests that import it.
    raise ImportError(f"import the tests' helpers as `conftest`, not as {__name__!r}")

#: Tests marked ``slow`` here rather than in their files, by node id under ``tests/`` (with a
#: parametrization in brackets for that one only), with the
#: time each took alone on a 2-core machine.
SLOW = {
    "boards/test_build.py::test_icebreaker_1x2_build_says_it_does_not_fit":
        "Yosys and nextpnr on a 1x2 fabric: about 4 minutes",
    # The two-cluster systems on Verilator: 90-100 s each from a clean checkout (the C++ build
    # of a system of two 2x2 fabrics); the same tests on Icarus stay in the default suite.
    "cosim/test_system_cosim.py::test_two_clusters[verilator]": "100 s",
    "cosim/test_system_cosim.py::test_compiled_workload_across_two_clusters[verilator]": "90 s",
    # Out of the default suite when issue 18, 20 and 21's second round filled it (11 min 55 s
    # before them): four clusters in Amaranth's simulator, and the clusters' bench end to end;
    # remote requests, two-cluster tokens and references, and run --clusters stay in it.
    "hdl/test_system.py::test_four_clusters_every_pair": "140 s loaded",
    "test_cluster_cli.py::test_bench_clusters": "145 s loaded",
    # The clean-clone default suite then took 14 min 39 s: out of it go the UART bridge's one
    # end-to-end session (a compiled kernel and the frame faults through the bridge and a
    # fabric; the frame parser, payload and parameter tests stay, and the link's hostile streams
    # against a fake fabric in test_hostile_link.py), one compiled job on the fabric (the e2e
    # tests run jobs on it), two Verilog elaborations of large designs, and the jitter
    # mesh's zero-rate comparison (its delivery tests stay).
    **{f"hdl/test_host_bridge.py::{t}": "330 s loaded (the session fixture)" for t in (
        "test_kernel_through_the_uart_is_bit_exact", "test_corrupted_frame_gets_one_error_answer",
        "test_garbage_between_frames_gets_one_sync_answer",
        "test_corrupted_frames_change_nothing",
        "test_resent_frame_is_applied_once_and_answered_alike",
        "test_transport_resends_after_error_and_lost_answer",
        "test_link_answers_after_a_request_for_no_mu", "test_bridge_counts_frames")},
    "hdl/test_fabric.py::test_job_is_bit_exact_and_matches_the_interpreter": "130 s loaded",
    "hdl/test_jitter.py::test_dual_mesh_and_fabric_have_jitter_ports_only_when_asked": "110 s",
    "hdl/test_jitter.py::test_rate_zero_is_the_plain_mesh_and_stalls_delay": "90 + 45 s",
    "hdl/test_memory_unit.py::test_plasticine_sizing_elaborates_to_verilog": "85 s",
    "test_cluster_cli.py::test_verilog_system_writes_a_module": "65 s",
    # The suite then took 12 min 50 s: two of the jittered mesh's three queue structures (VOQ,
    # the default, stays), and the clusters' remote requests against the golden model and
    # tokens across clusters in Amaranth's simulator (their Icarus co-simulation stays).
    "hdl/test_jitter.py::test_jittered_mesh_delivers_everything_once_in_order[3-2-fifo-160]":
        "40-65 s",
    "hdl/test_jitter.py::test_jittered_mesh_delivers_everything_once_in_order[2-2-scan-250]":
        "40-65 s",
    "hdl/test_system.py::test_tokens_and_references_cross_clusters": "65 s",
    "hdl/test_system.py::test_remote_requests_match_the_golden_model": "47 s (setup)",
    "hdl/test_system.py::test_every_remote_request_crossed_the_links_once": "(fixture)",
    "hdl/test_system.py::test_live_buffers_match_the_model": "(fixture)",
    # The suite then took 12 min 48 s from a clean build cache: three of the MU's five
    # Verilator builds (each configuration still runs on Icarus; the default configuration and
    # counter mode stay on both simulators).
    "cosim/test_mu_cosim.py::test_memory_unit[reserve-weighted-verilator]": "16 s",
    "cosim/test_mu_cosim.py::test_memory_unit[virtual-small-blocks-verilator]": "15 s",
    "cosim/test_mu_cosim.py::test_memory_unit[single-counter-verilator]": "11 s",
    # The two-cluster system's lint (its Icarus co-simulation stays, and the fabric's lint).
    "cosim/test_system_cosim.py::test_system_verilog_passes_verilator_lint_wall": "22 s",
}


#: Tests marked ``long`` (in the default suite and CI, out of the inner loop), by file (all its
#: tests) or node id (all parametrizations, or one in brackets), with their time in one run of
#: the suite on a loaded 2-core machine (about twice what an idle one takes).
LONG = {
    # The inner loop took 2 min 50 s idle at stop 28 (1571 tests, 294 s on two workers): out
    # of it, into the default suite only, go these families of CU, stream engine and router
    # simulations (about 107 s; each has cheaper siblings that stay in the loop).
    **{f"hdl/test_compute_unit.py::{t}": "4-13 s a family" for t in (
        "test_converts_to_verilog", "test_mu_error_halts",
        "test_random_programs_match_the_interpreter",
        "test_a_wrong_destination_halts_before_sending",
        "test_ticket_lock_mutual_exclusion_and_fairness", "test_elementwise_to_an_mu",
        "test_reference_passing_frees_the_buffer_after_both_returns",
        "test_two_cus_streaming_from_one_mu_at_once",
        "test_wait_cycles_count_the_waits_for_another_cu")},
    "hdl/test_stream_engine.py::test_stream_matches_numpy": "16 s (14 cases)",
    "hdl/test_stream_engine.py::test_writes_are_posted_and_counted_until_acknowledged": "9 s",
    "hdl/test_router.py::test_local_injection_routes_xy": "7 s (12 cases)",
    "hdl/test_router.py::test_round_robin_is_fair_under_persistent_contention": "6 s",
    "hdl/test_router.py::test_converts_to_verilog": "3.4 s",
    "hdl/test_system.py::test_bridge_on_the_host_tile": "4.4 s",
    "hdl/test_sequencer.py::test_pc_out_of_range_and_bad_instruction_halt_with_their_codes":
        "4.3 s",
    "test_cli.py::test_bench_mu_quick_json": "12 s (170 s before the MU started in 9 cycles)",
    "test_cli.py::test_help_everywhere": "75 s",
    "hdl/test_jitter.py::test_jittered_mesh_delivers_everything_once_in_order": "3 x 40-65 s",
    "sim/test_events.py::test_estimates_are_close_to_the_rtl": "2 x 8 s (the RTL in Amaranth)",
    # The inner loop took 1 min 49 s once the CLI ranked its candidates on the performance
    # model; the ranking's unit test stays in it.
    "sim/test_events.py::test_split_auto_keeps_the_job_the_model_finds_fastest":
        "4.6 s (16 compiles and model runs of the d_model 64 decoder)",
    "sim/test_events.py::test_a_bounded_rank_keeps_what_the_full_runs_keep":
        "3 s (two rankings of 16 candidates; the bound's unit test stays in the inner loop)",
    "test_hostile_cli.py::test_class9_the_default_workload_compiles_on_the_default_fabric":
        "5.5 s (rdakit compile's 16 candidates of the default MLP, each run on the model)",
    # Measured (--durations) when the inner loop had grown to 2 min 01 s with issue 18's tests.
    "hdl/test_compute_unit.py::test_harness_converts_to_verilog": "4.4 s",
    "boards/test_boards.py::test_board_top_prepares": "2.7 + 2.5 s",
    # Measured in the inner loop on an idle 2-core machine (--durations), which took 2 min 44 s
    # with them; the modules they cover keep faster tests in the loop.
    # The host bridge's one simulation (a 31 s module fixture) and every test reading it; the
    # frame parser, payload and parameter tests of the bridge stay in the loop.
    "test_cluster_cli.py::test_run_clusters_adapts_away_from_a_loaded_cluster": "23 s",
    # The fabric's one simulation of every job (a 13 s module fixture) and its readers; the
    # malformed bitstream and parameter tests of the fabric stay in the loop.
    "hdl/test_fabric.py::test_moe_shared_buffer_freed_exactly_once": "13 s (setup)",
    "hdl/test_fabric.py::test_counters_count_work": "(fixture)",
    "hdl/test_fabric.py::test_mu_peak_is_per_run": "(fixture)",
    "sim/test_e2e.py::test_mismatch_exits_nonzero": "9 s",
    "sim/test_e2e.py::test_hardware_error_exits_nonzero": "7 s",
    "hdl/test_compute_unit.py::test_converts_to_verilog[lanes16]": "5.5 s",
    "hdl/test_mesh.py::test_mesh_converts_to_verilog[4-4-voq]": "5.3 s",
    "hdl/test_mesh.py::test_dual_mesh_converts_to_verilog": "4 s",
    # Issue 19's tests that simulate or compile the most (--durations on a loaded machine); the
    # rest of the hostile-input suite stays in the loop.
    "compiler/test_compile_cli.py::test_every_workload_compiles_at_its_default_sizes":
        "4 x 4-7 s",
    "hdl/test_system.py::test_request_for_a_cluster_that_does_not_exist_is_answered": "9 s",
    "hdl/test_hostile_host.py::test_failed_jobs_free_everything_and_the_next_job_runs": "7 s",
    "hdl/test_hostile_bitstream.py::test_reader_and_loader_agree_on_mutated_bitstreams": "7 s",
    # The whole main job through the CLI (the compiler's and the runtime's own tests stay in
    # the loop), and the fabric's malformed-bitstream run (the loader's hostile-bitstream tests
    # stay in the loop).
    "sim/test_e2e.py::test_run_smallest_moe_on_the_builtin_simulator": "15 s (45 s loaded)",
    "hdl/test_fabric.py::test_malformed_bitstream_leaves_the_fabric_unconfigured": "9 s",
    # The inner loop took 2 min 03 s on an idle machine with the above out of it.
    "hdl/test_system.py::test_shared_buffer_freed_once_after_the_last_remote_holder": "5 s",
    "hdl/test_mesh.py::test_dual_mesh_responses_flow_while_requests_are_stuck": "5 s",
    # Issue 20's model suite and importer runs and issue 18's host-port tests (a loaded machine,
    # --durations): torch exports in module fixtures, interpreter runs of imported programs, one
    # fabric simulation per module. The importer's refusals, coverage, quantization and graph
    # file tests, the integer ops' tests and the partitioners' stay in the loop.
    "compiler/test_models.py": "19 s (the exports' fixture) + 25 tests",
    "sim/test_bench_models.py": "15 s (setup) + 13 tests",
    "compiler/test_torch_import_nonlinear.py": "21 s",
    "compiler/test_torch_import_conv.py": "45 s loaded (the zoo's fixture 8-13 s)",
    "compiler/test_torch_import_moe.py": "12.7 s idle (three exports and interpreter runs)",
    "hdl/test_host_port.py": "10 s (setup) + 8 + 4 s",
    "compiler/test_bench.py::test_bench_partition_quick": "10.5 s loaded (the model family)",
    "compiler/test_bench.py::test_bench_partition_measures_the_model_suites_graphs":
        "5.8 s (four quick exports and imports)",
    "compiler/test_torch_import.py::test_interpreter_is_bit_exact_against_the_graph":
        "3.3 + 1.2 + 1.0 s",
    "compiler/test_torch_import.py::test_saved_program_imports_the_same_and_random_inputs_are_seeded":
        "1.7 s",
    # Issue 18's second round and issue 20's biases (a loaded machine).
    "hdl/test_stream_hazards.py": "32 s (16 CU harness runs)",
    "compiler/test_import_bias.py": "3.3 s (a torch export)",
    # Issue 18's streams between CUs: the CU pair's shared simulation and the whole 2x2
    # fabric's (the stream engine's queue tests and the interpreter's stay in the loop).
    "hdl/test_cu_streams.py": "7 s idle (one shared simulation), 10-16 s loaded",
    "hdl/test_cu_streams_fabric.py": "15-20 s (the 2x2 fabric on Amaranth)",
}


# --- The hostile-input suite (issue 19) -----------------------------------------------------

#: Multiplier of every hostile-input test's example count, from ``--hostile-examples`` (1 by
#: default, what CI runs; e.g. ``pytest --hostile-examples 50 -k hostile`` for the long run).
HOSTILE_SCALE = 1


def pytest_addoption(parser):
    parser.addoption("--hostile-examples", type=int, default=1, metavar="K",
                     help="run the hostile-input suite's hypothesis tests with K times their "
                          "examples (default 1; docs/errors.md)")


def pytest_configure(config):
    global HOSTILE_SCALE
    HOSTILE_SCALE = max(1, config.getoption("--hostile-examples"))


def hostile(examples):
    """Hypothesis settings of a hostile-input test: ``examples`` in the default suite, times
    ``--hostile-examples`` for a longer run; no deadline (simulations vary in speed)."""
    from hypothesis import HealthCheck, settings
    return settings(max_examples=examples * HOSTILE_SCALE, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = pathlib.Path(str(item.path)).resolve()
        try:
            rel = path.relative_to(HERE)
        except ValueError:
            continue
        if rel.parts[0] == "cosim":
            item.add_marker(pytest.mark.cosim)
        # A table names a file (all its tests), a test (all its parametrizations) or one
        # parametrization.
        ids = {rel.as_posix(), f"{rel.as_posix()}::{item.name.split('[')[0]}",
               f"{rel.as_posix()}::{item.name}"}
        for table, mark in ((SLOW, pytest.mark.slow), (LONG, pytest.mark.long)):
            if ids & table.keys():
                item.add_marker(mark)


#: A graph file of five nodes (input, constant, matmul, relu, output), the smallest a user might
#: write, for the tests of commands that take a graph file.
TINY_GRAPH = ("import numpy as np\n"
              "from rdakit.compiler.graph import DataflowGraph\n"
              "def build():\n"
              "    g = DataflowGraph('tiny')\n"
              "    x = g.input('x', (3, 5), 'int8')\n"
              "    w = g.const('w', np.ones((5, 2), np.int8))\n"
              "    g.output('y', g.add('relu', g.add('matmul', x, w, name='m'), name='r'))\n"
              "    return g\n")


def interpreted(job):
    """The outputs of ``job`` run on the functional interpreter, decoded into the graph's
    arrays (padding lanes checked to be zero); fails the test unless the run ends ok."""
    outputs, result, _ = run_job_interp(job)
    assert result.ok, result.errors
    return job.decode(outputs, check_padding=True)


def assert_interpreter_matches(job, want):
    """``job`` on the functional interpreter gives ``want`` (graph output name -> array), the
    same outputs bit for bit (:func:`interpreted`)."""
    got = interpreted(job)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def assert_rtl_matches_graph(graph, inputs, job, result):
    """An RTL run of ``job`` (``result``, e.g. :func:`~rdakit.sim.bench.calibrate.rtl_cycles`'s)
    gave ``graph``'s outputs for ``inputs`` bit for bit, dtypes and zero padding lanes too."""
    got = job.decode(result.outputs, check_padding=True)
    want = graph.evaluate(inputs)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def assert_rtl_matches_interpreter(job, result):
    """An RTL run of ``job`` ended without a CU error and wrote the interpreter's words into
    every output buffer."""
    outputs, run, _ = run_job_interp(job)
    assert run.ok and not result.status["error"] and result.cycles > 0
    for out in job.outputs:
        np.testing.assert_array_equal(result.outputs[out], outputs[out], err_msg=out)


# --- Amaranth simulation --------------------------------------------------------------------

def run_checked(dut, testbench):
    """Simulate ``dut`` with ``testbench`` on a 1 MHz clock, after converting it to Verilog:
    every simulated configuration is also checked for combinational loops, which Amaranth's
    simulator does not detect (it hangs)."""
    verilog.convert(dut, name="top", emit_src=False)
    sim = Simulator(dut)
    sim.add_clock(1e-6)
    sim.add_testbench(testbench)
    sim.run()


class SharedFabric:
    """One simulation of ``Fabric(params)`` shared by the tests of a module: :meth:`run` hands
    it ``body(host)`` (a :class:`~rdakit.sim.runtime.host.HostDriver` whose transport gives up
    after ``reply_cycles``) and steps the simulator until the body returns (raising what it
    raised), failing the test if it has not after about ``cycles`` cycles (simulator steps: at
    least two a cycle). ``cycles`` counts the clock cycles simulated so far."""

    def __init__(self, params, *, reply_cycles):
        self.fabric = Fabric(params)
        self.sim = Simulator(self.fabric)
        self.sim.add_clock(1e-9)
        self.queue = collections.deque()
        self.done = {}
        self.cycles = 0

        async def server(ctx):
            host = HostDriver(params, AmaranthTransport(ctx, self.fabric,
                                                        reply_cycles=reply_cycles))
            while True:
                if not self.queue:
                    await ctx.tick()
                    continue
                key, body = self.queue.popleft()
                try:
                    self.done[key] = (True, await body(host))
                except Exception as e:                        # handed to the test
                    self.done[key] = (False, e)

        async def clock(ctx):
            async for _ in ctx.tick():
                self.cycles += 1

        self.sim.add_testbench(server, background=True)
        self.sim.add_process(clock)

    def run(self, body, *, cycles=20_000):
        key = object()
        self.queue.append((key, body))
        for _ in range(2 * cycles):
            if key in self.done:
                break
            self.sim.advance()
        else:
            pytest.fail(f"no result after {cycles} cycles: the host port is wedged")
        ok, value = self.done.pop(key)
        if not ok:
            raise value
        return value


async def drive_mesh(ctx, net, n, queues, *, ready_p, rng, on_eject, limit, until=None):
    """Offer the head of ``queues[t]`` on ``net.inject[t]`` and drain ``net.eject[t]`` with
    probability ``ready_p``, for at most ``limit`` cycles or until ``until()``; call
    ``on_eject(cycle, t, payload)`` for every ejection. Returns the cycles run and the
    ``(cycle, tile, payload)`` of every injection."""
    injected = []
    for cycle in range(limit):
        if until is not None and until():
            return cycle, injected
        for t in range(n):
            ctx.set(net.inject[t].valid, bool(queues[t]))
            if queues[t]:
                ctx.set(net.inject[t].payload.as_value(), queues[t][0])
            ctx.set(net.eject[t].ready, rng.random() < ready_p)
        for t in range(n):
            if queues[t] and ctx.get(net.inject[t].ready):
                injected.append((cycle, t, queues[t].pop(0)))
            if ctx.get(net.eject[t].valid) and ctx.get(net.eject[t].ready):
                on_eject(cycle, t, ctx.get(net.eject[t].payload.as_value()))
        await ctx.tick()
    return limit, injected


# --- 32-bit arithmetic of the compute unit and its interpreter ------------------------------

def s32(v):
    """A register value as a signed integer."""
    return v - (1 << 32) if v & (1 << 31) else v


def wrap32(x):
    """int32 of an integer array, modulo 2**32 (numpy's int64 arithmetic wraps modulo 2**64,
    which keeps the low 32 bits exact)."""
    return (np.asarray(x, dtype=np.int64) & 0xffff_ffff).astype(np.uint32).view(np.int32)


def rand32(rng, shape, bits=31):
    """Random signed integers of ``bits + 1`` bits (int64), from the generator ``rng``."""
    return rng.integers(-(1 << bits), 1 << bits, size=shape, dtype=np.int64)


def relu_shift(x, shift, post):
    """The stream engine's output stage: arithmetic shift right, then ReLU if ``post & 1``,
    then saturation to int8 if ``post & 2``."""
    y = wrap32(x) >> shift
    if post & 1:
        y = np.maximum(y, 0)
    return np.clip(y, -128, 127) if post & 2 else y
