"""rdakit.sim."""
