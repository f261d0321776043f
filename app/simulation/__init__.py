"""Simulation helpers: attacks, fleet profiles on a virtual clock, and the in-process grid used by tests
and benchmarks."""
