"""Which region each site is in, and each region's wide-area link (`topology.*`, `fleet.wan_*`).

A region is a group of sites close to each other (one cloud region, one campus) behind one
wide-area link to the server. Sites are partitions in simulation: the assignment maps partition
i to its region, from a count (round-robin: i % regions), an explicit list, or a CSV
(partition,region). Region ids run 0..R-1 and every region has at least one site.
"""

from __future__ import annotations

import csv
from pathlib import Path

from app.config.schema import ConfigError, FleetConfig, TopologyConfig
from app.simulation.fleet import WanLink

CSV_COLUMNS = ("partition", "region")


def has_regions(topology: TopologyConfig) -> bool:
    """Whether the sites are placed in regions (under flat too: behind shared WAN links)."""
    return bool(topology.regions or topology.assignment or topology.csv)


def _read_csv(path: str) -> dict[int, int]:
    try:
        with Path(path).expanduser().open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as err:
        raise ConfigError(f"topology.csv={path}: cannot read it ({err})") from None
    out: dict[int, int] = {}
    for line, row in enumerate(rows, start=2):
        try:
            partition, region = (int(row[c]) for c in CSV_COLUMNS)
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"topology.csv={path} line {line}: expected integer columns {','.join(CSV_COLUMNS)}, got {dict(row)}"
            ) from None
        if partition in out:
            raise ConfigError(f"topology.csv={path} line {line}: partition {partition} is listed twice")
        out[partition] = region
    return out


def region_of_partitions(topology: TopologyConfig, num_partitions: int) -> list[int]:
    """The region of partition 0 .. num_partitions - 1; a ConfigError naming what is wrong when the
    assignment does not cover exactly these partitions or leaves a region id without a site."""
    if topology.regions:
        if topology.regions > num_partitions:
            raise ConfigError(
                f"topology.regions={topology.regions}: more regions than the {num_partitions} nodes; "
                "every region needs a site"
            )
        return [i % topology.regions for i in range(num_partitions)]
    if topology.assignment:
        where, given = "topology.assignment", dict(enumerate(topology.assignment))
    else:
        where, given = f"topology.csv={topology.csv}", _read_csv(topology.csv)
    if sorted(given) != list(range(num_partitions)):
        missing = sorted(set(range(num_partitions)) - set(given))[:10]
        extra = sorted(set(given) - set(range(num_partitions)))[:10]
        raise ConfigError(
            f"{where}: must give the region of every partition 0..{num_partitions - 1} (one per node) and no other; "
            f"missing {missing}, unknown {extra}"
        )
    regions = [int(given[i]) for i in range(num_partitions)]
    used = sorted(set(regions))
    if used != list(range(len(used))):
        raise ConfigError(f"{where}: region ids must be 0..R-1 with a site in each, got {used}")
    return regions


def wan_links(fleet: FleetConfig, num_regions: int) -> list[WanLink] | None:
    """Each region's WAN link from `fleet.wan_*` (cycled), or None when the fleet has none."""
    if not fleet.wan_uplink_mbps:
        return None

    def cycled(values: list[float], r: int) -> float:
        return float(values[r % len(values)])

    return [
        WanLink(
            downlink_bps=cycled(fleet.wan_downlink_mbps, r) * 1e6 / 8,
            uplink_bps=cycled(fleet.wan_uplink_mbps, r) * 1e6 / 8,
            latency_s=cycled(fleet.wan_latency_ms, r) / 1000,
        )
        for r in range(num_regions)
    ]
