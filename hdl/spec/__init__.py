"""The definitions every layer shares: parameter sets, packet and flit layouts, the ISA, the
configuration map and STATUS word, the bitstream format, the board link's frames and vector
words. Imports nothing else of rdakit's."""
