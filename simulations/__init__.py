"""Experiment runners, sweeps and benchmarks (they call ``flwr run`` or the library directly)."""
