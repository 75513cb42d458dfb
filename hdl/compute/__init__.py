"""The compute unit (CU): a control sequencer and a SIMD stream datapath."""
