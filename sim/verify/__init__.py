"""Verification: the cocotb runner, simulator helpers, stream drivers, stimulus, test gateware
and formal harnesses."""
