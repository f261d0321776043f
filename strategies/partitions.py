"""Which simulated partition each node holds, as far as the server can know it.

In simulation Flower gives every virtual node its `partition-id` through the node
config, which the ServerApp cannot read; the node reports it in its replies. The
server therefore binds a node to the first partition it reports and holds it to that
claim for the rest of the run: a node that later names another partition, or a second
node naming a partition already bound, is refused. What this buys: a node cannot
borrow another partition's size (the cap on its example count) or accountant history
after the fact. What it cannot buy: the first claim itself is unverified, so in
simulation the binding is only as honest as the simulated nodes (they are this app's
own code, given their partition by Flower).

On a deployment (`from_claims=False`) nobody vouches for a claim: a SuperNode started
with a demo `partition-id` (scripts/local_deployment.py, docker/compose.yaml) reports
whatever its operator typed, and a first-claim binding would let one registered member
claim another's partition first and get every later reply of that member refused. So
claims bind nothing there: each node is known by its node id (which SuperNode
authentication ties to a registered key), its example count is capped by
`federation.max_examples_per_node` alone, and its local-DP history is filed under its id.
"""

from __future__ import annotations

from strategies.replies import InvalidReply


class PartitionBinding:
    """node id <-> partition id, bound by the first claim and never changed."""

    def __init__(self, num_partitions: int, *, from_claims: bool = True) -> None:
        if num_partitions < 1:
            raise ValueError(f"num_partitions={num_partitions} must be >= 1")
        self.num_partitions = num_partitions
        self.from_claims = from_claims  # False on a deployment: claims are ignored (module docstring)
        self._by_node: dict[int, int] = {}
        self._by_partition: dict[int, int] = {}

    def bind(self, node_id: int, claimed: object) -> int | None:
        """The partition `node_id` holds, binding it on first sight.

        `claimed` is the reply's `partition-id` (None or absent for a deployed node).
        A node bound earlier that now reports nothing keeps its binding (returned).
        Raises InvalidReply on a claim that contradicts the binding or is malformed. On a
        deployment (`from_claims=False`) every claim is ignored: None.
        """
        if not self.from_claims:
            return None
        bound = self._by_node.get(node_id)
        if claimed is None:
            return bound
        if isinstance(claimed, bool) or not isinstance(claimed, int) or not 0 <= claimed < self.num_partitions:
            raise InvalidReply(f"partition-id={claimed!r} is not a partition in [0, {self.num_partitions})")
        if bound is not None and bound != claimed:
            raise InvalidReply(f"partition-id={claimed} but this node holds partition {bound}")
        holder = self._by_partition.get(claimed)
        if holder is not None and holder != node_id:
            raise InvalidReply(f"partition-id={claimed} is already held by node {holder}")
        self._by_node[node_id] = claimed
        self._by_partition[claimed] = node_id
        return claimed

    def partition_of(self, node_id: int) -> int | None:
        return self._by_node.get(node_id)

    def holder(self, partition: int) -> int | None:
        """The node bound to `partition` (None: not claimed yet, or a deployment)."""
        return self._by_partition.get(partition)

    def unbound(self) -> list[int]:
        """Partitions no node has claimed yet (none on a deployment: there, no history is filed by partition)."""
        if not self.from_claims:
            return []
        return [p for p in range(self.num_partitions) if p not in self._by_partition]
