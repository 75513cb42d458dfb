"""rdakit.hdl."""
