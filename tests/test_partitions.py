"""The server's node -> partition binding: first claim binds, contradictions are refused."""

from __future__ import annotations

import pytest

from strategies.partitions import PartitionBinding
from strategies.replies import InvalidReply


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
