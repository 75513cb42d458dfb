"""Flows across layers: compile, run on a simulated fabric or system, check and report
(rdakit run)."""
