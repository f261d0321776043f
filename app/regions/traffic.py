"""Bytes over the wide-area links in a round (the row's `wan_bytes`), from what the round sent
and received: the sites' own transfers under topology=flat, one model copy down and one update
up per region under topology=regions."""

from __future__ import annotations

from collections.abc import Callable, Iterable


def wan_bytes(
    region_of: Callable[[int], int | None],
    sent: Iterable[tuple[int, int]],
    received: Iterable[tuple[int, int]],
    regional_up: dict[int, int] | None,
) -> tuple[int, dict[int, int]]:
    """(the round's WAN bytes, region -> what its WAN link carried up).

    `sent` / `received`: (node, payload bytes) of each task and reply. `regional_up` None: flat,
    every task and reply crosses its site's region's WAN link. Otherwise regions: each region that
    was sent tasks gets the largest of them once (its aggregator forwards it) and sends
    `regional_up[region]` (a region missing there: its largest reply, an update's size)."""
    sent, received = list(sent), list(received)
    if regional_up is None:
        up: dict[int, int] = {}
        for node, size in received:
            if (region := region_of(node)) is not None:
                up[region] = up.get(region, 0) + size
        return sum(size for _, size in sent) + sum(size for _, size in received), up
    down: dict[int, int] = {}
    for node, size in sent:
        if (region := region_of(node)) is not None:
            down[region] = max(down.get(region, 0), size)
    largest: dict[int, int] = {}
    for node, size in received:
        if (region := region_of(node)) is not None:
            largest[region] = max(largest.get(region, 0), size)
    up = {r: regional_up.get(r, largest.get(r, 0)) for r in sorted(set(down) | set(largest))}
    return sum(down.values()) + sum(up.values()), up
