"""Hostile input to the command line (issue 19, classes 3, 4 and 9).

Every command checks all its options and output paths before it does any work: a refused
input exits 2 with ``rdakit: error: ...`` naming the option as the user typed it, no
traceback, and no file created or changed. The commands run in-process; a guard stops any
command whose input was accepted before it starts its work (:func:`cli`), so no example here
builds or simulates anything.
"""

import inspect
import math
import os
import pathlib
import re
import tempfile

import pytest
from conftest import TINY_GRAPH, hostile
from hypothesis import assume, given
from hypothesis import strategies as st

import rdakit.cli
from rdakit.cli import main
from rdakit.cli.options import MAX_PLACE_STEPS, max_grid
from rdakit.compiler.workloads import WORKLOADS
from rdakit.files import atomic_path, atomic_write


class Accepted(Exception):
    """Raised instead of the command's work: every check passed."""


@pytest.fixture
def cli(monkeypatch, capsys):
    """``cli(argv)`` -> ``(exit status, stdout, stderr)`` of ``rdakit argv`` run in-process,
    the status ``"accepted"`` when every check passed (the command's work is not run)."""
    checks = rdakit.cli.check_outputs

    def guarded(args):
        checks(args)
        raise Accepted

    monkeypatch.setattr(rdakit.cli, "check_outputs", guarded)

    def run(argv):
        capsys.readouterr()
        try:
            status = main([str(a) for a in argv])
        except SystemExit as e:
            status = e.code
        except Accepted:
            status = "accepted"
        out, err = capsys.readouterr()
        return status, out, err
    return run


def snapshot(folder):
    """Every file under ``folder`` with its contents."""
    return {p: p.read_bytes() for p in pathlib.Path(folder).rglob("*") if p.is_file()}


def assert_refused(result, option, before=None, folder=None):
    status, _, err = result
    assert status == 2, (status, err)
    assert "Traceback" not in err, err
    assert option in err, (option, err)
    if folder is not None:
        assert snapshot(folder) == before


# --- class 3: numbers, grids and sizes --------------------------------------------------------

#: Commands with the fabric's options, each with what it needs besides them.
FABRIC_COMMANDS = [
    ["compile", "mlp"], ["run", "mlp"], ["inspect", "x.bit"], ["verilog", "fabric", "-o", "-"],
    ["bench", "fabric"], ["bench", "e2e", "--sim", "amaranth"], ["board", "build", "icebreaker"],
    ["board", "run", "icebreaker", "matvec", "--port", "/dev/null"],
]
FABRIC_INTS = ["--lanes", "--prog-len", "--local-words", "--mu-words", "--block-words",
               "--max-buffers", "--weight-bits", "--noc-depth"]

#: Text no integer option takes: empty, words, floats, exponents, fractions.
GARBAGE = st.one_of(
    st.text(max_size=8).filter(lambda t: not _is_int(t)),
    st.floats(allow_nan=True, allow_infinity=True).map(repr).filter(lambda t: not _is_int(t)),
    st.sampled_from(["1e9", "0x10", "4.0", "1/2", "", " ", "--", "nan", "inf", "४"]).filter(
        lambda t: not _is_int(t)))


def _is_number(text):
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _is_int(text):
    try:
        int(text)
    except ValueError:
        return False
    return True


#: Integers no fabric takes for any of the fabric's options: below 1, or beyond every range.
OUT_OF_RANGE = st.one_of(st.integers(max_value=0), st.integers(min_value=1 << 41))


@hostile(40)
@given(command=st.sampled_from(FABRIC_COMMANDS), option=st.sampled_from(FABRIC_INTS),
       value=st.one_of(OUT_OF_RANGE.map(str), GARBAGE))
def test_fabric_numbers_are_refused_by_every_command(cli, command, option, value):
    assert_refused(cli([*command, f"{option}={value}"]), option)


@st.composite
def bad_grids(draw):
    high = max_grid()
    kind = draw(st.sampled_from(["garbage", "zero", "large", "one"]))
    if kind == "garbage":
        text = draw(st.text(max_size=10))
        assume(text != "auto" and not re.fullmatch(r"\d+x\d+", text))
        return text
    if kind == "zero":
        return f"0x{draw(st.integers(0, 99))}" if draw(st.booleans()) else \
            f"{draw(st.integers(0, 99))}x0"
    if kind == "large":
        big = draw(st.integers(high + 1, 10 ** 30))
        return f"{big}x{draw(st.integers(1, high))}" if draw(st.booleans()) else \
            f"{draw(st.integers(1, high))}x{big}"
    return "1x1"


@hostile(30)
@given(command=st.sampled_from(FABRIC_COMMANDS + [["verilog", "noc", "-o", "-"],
                                                  ["verilog", "router", "-o", "-"],
                                                  ["bench", "noc"]]),
       grid=bad_grids())
def test_bad_grids_are_refused(cli, command, grid):
    if command[:2] in (["verilog", "noc"], ["verilog", "router"], ["bench", "noc"]) \
            and grid == "1x1":
        return                                  # a 1x1 mesh is a mesh
    assert_refused(cli([*command, f"--fabric={grid}"]), "--fabric")


@hostile(30)
@given(workload=st.sampled_from(sorted(WORKLOADS)), command=st.sampled_from(["compile", "run"]),
       data=st.data())
def test_bad_sizes_are_refused(cli, workload, command, data):
    keys = list(inspect.signature(WORKLOADS[workload]).parameters)
    kind = data.draw(st.sampled_from(["unknown", "negative", "huge", "garbage", "form"]))
    key = data.draw(st.sampled_from(keys))
    if kind == "unknown":
        key = data.draw(st.from_regex(r"[a-z_]{1,8}", fullmatch=True).filter(
            lambda k: k not in keys))
        item = f"{key}=4"
    elif kind == "negative":
        item = f"{key}={data.draw(st.integers(max_value=-1))}"
    elif kind == "huge":
        item = f"{key}={data.draw(st.integers(min_value=1 << 40))}"
    elif kind == "garbage":
        item = f"{key}={data.draw(GARBAGE.filter(lambda t: ',' not in t))}"
    else:
        item = data.draw(st.text(max_size=6).filter(lambda t: "=" not in t or t.startswith("=")))
    assert_refused(cli([command, workload, "--size", item]), "--size")


#: Numeric options of the commands, with values each must refuse.
NUMBERS = [
    (["compile", "mlp"], "--place-steps", st.one_of(st.integers(max_value=-1),
                                                   st.integers(min_value=MAX_PLACE_STEPS + 1))),
    (["run", "mlp"], "--place-steps", st.integers(min_value=MAX_PLACE_STEPS + 1)),
    (["compile", "mlp"], "--seed", st.integers(max_value=-1)),
    (["run", "mlp"], "--adapt", st.one_of(st.integers(max_value=0),
                                          st.integers(min_value=10 ** 6))),
    (["bench", "noc"], "--measure", st.one_of(st.integers(max_value=0),
                                              st.integers(min_value=10 ** 7))),
    (["bench", "noc"], "--warmup", st.integers(min_value=10 ** 7)),
    (["bench", "noc"], "--refine", st.integers(min_value=10 ** 3)),
    (["bench", "noc"], "--hot-fraction", st.one_of(st.floats(min_value=1.01),
                                                   st.floats(max_value=-0.01),
                                                   st.just(math.nan), st.just(math.inf))),
    (["bench", "race"], "--scenarios", st.one_of(st.integers(max_value=0),
                                                 st.integers(min_value=10 ** 6))),
    (["board", "build", "icebreaker"], "--clock-mhz", st.one_of(
        st.floats(max_value=0), st.just(math.nan), st.just(math.inf),
        st.floats(min_value=1e4))),
    (["board", "run", "icebreaker", "matvec", "--port", "p"], "--timeout", st.one_of(
        st.floats(max_value=0), st.just(math.nan), st.floats(min_value=1e5))),
    (["verilog", "router", "-o", "-"], "--payload", st.integers(min_value=10 ** 4)),
    (["verilog", "noc", "-o", "-"], "--depth", st.one_of(st.integers(max_value=0),
                                                        st.integers(min_value=65))),
]


#: The options of :data:`NUMBERS` that take a fraction.
FLOATS = {"--hot-fraction", "--clock-mhz", "--timeout"}


@hostile(40)
@given(case=st.sampled_from(NUMBERS), data=st.data())
def test_numbers_out_of_range_are_refused(cli, case, data):
    command, option, values = case
    garbage = GARBAGE.filter(lambda t: not _is_number(t)) if option in FLOATS else GARBAGE
    value = data.draw(st.one_of(values.map(str), garbage))
    assert_refused(cli([*command, f"{option}={value}"]), option)


# --- class 4: output paths --------------------------------------------------------------------

#: (command, output option, suffix it takes, inputs the command reads: option -> file name).
OUTPUTS = [
    (["compile", "{graph}"], "--output", ".bit"),
    (["compile", "{graph}"], "--listing", ".txt"),
    (["run", "{graph}"], "--report", ".json"),
    (["run", "{graph}"], "--plot", ".png"),
    (["run", "{graph}"], "--profile", ".png"),
    (["run", "{graph}"], "--waves", ".vcd"),
    (["verilog", "mu"], "--output", ".v"),
    (["verilog", "fabric"], "--output", ".v"),
    (["bench", "mu", "--quick"], "--json", ".json"),
    (["bench", "partition", "--quick"], "--json", ".json"),
    (["verify"], "--json", ".json"),
    (["board", "build", "icebreaker"], "--json", ".json"),
]

#: The outputs of :data:`OUTPUTS` that want a suffix.
SUFFIXED = {"--plot", "--profile", "--waves"}

PATH_KINDS = ["folder", "slash", "top-level folder", "through a file", "input", "empty",
              "not a regular file", "unwritable folder", "same as another output"]


def _bad_path(kind, folder, suffix):
    """A path of ``kind`` for an output ending in ``suffix``, under ``folder``."""
    return {"folder": folder / "sub",
            "slash": f"{folder / 'new'}/",
            "top-level folder": f"/rdakit-hostile-{os.getpid()}/x{suffix}",
            "through a file": folder / "graph.py" / f"x{suffix}",
            "input": folder / "graph.py",
            "empty": "",
            "not a regular file": "/dev/null",
            "unwritable folder": f"/proc/x{suffix}",
            "same as another output": folder / f"out{suffix}"}[kind]


@hostile(40)
@given(case=st.sampled_from(OUTPUTS), kind=st.sampled_from(PATH_KINDS))
def test_bad_output_paths_are_refused_before_any_work(cli, case, kind):
    command, option, suffix = case
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        (folder / "sub").mkdir()
        (folder / "graph.py").write_text(TINY_GRAPH)
        argv = [c.format(graph=folder / "graph.py") for c in command]
        if kind == "input" and "{graph}" not in command[1:2]:
            return                              # no input file to overwrite
        path = _bad_path(kind, folder, suffix)
        extra = []
        if kind == "same as another output":
            others = [o for c, o, s in OUTPUTS if c == command and o != option and (
                s == suffix or not {o, option} & SUFFIXED)]
            if not others:
                return
            extra = [f"{others[0]}={path}"]
        before = snapshot(folder)
        assert_refused(cli([*argv, *extra, f"{option}={path}"]), option, before, folder)
        assert not pathlib.Path(f"/rdakit-hostile-{os.getpid()}").exists()


@hostile(20)
@given(suffix=st.sampled_from(["", ".txt", ".json", ".bit", ".v", ".PNGX", ".png.txt"]),
       option=st.sampled_from(["--plot", "--profile"]))
def test_plots_take_image_suffixes_only(cli, tmp_path, suffix, option):
    before = snapshot(tmp_path)
    assert_refused(cli(["run", "mlp", f"{option}={tmp_path / 'x'}{suffix}"]), option, before,
                   tmp_path)


# --- one plain test per class -----------------------------------------------------------------

def test_class3_run_and_bench_refuse_bad_fabric_options_with_exit_2(capsys):
    """``rdakit run`` and ``rdakit bench e2e`` turned invalid fabric options into a traceback
    with exit 1, and named derived parameters (``data_bits`` for ``--lanes 0``, ``mu_id_bits``
    for ``--fabric 1000x1000``); now exit 2 naming the option, before any work."""
    for argv, message in [
        (["run", "moe", "--lanes", "3"], "--lanes must be a power of two from 1 to 16, not 3"),
        (["run", "moe", "--lanes", "0"], "--lanes must be a power of two from 1 to 16, not 0"),
        (["run", "moe", "--fabric", "0x0"],
         f"--fabric must be ROWSxCOLS with 1 to {max_grid()} rows and columns, not '0x0'"),
        (["bench", "e2e", "--sim", "amaranth", "--mu-words", "1000"],
         "--mu-words must be a power of two from 32 to 65536, not 1000"),
        (["bench", "e2e", "--sim", "amaranth", "--noc-depth", "0"],
         "--noc-depth must be an integer from 1 to 64, not 0"),
        (["compile", "mlp", "--fabric", "1000x1000"],
         f"--fabric must be ROWSxCOLS with 1 to {max_grid()} rows and columns, "
         f"not '1000x1000'"),
        (["compile", "mlp", "--local-words", "8192", "--lanes", "16"],
         "--lanes must be a power of two from 1 to 4 with --local-words 8192, not 16"),
        (["bench", "e2e", "--sim", "amaranth", "--fabric", "auto"],
         "--fabric must be ROWSxCOLS like 4x4, not 'auto' (auto chooses the fabric of a "
         "workload: rdakit compile, run and inspect)"),
        (["bench", "boards", "--grids", "2x2,100x100"],
         f"--grids must be ROWSxCOLS with 1 to {max_grid()} rows and columns, not '100x100'"),
    ]:
        assert main(argv) == 2
        assert capsys.readouterr().err == f"rdakit: error: {message}\n"


def test_class4_outputs_never_destroy_inputs_or_each_other(tmp_path, capsys):
    """``compile g.py -o g.py`` overwrote the graph with the bitstream (exit 0), ``-o x
    --listing x`` kept only the listing, ``--report DIR`` and ``--plot x.txt`` failed after
    the simulation, and a missing folder was a traceback for ``compile -o`` but made for
    ``verilog -o``, even at the top of the file system."""
    graph = tmp_path / "g.py"
    graph.write_text(TINY_GRAPH)
    top = f"/rdakit-missing-{os.getpid()}"
    for argv, message in [
        (["compile", graph, "-o", graph],
         f"--output '{graph}' is the input WORKLOAD '{graph}': writing it would destroy it"),
        (["compile", graph, "-o", tmp_path / "x", "--listing", tmp_path / "x"],
         f"--output and --listing name the same file '{tmp_path / 'x'}'"),
        (["run", "mlp", "--report", tmp_path],
         f"--report '{tmp_path}' is a folder; name a file in it"),
        (["run", "mlp", "--plot", tmp_path / "x.txt"], "--plot must name an image file ending "
                                                       "in .png, "),
        (["compile", graph, "-o", f"{top}/g.bit"], f"the folder {top} does not exist"),
        (["verilog", "mu", "-o", f"{top}/mu.v"], f"the folder {top} does not exist"),
    ]:
        assert main([str(a) for a in argv]) == 2
        assert message in capsys.readouterr().err
    assert graph.read_text() == TINY_GRAPH
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.py"]
    assert not pathlib.Path(top).exists()
    # A missing folder below an existing one is made, for every command alike.
    assert main(["compile", str(graph), "--fabric", "2x2", "--mu-words", "1024",
                 "-o", str(tmp_path / "new" / "g.bit")]) == 0
    assert (tmp_path / "new" / "g.bit").read_bytes()[:4] == b"RDAB"


def test_class4_an_interrupted_write_leaves_the_old_file(tmp_path):
    """Files are written to a temporary file in the same folder and renamed: a write that
    fails half-way leaves the old file whole and no temporary file behind."""
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    atomic_write(path, "new")
    assert path.read_text() == "new" and len(list(tmp_path.iterdir())) == 1
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_class9_the_default_workload_compiles_on_the_default_fabric(tmp_path, capsys):
    """No built-in workload fitted the default fabric at its default sizes (``rdakit compile
    mlp``: "Constant 'w1' needs 2048 words but an MU buffer holds at most 1024"); with
    ``--fabric auto`` (the default) it compiles, and the fabric chosen is named. Every other
    workload: ``tests/compiler/test_compile_cli.py``."""
    assert main(["compile", "mlp", "-o", str(tmp_path / "w.bit")]) == 0
    chosen = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("fabric ")]
    assert chosen == ["fabric 2x2 with 4096-word MUs: the smallest that fits mlp_b4_64x128x64 "
                      "(--fabric 2x2 --mu-words 4096 gives the same)"]
    # ... and the defaults work together: inspect finds the fabric the bitstream is for.
    assert main(["inspect", str(tmp_path / "w.bit")]) == 0
    assert "tile (0, 0) CU enabled" in capsys.readouterr().out


def test_hostile_examples_multiplies_every_property_test(tmp_path):
    """``pytest --hostile-examples K`` runs K times the examples (the helper's scale is the
    one pytest's conftest read, whatever module a test imports it from)."""
    import subprocess
    import sys
    test = "tests/compiler/test_lower.py::test_one_row_times_a_run_time_operand_adds_up_its_rows"
    root = pathlib.Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", test, "--hostile-examples", "3",
                          "--hypothesis-show-statistics"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "60 passing" in run.stdout, run.stdout
