"""rdakit.compiler."""
