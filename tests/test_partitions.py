"""The server's node -> partition binding: first claim binds, contradictions are refused."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MessageType, MetricRecord

from app.config.schema import Config
from app.protocol import PARTITION_ID
from app.run.factory import example_cap
from app.simulation.local_grid import InProcessGrid
from app.simulation.messages import make_reply
from strategies.fedavg import FedAvg
from strategies.partitions import PartitionBinding
from strategies.replies import InvalidReply, specs_of
from strategies.settings import ReplyLimits


def test_first_claim_binds_and_later_claims_must_match():
    binding = PartitionBinding(3)
    assert binding.bind(10, 1) == 1 and binding.partition_of(10) == 1
    assert binding.bind(10, 1) == 1
    assert binding.bind(10, None) == 1  # a later reply without the key keeps the binding
    with pytest.raises(InvalidReply, match="holds partition 1"):
        binding.bind(10, 2)
    assert binding.partition_of(10) == 1 and binding.unbound() == [0, 2]


def test_a_second_node_cannot_claim_a_bound_partition():
    binding = PartitionBinding(3)
    binding.bind(10, 1)
    with pytest.raises(InvalidReply, match="already held by node 10"):
        binding.bind(11, 1)
    assert binding.partition_of(11) is None


@pytest.mark.parametrize("claim", [-1, 3, 1.0, True, "1"])
def test_malformed_claims_are_refused(claim):
    with pytest.raises(InvalidReply, match="not a partition"):
        PartitionBinding(3).bind(10, claim)


def test_deployed_nodes_have_no_partition():
    binding = PartitionBinding(2)
    assert binding.bind(7, None) is None and binding.partition_of(7) is None


def _claims_of_partition_zero(binding: PartitionBinding) -> tuple[list[int], dict[int, str]]:
    """Nodes 1 and 2 both report partition 0 (node 1 first: it claims node 2's partition), through
    FedAvg's screening with the run's example cap; (accepted nodes, rejection reasons)."""
    model = {"w": np.zeros((3, 2), np.float32)}
    strategy = FedAvg(limits=ReplyLimits(weight_cap=example_cap(Config(), np.repeat(np.arange(10), 30), binding)))
    strategy._specs = specs_of(ArrayRecord({k: Array(v) for k, v in model.items()}))
    replies = [make_reply(n, model, {"num-examples": 50, PARTITION_ID: 0}) for n in (1, 2)]
    strategy.aggregate_train(1, replies)
    return strategy.train_report.accepted, {r.node_id: r.reason for r in strategy.train_report.rejected}


def test_on_a_deployment_no_node_can_get_another_nodes_replies_rejected_by_claiming_its_partition():
    """Issue 32, finding 3: in the shipped compose file authenticated SuperNodes carry a demo
    partition-id; a first-claim binding there let one member lock another out for the run."""
    accepted, rejected = _claims_of_partition_zero(PartitionBinding(2, from_claims=False))
    assert accepted == [1, 2] and not rejected
    # In simulation the claim is Flower's own node config, and the first claim binds.
    accepted, rejected = _claims_of_partition_zero(PartitionBinding(2))
    assert accepted == [1] and "already held by node 1" in rejected[2]


def test_a_deployed_binding_ignores_every_claim_and_caps_by_the_configured_limit():
    binding = PartitionBinding(3, from_claims=False)
    assert binding.bind(10, 1) is None and binding.bind(11, 1) is None and binding.bind(12, "junk") is None
    assert binding.partition_of(10) is None and binding.unbound() == []
    cap = example_cap(Config(), np.repeat(np.arange(10), 30), binding)
    assert cap(10, MetricRecord({PARTITION_ID: 1}), MessageType.TRAIN) == Config().federation.max_examples_per_node


def test_only_simulated_grids_bind_partitions_from_claims():
    """Flower's simulation hands the ServerApp an InMemoryGrid, a deployed one an HttpGrid."""
    from flwr.superlink.grid.http_grid import HttpGrid
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    from app.run.assemble import runs_simulated_nodes

    assert runs_simulated_nodes(InProcessGrid(lambda m, c: m, num_nodes=1))
    assert runs_simulated_nodes(InMemoryGrid.__new__(InMemoryGrid))
    assert not runs_simulated_nodes(HttpGrid(insecure=True, token="t"))
