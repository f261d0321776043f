"""Straggler simulation: slow and flaky nodes on one machine.

The server draws one slowdown factor per simulated node (`stragglers=fixed` with a
list, or `stragglers=lognormal`: exp(σ·(zᵢ − min z)), zᵢ ~ N(0, 1) seeded by the run's
seed), records them in
summary.json and sends them to every ClientApp. A node with factor s really takes s
times its measured compute time: after training it sleeps (s − 1) × that time, so
the slowdown follows whatever its hardware did this round. With `stragglers.dropout`
= p, each training task fails with probability p after part of that time (the server
receives an error reply, as from a crashed node).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

from app.config.registry import Registry
from app.config.schema import STRAGGLERS, StragglersConfig

log = logging.getLogger("flwr.fedgpu." + __name__)

FACTORS_KEY = "stragglers.factors"
DROPOUT_KEY = "stragglers.dropout"


class SimulatedDropout(RuntimeError):
    """The ClientApp plays a node that crashed mid-task."""


def _fixed(cfg: StragglersConfig, num_partitions: int, _seed: int) -> list[float]:
    return [float(cfg.factors[i]) if i < len(cfg.factors) else 1.0 for i in range(num_partitions)]


def _lognormal(cfg: StragglersConfig, num_partitions: int, seed: int) -> list[float]:
    # Durations relative to each other are lognormal; the fastest node runs at full
    # speed (a slowdown below 1 would need faster hardware than this machine).
    z = np.random.default_rng(np.random.SeedSequence([seed, 0x57A6])).standard_normal(num_partitions)
    return [math.exp(cfg.sigma * float(v - z.min())) for v in z]


_FACTORS: Registry[Callable[[StragglersConfig, int, int], list[float]]] = Registry(
    "stragglers.name",
    STRAGGLERS,
    {"none": lambda _cfg, n, _seed: [1.0] * n, "fixed": _fixed, "lognormal": _lognormal},
)


def straggler_factors(cfg: StragglersConfig, num_partitions: int, seed: int) -> list[float]:
    """Slowdown of partition 0 .. num_partitions − 1 (1.0 = full speed)."""
    return _FACTORS[cfg.name](cfg, num_partitions, seed)


def client_record(cfg: StragglersConfig, num_partitions: int, seed: int) -> dict[str, list[float] | float]:
    """What the ClientApps need (ConfigRecord keys); empty when nobody is slowed down."""
    if cfg.name == "none" and cfg.dropout == 0:
        return {}
    return {FACTORS_KEY: straggler_factors(cfg, num_partitions, seed), DROPOUT_KEY: float(cfg.dropout)}


def slow_down(record: dict, partition: int | None, compute_s: float, seed: int) -> float:
    """Sleep as this node's straggler settings say; returns the extra seconds.

    Raises SimulatedDropout when this task is drawn to fail. Deployed nodes (no
    partition id) are never slowed down: their slowness is real.
    """
    factors = record.get(FACTORS_KEY) or []
    if partition is None or not factors:
        return 0.0
    factor = float(factors[partition]) if partition < len(factors) else 1.0
    extra = (factor - 1.0) * compute_s
    rng = np.random.default_rng(seed)
    if rng.random() < float(record.get(DROPOUT_KEY, 0.0)):
        time.sleep(rng.random() * extra)
        raise SimulatedDropout(f"simulated dropout of partition {partition} (stragglers.dropout)")
    time.sleep(extra)
    return extra
