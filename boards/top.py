"""The top level of a board build: a fabric behind the host bridge on the board's UART pins.

:class:`BoardTop` asks the platform for the UART and the LEDs, makes the ``sync`` clock domain
(the board's oscillator, or an ECP5 PLL when the fabric clock differs from it) and puts a
:class:`~rdakit.hdl.host.bridge.BridgedFabric` in it.
"""

from amaranth.build import ResourceError
from amaranth.hdl import ClockDomain, ClockSignal, Elaboratable, Instance, Module, Signal
from amaranth.lib import io
from amaranth.lib.cdc import ResetSynchronizer

from rdakit.hdl.host.bridge import BridgedFabric
from rdakit.hdl.host.uart import baud_divisor

__all__ = ["BoardTop", "ecp5_pll"]


def ecp5_pll(f_in_hz, f_out_hz):
    """EHXPLLL dividers for ``f_out_hz`` from ``f_in_hz`` (the search of Yosys' ``ecppll``:
    phase-detector input at least 3.125 MHz, VCO 400-800 MHz, closest output, VCO nearest
    600 MHz among ties). Returns ``(params, achieved_hz)``."""
    best = None
    f_in = f_in_hz / 1e6
    target = f_out_hz / 1e6
    for clki in range(1, 129):
        fpfd = f_in / clki
        if fpfd < 3.125:
            break
        for fb in range(1, 81):
            fout = fpfd * fb
            for op in range(1, 129):
                fvco = fout * op
                if not 400 <= fvco <= 800:
                    continue
                key = (abs(fout - target), abs(fvco - 600))
                if best is None or key < best[0]:
                    best = (key, clki, fb, op, fout)
    if best is None:
        raise ValueError(f"No ECP5 PLL setting makes {target:g} MHz from {f_in:g} MHz")
    (_, _), clki, fb, op, fout = best
    if abs(fout - target) / target > 0.01:
        raise ValueError(f"The ECP5 PLL cannot make {target:g} MHz from {f_in:g} MHz "
                         f"(closest {fout:g} MHz)")
    params = {"p_CLKI_DIV": clki, "p_CLKFB_DIV": fb, "p_CLKOP_DIV": op,
              "p_CLKOP_CPHASE": (op - 1) // 2, "p_CLKOP_FPHASE": 0}
    return params, fout * 1e6


class BoardTop(Elaboratable):
    """A fabric with its host bridge on a board.

    Parameters
    ----------
    params : FabricParams
    clock_hz : float
        The fabric's clock; on an ECP5 board, a PLL makes it from the oscillator.
    baud : int
        UART baud rate.
    """

    def __init__(self, params, *, clock_hz, baud, timeout_s=0.01):
        self.params = params
        self.clock_hz = clock_hz
        self.baud = baud
        self.divisor = baud_divisor(clock_hz, baud)
        self.timeout = max(20 * self.divisor, int(timeout_s * clock_hz))

    def elaborate(self, platform):
        m = Module()
        osc_hz = platform.default_clk_frequency
        if abs(self.clock_hz - osc_hz) > 1:
            # ECP5 only (BoardSpec checks): a PLL, with reset held until it locks.
            params, _ = ecp5_pll(osc_hz, self.clock_hz)
            m.submodules.clk_buf = clk_buf = io.Buffer(
                "i", platform.request(platform.default_clk, 0, dir="-"))
            clk_in = clk_buf.i
            m.domains.sync = ClockDomain("sync")
            locked = Signal()
            clk = Signal()
            m.d.comb += ClockSignal("sync").eq(clk)
            m.submodules.pll = Instance(
                "EHXPLLL",
                a_FREQUENCY_PIN_CLKI=str(osc_hz / 1e6),
                a_FREQUENCY_PIN_CLKOP=str(self.clock_hz / 1e6),
                a_ICP_CURRENT="12", a_LPF_RESISTOR="8", a_MFG_ENABLE_FILTEROPAMP="1",
                a_MFG_GMCREF_SEL="2",
                p_PLLRST_ENA="DISABLED", p_INTFB_WAKE="DISABLED", p_STDBY_ENABLE="DISABLED",
                p_DPHASE_SOURCE="DISABLED", p_OUTDIVIDER_MUXA="DIVA", p_CLKOP_ENABLE="ENABLED",
                p_FEEDBK_PATH="CLKOP", **params,
                i_RST=0, i_STDBY=0, i_CLKI=clk_in, o_CLKOP=clk, i_CLKFB=clk, i_PHASESEL0=0,
                i_PHASESEL1=0, i_PHASEDIR=1, i_PHASESTEP=1, i_PHASELOADREG=1, i_PLLWAKESYNC=0,
                i_ENCLKOP=0,
                o_LOCK=locked)
            m.submodules.reset_sync = ResetSynchronizer(~locked, domain="sync")
            platform.add_clock_constraint(clk, self.clock_hz)

        m.submodules.top = top = BridgedFabric(self.params, divisor=self.divisor,
                                               timeout=self.timeout)
        uart = platform.request("uart", 0, dir="-")
        m.submodules.rx_buf = rx_buf = io.Buffer("i", uart.rx)
        m.submodules.tx_buf = tx_buf = io.Buffer("o", uart.tx)
        m.d.comb += [top.rx.eq(rx_buf.i), tx_buf.o.eq(top.tx)]
        leds = []
        for i in range(4):
            try:
                port = platform.request("led", i, dir="-")
            except ResourceError:   # a board with fewer LEDs
                break
            m.submodules[f"led_{i}"] = buf = io.Buffer("o", port)
            leds.append(buf.o)
        status = [top.configured, top.done, top.error, top.frames_bad != 0]
        for led, value in zip(leds, status, strict=False):
            m.d.comb += led.eq(value)
        return m
