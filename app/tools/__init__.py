"""Experiment tooling on top of runs: sweeps, reports, run comparison, Flower process helpers."""
