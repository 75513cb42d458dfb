"""The board's host bridge: a UART and the framed link to the fabric's host port."""
