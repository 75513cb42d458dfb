"""rdakit.boards."""
