"""How log lines name a node: by what its operator knows it as, always beside its id.

Flower's node ids are 19-digit numbers that mean nothing to a reader. So every log line that
names a node names it here: a simulated node by the partition the server bound it to
(strategies/partitions.py), a deployed one by the `name` in its SuperNode's node config
(`flower-supernode --node-config 'name="site-a" data-path=...'`), which its ClientApp reports in
each reply (`wire.NODE`): `partition 3 (node 1003)`, `site-a (node 8642426493075707657)`. A node
not heard from yet is shown by its id alone: `node 8642426493075707657`.

A name is the node's claim, like everything it sends. It is escaped and cut
(strategies/node_text.py, `MAX_NAME`) before it is kept; it never stands for the id (the full id
is always beside it, for grep); it decides nothing (screening, weights, partitions, privacy and
the ledger go by node id). It can still say anything within those bounds, another node's name
included: two nodes claiming one name are told apart by their ids, and the log warns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from flwr.app import RecordDict

from strategies.keys import NAME, NODE
from strategies.node_text import printable

log = logging.getLogger("flwr.fedgpu." + __name__)

MAX_NAME = 64  # characters of a name kept: a site's name, not a payload


class NodeNames:
    """node id -> the name log lines show beside it (one map per run, fed as replies arrive).

    `partition_of`: the run's partition binding (`PartitionBinding.partition_of`), which names a
    simulated node by its bound partition; a deployed node's binding is always None.
    """

    def __init__(self, partition_of: Callable[[int], int | None] | None = None) -> None:
        self.partition_of = partition_of
        self._claimed: dict[int, str] = {}  # node id -> its name, escaped and cut

    def hear(self, node: int, content: RecordDict) -> None:
        """Keep the name a reply's `content` claims for `node` (its `wire.NODE` record's `NAME`), if any."""
        record = content.config_records.get(NODE)
        name = record.get(NAME) if record is not None else None
        if not isinstance(name, str) or not (kept := printable(name.strip(), MAX_NAME)):
            return
        if self._claimed.get(node) == kept:
            return
        self._claimed[node] = kept
        twins = sorted(n for n, claimed in self._claimed.items() if claimed == kept and n != node)
        if twins:
            log.warning(
                "node %s names itself %s, as %s did: a name is a node's own claim; the ids tell them apart",
                node,
                kept,
                labels(twins, self),
            )
        else:
            log.info("node %s names itself %s (its node config's name)", node, kept)

    def shown(self, node: int) -> str | None:
        """What a log line shows beside `node`'s id: its bound partition, else its claimed name."""
        partition = self.partition_of(node) if self.partition_of is not None else None
        return f"partition {partition}" if partition is not None else self._claimed.get(node)


def label(node: int, names: NodeNames | None = None) -> str:
    """`node` as a log line names it: `site-a (node 8642426493075707657)`, or `node 864...` alone."""
    shown = names.shown(node) if names is not None else None
    return f"{shown} (node {node})" if shown else f"node {node}"


def labels(nodes: Iterable[int], names: NodeNames | None = None) -> str:
    """Several nodes as a log line names them: `[partition 0 (node 1000), node 1001]`."""
    return "[" + ", ".join(label(n, names) for n in nodes) + "]"
