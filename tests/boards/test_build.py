"""Real FPGA builds with YoWASP Yosys and nextpnr. The iCE40 one is in the default suite (about
4 minutes, mostly Yosys); the ECP5 one is ``slow``."""

import json

import pytest

from rdakit.cli import main


def test_icebreaker_1x2_build_says_it_does_not_fit(tmp_path, capsys):
    """The smallest fabric (one CU, one MU, the iCEBreaker preset) with its bridge needs about
    three times the UP5K's logic cells: the build says so, with nextpnr's counts."""
    out = tmp_path / "b.json"
    assert main(["board", "build", "icebreaker", "--fabric", "1x2",
                 "--build-dir", str(tmp_path / "build"), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "1x2 fabric on the iCEBreaker (iCE40 UP5K): does not fit: needs " in err
    assert "logic cells (ICESTORM_LC) of 5,280" in err
    data = json.loads(out.read_text())
    rows = {r["bel"]: r for r in data["tables"]["utilization"]}
    assert rows["ICESTORM_LC"]["used"] > rows["ICESTORM_LC"]["available"] == 5280
    assert rows["ICESTORM_RAM"]["available"] == 30 and rows["ICESTORM_DSP"]["available"] == 8
    assert rows["ICESTORM_SPRAM"]["available"] == 4
    assert data["figures"]["fits"] is False and data["figures"]["bitstream"] is None


@pytest.mark.slow
def test_ulx3s_1x2_build_fits_with_fmax(tmp_path):
    out = tmp_path / "b.json"
    assert main(["board", "build", "ulx3s", "--fabric", "1x2",
                 "--build-dir", str(tmp_path / "build"), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["bel"]: r for r in data["tables"]["utilization"]}
    assert 0 < rows["TRELLIS_COMB"]["used"] < rows["TRELLIS_COMB"]["available"]
    assert rows["DP16KD"]["used"] > 0
    fig = data["figures"]
    assert fig["fits"] is True and fig["fmax_mhz"] > 10 and fig["clock_mhz"] == 50
    assert (tmp_path / "build" / "top.bit").stat().st_size > 100_000
