"""Benchmarks, one module per rdakit bench X, and the tables and JSON they print."""
