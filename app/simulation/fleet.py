"""Fleet profiles: each simulated node's compute speed, links and availability (`fleet=...`).

A profile belongs to a partition (what a simulated node is: `partition-id` in its node config),
not to a node id, which Flower draws at random for every simulation: the same seed and
profiles then give the same fleet whatever the ids. `stragglers=fixed|lognormal` (with
`stragglers.dropout`) is the short form of a profile: the same slowdowns, on the virtual clock
(app/simulation/virtual_clock.py) instead of real sleeps.

Device classes: training throughput relative to an RTX 4090 (mixed precision, convolutional
networks), rounded from public benchmark tables (docs/fleet.md cites them). They are
assumptions to override with `fleet.device_speeds`, not measurements of this project.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from app.config.registry import Registry
from app.config.schema import FLEET_SPEEDS, ConfigError, FleetConfig, StragglersConfig

DEVICE_SPEEDS: dict[str, float] = {
    "h100": 2.0,
    "a100": 1.1,
    "rtx4090": 1.0,
    "v100": 0.55,
    "l4": 0.35,
    "t4": 0.2,
    "cpu": 0.02,
}
TRACE_COLUMNS = ("partition", "offline_from_s", "offline_until_s")


@dataclass(frozen=True)
class NodeProfile:
    """One simulated node: how fast it trains and talks, and when it is away."""

    samples_per_s: float  # training examples per second
    downlink_bps: float  # bytes per second
    uplink_bps: float
    latency_s: float  # one way
    completion_p: float = 1.0  # probability a task completes (else it fails part way)
    offline: tuple[tuple[float, float], ...] = field(default=())  # [from, until) intervals, sorted

    def online_at(self, t: float) -> bool:
        return not any(a <= t < b for a, b in self.offline)

    def back_online(self, t: float) -> float:
        """The first moment >= t at which the node is online."""
        for a, b in self.offline:
            if a <= t < b:
                t = b
        return t

    def leaves_during(self, start: float, end: float) -> float | None:
        """When the node goes offline in (start, end), if it does."""
        starts = [a for a, _ in self.offline if start < a < end]
        return min(starts) if starts else None


@dataclass(frozen=True)
class WanLink:
    """A region's wide-area link to the server (`fleet.wan_*`): bytes/s each way, one-way latency."""

    downlink_bps: float
    uplink_bps: float
    latency_s: float


def shared_wan(regional: NodeProfile, wan: WanLink, sites: int) -> NodeProfile:
    """A site's path to the server under topology=flat when it sits in a region of `sites` sites
    behind one WAN link: its own link, then its fair share of the region's (rates: the smaller,
    as a pipelined transfer; latencies add). A fair share assumes the region's sites transfer at
    the same time, as a synchronous round's do; it overstates a FedBuff node's wait."""
    return replace(
        regional,
        downlink_bps=min(regional.downlink_bps, wan.downlink_bps / sites),
        uplink_bps=min(regional.uplink_bps, wan.uplink_bps / sites),
        latency_s=regional.latency_s + wan.latency_s,
    )


def _slowdowns_lognormal(sigma: float, n: int, seed: int) -> list[float]:
    # Relative durations are lognormal; the fastest node runs at the reference speed.
    z = np.random.default_rng(np.random.SeedSequence([seed, 0x57A6])).standard_normal(n)
    return [math.exp(sigma * float(v - z.min())) for v in z]


def _speeds_fixed(cfg: FleetConfig, n: int, _seed: int) -> list[float]:
    return [1.0 / float(cfg.factors[i]) if i < len(cfg.factors) else 1.0 for i in range(n)]


def _speeds_devices(cfg: FleetConfig, n: int, _seed: int) -> list[float]:
    table = {**DEVICE_SPEEDS, **cfg.device_speeds}
    if unknown := sorted(set(cfg.devices) - set(table)):
        raise ConfigError(
            f"fleet.devices: unknown device class(es) {unknown}; known: {sorted(table)} "
            "(add one with fleet.device_speeds.NAME=SPEED, relative to an RTX 4090)"
        )
    return [float(table[cfg.devices[i % len(cfg.devices)]]) for i in range(n)]


_SPEEDS: Registry[Callable[[FleetConfig, int, int], list[float]]] = Registry(
    "fleet.speed",
    FLEET_SPEEDS,
    {
        "uniform": lambda _cfg, n, _seed: [1.0] * n,
        "fixed": _speeds_fixed,
        "lognormal": lambda cfg, n, seed: [1.0 / s for s in _slowdowns_lognormal(cfg.sigma, n, seed)],
        "devices": _speeds_devices,
    },
)


def short_form(stragglers: StragglersConfig) -> FleetConfig:
    """The fleet profile that `stragglers=...` stands for: its slowdowns over the reference
    device, fast links, and `stragglers.dropout` as the chance that a task fails part way."""
    speed = {"none": "uniform", "fixed": "fixed", "lognormal": "lognormal"}[stragglers.name]
    return FleetConfig(
        name=f"stragglers-{stragglers.name}",
        speed=speed,
        factors=list(stragglers.factors),
        sigma=stragglers.sigma,
        availability="bernoulli" if stragglers.dropout > 0 else "always",
        completion_p=1.0 - stragglers.dropout,
    )


def fleet_of(fleet: FleetConfig, stragglers: StragglersConfig) -> FleetConfig | None:
    """The run's fleet profile: `fleet`, else the stragglers' short form; None runs in real time."""
    if fleet.name != "none":
        return fleet
    if stragglers.name != "none" or stragglers.dropout > 0:
        return short_form(stragglers)
    return None


def read_trace(path: str | Path) -> dict[int, list[tuple[float, float]]]:
    """partition -> its offline intervals, from a CSV with the columns TRACE_COLUMNS."""
    try:
        with Path(path).expanduser().open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as err:
        raise ConfigError(f"fleet.trace={path}: cannot read it ({err})") from None
    out: dict[int, list[tuple[float, float]]] = {}
    for line, row in enumerate(rows, start=2):
        try:
            partition, start, end = (row[c] for c in TRACE_COLUMNS)
            p, a, b = int(partition), float(start), float(end)
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"fleet.trace={path} line {line}: expected the columns {','.join(TRACE_COLUMNS)} with an integer "
                f"partition and times in seconds, got {dict(row)}"
            ) from None
        if not 0 <= a < b:
            raise ConfigError(f"fleet.trace={path} line {line}: need 0 <= offline_from_s < offline_until_s")
        out.setdefault(p, []).append((a, b))
    return out


def _cycled(values: list[float], i: int) -> float:
    return float(values[i % len(values)])


def fleet_profiles(cfg: FleetConfig, num_partitions: int, seed: int) -> list[NodeProfile]:
    """The profile of partition 0 .. num_partitions - 1."""
    speeds = _SPEEDS[cfg.speed](cfg, num_partitions, seed)
    trace = read_trace(cfg.trace) if cfg.availability == "trace" else {}
    # Links from a distribution: a lognormal factor per partition on the listed rates (and its
    # inverse on the latency), drawn from the seed apart from the speeds.
    z = np.random.default_rng(np.random.SeedSequence([seed, 0x11CC])).standard_normal(num_partitions)
    link = [math.exp(cfg.link_sigma * float(v)) for v in z]
    return [
        NodeProfile(
            samples_per_s=cfg.reference_samples_per_s * speeds[i],
            downlink_bps=_cycled(cfg.downlink_mbps, i) * 1e6 / 8 * link[i],
            uplink_bps=_cycled(cfg.uplink_mbps, i) * 1e6 / 8 * link[i],
            latency_s=_cycled(cfg.latency_ms, i) / 1000 / link[i],
            completion_p=cfg.completion_p if cfg.availability == "bernoulli" else 1.0,
            offline=tuple(sorted(trace.get(i, []))),
        )
        for i in range(num_partitions)
    ]


def describe(profiles: list[NodeProfile]) -> str:
    """One line for the log: the speed spread and the slowest links."""
    sps = [p.samples_per_s for p in profiles]
    up = min(p.uplink_bps for p in profiles) * 8 / 1e6
    return (
        f"{len(profiles)} nodes, {min(sps):.0f}-{max(sps):.0f} examples/s (slowest {max(sps) / min(sps):.1f}x slower), "
        f"slowest uplink {up:g} Mbit/s, {sum(bool(p.offline) for p in profiles)} with outages"
    )
