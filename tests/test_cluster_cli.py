"""``rdakit verilog system``: a system's Verilog, its options, and clear errors."""

import pytest

from rdakit.cli import main


def test_verilog_system_writes_a_module(tmp_path, capsys):
    out = tmp_path / "system.v"
    assert main(["verilog", "system", "--clusters", "2", "--rows", "1", "--cols", "2",
                 "--lanes", "1", "--link-width", "8", "--link-latency", "4", "-o", str(out),
                 "--name", "sys_top"]) == 0
    text = out.read_text()
    assert "module sys_top" in text
    for port in ("cmd__0__payload", "cmd__1__payload", "reply__1__valid", "req_packets__1"):
        assert port in text
    assert "2 clusters of 1x2, links 8 wires, 4 cycles" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--clusters", "0"], "--clusters must be from 1 to 256, not 0"),
    (["--clusters", "2", "--bridge", "1"], "--bridge must be X,Y like 1,0, not '1'"),
    (["--clusters", "2", "--bridge", "2,0"],
     "bridge must be the (x, y) of a tile of the 2x2 grid, not (2, 0)"),
    (["--clusters", "2", "--link-latency", "0"],
     "link_latency must be an integer from 1 to 256, not 0"),
    (["--clusters", "2", "--link-width", "0"], "link_width must be an integer from 1 to"),
    (["--clusters", "2", "--rows", "40"], "rows must be an integer between 1 and 16, not 40"),
])
def test_verilog_system_rejects_bad_options(tmp_path, capsys, args, message):
    assert main(["verilog", "system", *args, "-o", str(tmp_path / "x.v")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rdakit: error: ") and message in err, err
    assert not (tmp_path / "x.v").exists()
