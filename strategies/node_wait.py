"""Bounded waits for nodes (`federation.round_wait_timeout_s`).

Flower's `sample_nodes` waits for `min_available_nodes` without a limit: a federation that lost
a node waits forever. Here a round waits at most `timeout_s` for the nodes it wants, then goes on
with those connected if the strategy can still work with them (its minimum cohort, a robust
rule's n >= 2f + 3), and otherwise raises TooFewNodes, which stops the run cleanly after its last
checkpoint with a message naming the settings to change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from flwr.serverapp import Grid

from strategies.node_names import NodeNames, labels

log = logging.getLogger("flwr.fedgpu." + __name__)

LOG_EVERY_S = 10.0


class TooFewNodes(RuntimeError):
    """Fewer nodes connected than the strategy needs, after the bounded wait."""


def wait_for_nodes(
    grid: Grid,
    wanted: int,
    needed: int,
    timeout_s: float,
    known: Collection[int] = (),
    poll_s: float = 0.5,
    names: NodeNames | None = None,
) -> list[int]:
    """The connected nodes once `wanted` are connected; after `timeout_s`, those connected if
    they are at least `needed`; else TooFewNodes. `known`: nodes seen before, to name the
    missing ones in the log (by `names`)."""
    start = next_log = time.monotonic()
    while True:
        nodes = list(grid.get_node_ids())
        waited = time.monotonic() - start
        gone = sorted(set(known) - set(nodes))
        missing = f", missing {labels(gone, names)}" if gone else ""
        if len(nodes) >= wanted:
            if waited >= LOG_EVERY_S:
                log.info("waited %.0f s for nodes: %d connected", waited, len(nodes))
            return nodes
        if waited >= timeout_s:
            if len(nodes) >= needed:
                log.warning(
                    "waited %.0f s (federation.round_wait_timeout_s) for %d nodes%s; going on with the %d connected",
                    waited,
                    wanted,
                    missing,
                    len(nodes),
                )
                return nodes
            raise TooFewNodes(
                f"only {len(nodes)} node(s) connected after waiting {waited:.0f} s "
                f"(federation.round_wait_timeout_s={timeout_s:g}){missing}; "
                f"this round needs at least {needed} (federation.min_train_nodes, federation.min_available_nodes, "
                "and a robust rule's minimum). The last round is checkpointed: restart the missing SuperNodes "
                "and run the same command with name=... resume=auto, or lower those settings"
            )
        if time.monotonic() >= next_log:
            log.info(
                "waiting up to %.0f s more (federation.round_wait_timeout_s) for nodes: %d connected, %d wanted%s",
                timeout_s - waited,
                len(nodes),
                wanted,
                missing,
            )
            next_log = time.monotonic() + LOG_EVERY_S
        time.sleep(poll_s)
