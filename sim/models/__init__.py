"""Golden models: the memory unit's transaction-level model, the fabric interpreter and the
NoC reference."""
