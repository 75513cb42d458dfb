# amaranth: UnusedElaboratable=no
"""Board builds without building: presets, the PLL search, nextpnr log parsing, the board top
on both platforms, the serial port, and the command line's errors. The real builds are in
test_build.py."""

import pytest

from rdakit.boards.build import (
    BOARDS,
    board_preset,
    board_spec,
    parse_fmax,
    parse_utilization,
)
from rdakit.boards.serial_link import SerialPort
from rdakit.boards.top import BoardTop, ecp5_pll
from rdakit.cli import main
from rdakit.hdl.spec.params import fabric_params


def test_ecp5_pll_matches_ecppll():
    # The dividers Yosys' ecppll prints for 25 -> 50 MHz and 25 -> 40 MHz.
    assert ecp5_pll(25e6, 50e6) == ({"p_CLKI_DIV": 1, "p_CLKFB_DIV": 2, "p_CLKOP_DIV": 12,
                                     "p_CLKOP_CPHASE": 5, "p_CLKOP_FPHASE": 0}, 50e6)
    params, f = ecp5_pll(25e6, 40e6)
    assert (params["p_CLKI_DIV"], params["p_CLKFB_DIV"], params["p_CLKOP_DIV"],
            params["p_CLKOP_CPHASE"]) == (5, 8, 15, 7) and f == 40e6
    with pytest.raises(ValueError, match=r"^The ECP5 PLL cannot make 1000 MHz from 25 MHz "
                                         r"\(closest 800 MHz\)$"):
        ecp5_pll(25e6, 1000e6)


LOG = """\
Info: Device utilisation:
Info: 	         ICESTORM_LC:   900/ 5280    17%
Info: 	        ICESTORM_RAM:     4/   30    13%
Info: 	               SB_IO:     4/   96     4%

Info: Placed 1 cells based on constraints.
Info: Device utilisation:
Info: 	         ICESTORM_LC: 10617/ 5280   201%
Info: 	        ICESTORM_RAM:    20/   30    66%
Info: 	      ICESTORM_SPRAM:     0/    4     0%
Info: 	        ICESTORM_DSP:     6/    8    75%

ERROR: Unable to place cell 'x', no BELs remaining to implement cell type 'ICESTORM_LC'
Info: Max frequency for clock 'clk': 18.20 MHz (PASS at 12.00 MHz)
Info: Max frequency for clock 'clk': 17.91 MHz (PASS at 12.00 MHz)
ERROR: Max frequency for clock '$glbnet$clk': 19.67 MHz (FAIL at 50.00 MHz)
"""


def test_parse_nextpnr_log():
    assert parse_utilization(LOG) == {"ICESTORM_LC": (10617, 5280), "ICESTORM_RAM": (20, 30),
                                      "ICESTORM_SPRAM": (0, 4), "ICESTORM_DSP": (6, 8)}
    assert parse_fmax(LOG) == {"clk": 17.91, "$glbnet$clk": 19.67}
    assert parse_utilization("nothing") == {} and parse_fmax("") == {}


def test_presets_are_valid_fabrics():
    for board in BOARDS:
        p = fabric_params(2, 2, **board_preset(board))
        assert p.cu.lanes <= 2 and p.noc_depth == 2
    with pytest.raises(ValueError, match=r"^Board must be one of icebreaker, ulx3s, not 'x'$"):
        board_spec("x")


@pytest.mark.parametrize("board", sorted(BOARDS))
def test_board_top_prepares(board, tmp_path):
    """The board top against each amaranth-boards platform: UART pins, LEDs, and on the ULX3S
    a PLL making the 50 MHz fabric clock with its constraint."""
    spec = board_spec(board)
    params = fabric_params(1, 2, **board_preset(board))
    platform = spec.create_platform()
    plan = platform.prepare(BoardTop(params, clock_hz=spec.default_clock_hz,
                                     baud=spec.default_baud), "top")
    files = plan.files
    rtlil = files["top.il"]
    text = rtlil if isinstance(rtlil, str) else rtlil.decode()
    if board == "ulx3s":
        assert "EHXPLLL" in text
        assert 'FREQUENCY NET "sync_0__clk" 50000000' in files["top.lpf"] or \
            "50000000" in files["top.lpf"]
    else:
        assert "EHXPLLL" not in text
        assert "uart_0__rx" in files["top.pcf"] and "uart_0__tx" in files["top.pcf"]


def test_serial_port_moves_bytes_and_times_out():
    import asyncio

    port = SerialPort("loop://", baud=115200, timeout=0.05)

    async def go():
        await port.write(b"\xa5\x01")
        return [await port.read_byte(), await port.read_byte(), await port.read_byte()]

    assert asyncio.run(go()) == [0xA5, 0x01, None]
    port.close()


@pytest.mark.parametrize("argv, message", [
    (["board", "build", "nope"], "Board must be one of icebreaker, ulx3s, not 'nope'"),
    (["board", "build", "icebreaker", "--clock-mhz", "24"],
     "Clock of a iCEBreaker (iCE40 UP5K) build must be its 12 MHz oscillator"),
    (["board", "build", "icebreaker", "--fabric", "2by2"],
     "--fabric must be ROWSxCOLS like 4x4, not '2by2'"),
    (["board", "build", "ulx3s", "--lanes", "3"],
     "--lanes must be a power of two from 1 to 16, not 3"),
    (["board", "build", "ulx3s", "--baud", "30000000"],
     "Baud rate 30000000 is too fast for a 50 MHz clock"),
    (["board", "run", "icebreaker", "vector-add", "--port", "/nonexistent/tty"],
     "cannot open /nonexistent/tty"),
    (["board", "run", "icebreaker", "vector-add", "--port", "loop://", "--size", "99"],
     "n must be at most local_words (16), not 99"),
    (["bench", "boards", "--boards", "icebreaker,nope"],
     "Board must be one of icebreaker, ulx3s, not 'nope'"),
    (["bench", "boards", "--grids", "2x2,3"], "--grids must be ROWSxCOLS like 4x4, not '3'"),
    (["bench", "boards", "--mu-words", "1k"],
     "--mu-words must be numbers separated by commas, not '1k'"),
])
def test_cli_errors(argv, message, capsys, tmp_path):
    if argv[1] == "build":
        argv = argv + ["--build-dir", str(tmp_path / "b")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_board_run_without_a_board_says_so(capsys):
    """A port with nothing behind it (pyserial's loop:// echoes our frames, which are not
    answers): the driver gives up after its retries with a clear message."""
    assert main(["board", "run", "icebreaker", "vector-add", "--port", "loop://",
                 "--timeout", "0.01"]) == 2
    err = capsys.readouterr().err
    assert "no answer to a OPEN frame (SEQ 0) after 5 tries" in err
    assert "is the board programmed" in err


def test_bench_search_stops_at_the_first_misfit_and_grows_the_mu(monkeypatch, tmp_path):
    """The search with a stand-in for the builds: a design fits while its tiles times MU words
    stay under a budget."""
    import json

    from rdakit.boards.build import BuildResult
    from rdakit.sim.bench import boards as bench

    built = []

    def fake_build(board, params, *, build_dir, log=None):
        size = params.rows * params.cols * params.mu.words
        built.append((params.rows, params.cols, params.mu.words))
        fits = size <= 4 * 2048
        return BuildResult(board=board, fits=fits,
                           utilization={"TRELLIS_COMB": (size, 4 * 2048)},
                           fmax_mhz=60.0 if fits else None, clock_mhz=50.0,
                           problem=None if fits else "does not fit: needs more",
                           seconds=1.0, build_dir=str(build_dir), bitstream=None)

    monkeypatch.setattr(bench, "build", fake_build)
    out = tmp_path / "b.json"
    assert main(["bench", "boards", "--boards", "ulx3s", "--grids", "1x2,2x2,3x3,4x4",
                 "--root", str(tmp_path), "--json", str(out)]) == 0
    # 1x2 and 2x2 fit with the preset's 1024 words, 3x3 does not; then 2x2 with 2048 fits
    # and 4096 does not.
    assert built == [(1, 2, 1024), (2, 2, 1024), (3, 3, 1024), (2, 2, 2048), (2, 2, 4096)]
    data = json.loads(out.read_text())
    assert data["figures"] == {"ulx3s.largest_grid": "2x2", "ulx3s.largest_mu_words": 2048,
                               "ulx3s.fmax_mhz": 60.0, "ulx3s.meets_clock": True}
    rows = data["tables"]["ulx3s_builds"]
    assert data["titles"]["ulx3s_builds"] == "ULX3S (ECP5 85F): builds"
    assert [r["fits"] for r in rows] == [True, True, False, True, False]
    assert rows[2]["problem"] == "does not fit: needs more"
