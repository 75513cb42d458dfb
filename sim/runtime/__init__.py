"""The host runtime: the driver, its transports and the session that runs a job (the code a
board uses too)."""
