"""A real serial port as a byte port of :class:`~rdakit.sim.runtime.host_link.FramedTransport`.

``board_host(params, port, baud)`` opens the port with pyserial and returns a
:class:`~rdakit.sim.runtime.host.HostDriver` on it: the same driver, kernels and checks as on the
simulators, over the board's UART.
"""

import serial

from rdakit.sim.runtime.host import HostDriver
from rdakit.sim.runtime.host_link import FramedTransport

__all__ = ["SerialPort", "board_host"]


class SerialPort:
    """Bytes through pyserial. ``timeout`` (seconds) is how long :meth:`read_byte` waits for
    the next byte before it reports a quiet line."""

    timeout_unit = "s"

    def __init__(self, url, *, baud, timeout=0.5):
        self.serial = serial.serial_for_url(url, baudrate=baud, timeout=timeout)
        self.timeout = timeout

    async def write(self, data):
        self.serial.write(bytes(data))
        self.serial.flush()

    async def read_byte(self):
        b = self.serial.read(1)
        return b[0] if b else None

    async def tick(self, n=1):
        # A frame round trip over a UART takes far longer than the cycles a driver waits
        # between polls, so there is nothing to wait for here.
        return None

    def close(self):
        self.serial.close()


def board_host(params, url, *, baud, timeout=0.5, retries=4):
    """A HostDriver over the serial port ``url`` (a device path or a pyserial URL)."""
    port = SerialPort(url, baud=baud, timeout=timeout)
    return HostDriver(params, FramedTransport(params, port, retries=retries)), port
