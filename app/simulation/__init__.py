"""Simulation helpers: attacks, stragglers and the in-process grid used by tests and benchmarks."""
