"""The memory unit (MU): free list, block table and the unit itself."""
