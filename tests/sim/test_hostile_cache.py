"""Concurrent runs and the build caches (issue 19, class 5): where the caches are, entries
published whole under concurrent builders and interruptions, a folder of its own for every run,
board build folders that are replaced whole and never when they are the user's."""

import json
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import platformdirs
import pytest
from conftest import hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.boards import build as board_build
from rdakit.cli import main
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.verify import cache, formal, runner
from rdakit.sim.verify.cache import CacheError, cache_root, locked, make_folder, publish, use

ROOT = pathlib.Path(__file__).resolve().parents[2]
COSIM = ROOT / "tests" / "cosim"


# --- Where the cache is -----------------------------------------------------------------------

def test_cache_root_is_the_user_cache_folder_unless_the_environment_says(monkeypatch, tmp_path):
    for var in cache.CACHE_ENV:
        monkeypatch.delenv(var, raising=False)
    assert cache_root() == pathlib.Path(platformdirs.user_cache_dir("rdakit"))
    monkeypatch.setenv("RDAKIT_BUILD_DIR", str(tmp_path / "old"))
    assert cache_root() == tmp_path / "old"
    monkeypatch.setenv("RDAKIT_CACHE_DIR", str(tmp_path / "new"))
    assert cache_root() == tmp_path / "new"          # the new name first
    monkeypatch.setenv("RDAKIT_CACHE_DIR", "  ")
    assert cache_root() == tmp_path / "old"          # blank is unset
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RDAKIT_CACHE_DIR", "rel")
    assert cache_root() == tmp_path / "rel"          # absolute: simulators run elsewhere


def test_runner_and_proofs_use_the_cache_root_not_the_checkout(tmp_path):
    # A fresh interpreter: the roots are read when the modules are imported.
    env = {k: v for k, v in os.environ.items() if k not in cache.CACHE_ENV}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    out = subprocess.run(
        [sys.executable, "-c", "from rdakit.sim.verify import formal, runner; "
                               "print(runner.BUILD_ROOT); print(formal.BUILD_ROOT)"],
        env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(tmp_path / "xdg" / "rdakit")] * 2


@hostile(25)
@given(name=st.text(min_size=1, max_size=300))
def test_a_cache_folder_is_made_or_refused_with_its_name(tmp_path, name):
    # Whatever RDAKIT_CACHE_DIR says (NUL bytes, names too long, a file in the way), the
    # folder is made or the error is a UserError naming it, never an OSError traceback.
    (tmp_path / "file").write_text("")
    for path in (tmp_path / name, tmp_path / "file" / name):
        try:
            made = make_folder(path)
        except CacheError as e:
            assert str(path) in str(e)
        else:
            assert made.is_dir()


def test_a_bad_cache_root_is_a_user_error_of_the_cli(monkeypatch, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(formal, "BUILD_ROOT", tmp_path / "file" / "cache")
    assert main(["verify", "free_list.exclusive"]) == 2
    assert f"Cannot create {tmp_path / 'file' / 'cache' / 'formal'}" in capsys.readouterr().err


def test_gateware_key_covers_every_rdakit_module_the_gateware_imports():
    # What Python actually imports to build the gateware (here the NoC harness, whose
    # neighbour table comes from the models, and the board top) is in the Verilog cache's key.
    code = ("import sys; import rdakit.sim.verify.noc_harness, rdakit.boards.top; "
            "print('\\n'.join(m.__file__ for n, m in list(sys.modules.items()) "
            "if n.startswith('rdakit') and getattr(m, '__file__', None)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    keyed = set(runner._gateware_sources())
    assert {pathlib.Path(f).resolve() for f in loaded} <= keyed
    assert ROOT / "sim" / "models" / "noc.py" in keyed


# --- Publishing entries -------------------------------------------------------------------------

PARTS = 20


def _slow_build(log):
    def build(folder):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        for i in range(PARTS):
            (folder / f"part{i}").write_text(str(i) * 1000)
            time.sleep(0.01)
    return build


def _publish_in_a_process(base, log):
    return str(publish(pathlib.Path(base), "fake", "0123abcd", _slow_build(log)))


def _complete(entry):
    return (sorted(p.name for p in entry.iterdir()) == sorted(f"part{i}" for i in range(PARTS))
            and all((entry / f"part{i}").read_text() == str(i) * 1000 for i in range(PARTS)))


def test_two_processes_building_one_entry_build_it_once_and_never_show_half(tmp_path):
    base, log = tmp_path / "kind", tmp_path / "builds.log"
    seen, stop = [], threading.Event()

    def watch():
        while True:                 # and once more after the builders are done
            done = stop.is_set()
            for entry in base.glob("fake-*") if base.exists() else ():
                if entry.is_dir():
                    seen.append(_complete(entry))
            if done:
                return

    # Forked before the watcher thread starts (forking a process with threads is unsafe).
    with multiprocessing.get_context("fork").Pool(2) as pool:
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            paths = pool.starmap(_publish_in_a_process, [(base, log)] * 2)
        finally:
            stop.set()
            watcher.join()
    assert paths[0] == paths[1] == str(base / "fake-0123abcd")
    assert len(log.read_text().split()) == 1           # built once; the other one waited
    assert seen and all(seen)                          # only ever complete
    assert _complete(base / "fake-0123abcd")
    assert [p.name for p in base.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_build_publishes_nothing(tmp_path, interrupt):
    def build(folder):
        (folder / "part0").write_text("half")
        raise interrupt("stop")

    with pytest.raises(interrupt):
        publish(tmp_path, "fake", "0123abcd", build)
    assert not (tmp_path / "fake-0123abcd").exists()
    assert [p for p in tmp_path.iterdir() if p.suffix != ".lock"] == []
    # The next run builds it, whole.
    entry = publish(tmp_path, "fake", "0123abcd", _slow_build(tmp_path / "log"))
    assert _complete(entry)


def _build_forever(base, started):
    def build(folder):
        (folder / "part0").write_text("half")
        started.set()
        time.sleep(60)
    publish(pathlib.Path(base), "fake", "0123abcd", build)


def test_a_killed_builder_leaves_no_entry_and_no_lock_held(tmp_path):
    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()
    proc = ctx.Process(target=_build_forever, args=(tmp_path, started))
    proc.start()
    try:
        assert started.wait(30)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
    assert not (tmp_path / "fake-0123abcd").exists()
    entry = publish(tmp_path, "fake", "0123abcd", _slow_build(tmp_path / "log"))
    assert _complete(entry)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # cleaned up


def test_a_builder_that_loses_the_rename_drops_its_copy(tmp_path):
    # As if another builder got past the lock (its file removed) and published first.
    def build(folder):
        (folder / "mine").write_text("mine")
        final = tmp_path / "fake-0123abcd"
        final.mkdir()
        (final / "theirs").write_text("theirs")

    entry = publish(tmp_path, "fake", "0123abcd", build)
    assert [p.name for p in entry.iterdir()] == ["theirs"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_eviction_keeps_the_newest_and_the_entries_in_use(tmp_path):
    def build(folder):
        (folder / "x").write_text("x")

    with use(tmp_path, "fake", "aaaa", build) as in_use:
        for digest in ("bbbb", "cccc", "dddd"):
            time.sleep(0.02)
            publish(tmp_path, "fake", digest, build, keep=2)
        publish(tmp_path, "other", "eeee", build, keep=1)
        assert in_use.is_dir()
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["fake-aaaa", "fake-cccc", "fake-dddd", "other-eeee"]
    # Out of use, it goes at the next publication.
    publish(tmp_path, "fake", "ffff", build, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "fake-dddd", "fake-ffff", "other-eeee"]


def test_a_lock_removed_under_a_waiter_is_not_taken(tmp_path):
    lock = tmp_path / "x.lock"
    got = []
    with locked(lock):
        waiter = threading.Thread(target=lambda: got.append(_hold(lock)))
        waiter.start()
        time.sleep(0.1)
        lock.unlink()          # as eviction does while it holds the lock
    waiter.join()
    assert got == [True]


def _hold(lock):
    with locked(lock):
        return lock.exists()   # the file the waiter holds is the one at the path


# --- Runs -----------------------------------------------------------------------------------

TINY = "module top(input clk, input rst, output reg [3:0] q);\n" \
       "  always @(posedge clk) q <= rst ? 4'd0 : q + 4'd1;\nendmodule\n"

TINY_TB = """
import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

@cocotb.test()
async def counts(dut):
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.rst.value = 1
    await RisingEdge(dut.clk)
    dut.rst.value = 0
    for _ in range(3):
        await RisingEdge(dut.clk)
    assert SHOULD_PASS, "told to fail"
"""


def _tiny_tb(folder, name, passes):
    (folder / f"{name}.py").write_text(TINY_TB.replace("SHOULD_PASS", str(passes)))
    return name


@pytest.fixture
def icarus(tmp_path, monkeypatch):
    runner.require_simulator("icarus")
    monkeypatch.setattr(runner, "BUILD_ROOT", tmp_path / "cache")
    return tmp_path


@pytest.mark.cosim
def test_a_run_that_passes_leaves_no_run_folder_and_one_that_fails_keeps_it_named(icarus):
    ok = runner.run_cocotb(None, verilog_text=TINY, simulator="icarus",
                           test_module=_tiny_tb(icarus, "tiny_ok", True), test_dir=icarus,
                           build_name="tiny")
    assert ok["tests"] == 1 and ok["work_dir"] is None
    assert list((icarus / "cache" / "runs").iterdir()) == []
    with pytest.raises(runner.CosimFailure, match="told to fail") as e:
        runner.run_cocotb(None, verilog_text=TINY, simulator="icarus",
                          test_module=_tiny_tb(icarus, "tiny_bad", False), test_dir=icarus,
                          build_name="tiny")
    log = pathlib.Path(str(e.value).rsplit("see ", 1)[1])
    assert log.name == "sim.log" and log.parent.parent == icarus / "cache" / "runs"
    assert "told to fail" in log.read_text()
    # The same design was built once for both runs.
    assert len([p for p in (icarus / "cache" / "sim").glob("tiny-icarus-*") if p.is_dir()]) == 1


@pytest.mark.cosim
def test_a_build_that_fails_names_its_log_and_leaves_no_entry(icarus):
    with pytest.raises(runner.CosimFailure, match=r"icarus build of broken failed .*; see ") as e:
        runner.run_cocotb(None, verilog_text="module top(; endmodule\n", simulator="icarus",
                          test_module=_tiny_tb(icarus, "tiny_ok", True), test_dir=icarus,
                          build_name="broken")
    log = pathlib.Path(str(e.value).rsplit("see ", 1)[1])
    assert log.name == "build.log" and "syntax error" in log.read_text()
    assert [p for p in (icarus / "cache" / "sim").iterdir() if p.suffix != ".lock"] == []


def test_two_runs_get_their_own_folders(tmp_path):
    assert cache.run_folder(tmp_path, "r") != cache.run_folder(tmp_path, "r")


MU_RUN = """
import dataclasses, json, sys
from rdakit.hdl.memory.unit import MemoryUnit
from rdakit.hdl.spec.params import MUParams
from rdakit.sim.verify import runner
p = MUParams(words=256, block_words=4, max_buffers=16, buf_id_bits=6, weight_bits=3,
             max_buffer_words=64)
cfg = {"params": {k: getattr(v, "value", v) for k, v in dataclasses.asdict(p).items()},
       "mu_id": 3, "ops": 1500, "seed": 1}
r = runner.run_cocotb(MemoryUnit(p, mu_id=3), simulator="icarus", test_module="mu_tb",
                      test_dir=sys.argv[1], build_name="hostile-mu", config=cfg,
                      seed=int(sys.argv[2]), keep=True)
print(json.dumps({k: str(v) for k, v in r.items()}))
"""


@pytest.mark.cosim
def test_two_icarus_runs_of_one_design_at_once_both_pass_in_their_own_folders(tmp_path):
    runner.require_simulator("icarus")
    env = {**os.environ, "RDAKIT_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", MU_RUN, str(COSIM), str(seed)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (11, 22)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    runs = [json.loads(out.splitlines()[-1]) for out, _err in outs]
    assert runs[0]["build_dir"] == runs[1]["build_dir"]          # one build, shared
    assert runs[0]["work_dir"] != runs[1]["work_dir"]            # a folder each
    for run, seed in zip(runs, (11, 22), strict=True):
        log = (pathlib.Path(run["work_dir"]) / "sim.log").read_text()
        assert f"Seeding Python random module with {seed}" in log


# --- Board build folders --------------------------------------------------------------------

@pytest.fixture
def fake_board_build(monkeypatch):
    """board_build.build with the synthesis replaced: writes a bitstream, or raises what
    ``fail`` holds."""
    fail = []

    def build_in(folder, spec, params, **kw):
        (folder / "top.bin").write_text("new")
        (folder / "build.log").write_text("log")
        if fail:
            raise fail[0]
        return board_build.BuildResult(
            board=spec.name, fits=True, utilization={}, fmax_mhz=20.0, clock_mhz=12.0,
            problem=None, seconds=0.0, build_dir=str(folder), bitstream=str(folder / "top.bin"))

    monkeypatch.setattr(board_build, "_build_in", build_in)
    return fail


PARAMS = fabric_params(1, 2)


def test_a_board_build_never_replaces_a_folder_that_is_not_a_build(tmp_path, fake_board_build):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match=f"Build folder {mine} exists and is not an rdakit "
                                         f"board build folder"):
        board_build.build("icebreaker", PARAMS, build_dir=mine)
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_board_build_replaces_the_previous_one_whole(tmp_path, fake_board_build):
    target = tmp_path / "b"
    first = board_build.build("icebreaker", PARAMS, build_dir=target)
    assert first.bitstream == str(target / "top.bin")
    (target / "stale.txt").write_text("from the first build")
    board_build.build("icebreaker", PARAMS, build_dir=target)
    assert sorted(p.name for p in target.iterdir()) == [board_build.MARKER, "build.log",
                                                        "top.bin"]
    fake_board_build.append(KeyboardInterrupt())
    (target / "top.bin").write_text("previous")
    with pytest.raises(KeyboardInterrupt):
        board_build.build("icebreaker", PARAMS, build_dir=target)
    assert (target / "top.bin").read_text() == "previous"        # left whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]    # nothing half left


def test_board_build_cli_refuses_a_users_folder_with_exit_2(tmp_path, fake_board_build,
                                                            capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main(["board", "build", "icebreaker", "--build-dir", str(mine)]) == 2
    assert f"Build folder {mine} exists and is not an rdakit board build folder" in \
        capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep"
