"""What a strategy is given at construction, in three small frozen values shared by FedAvg, the
robust strategy and FedBuff (as Flower's strategies take everything as `__init__` arguments).

Nothing is assigned to a strategy after it is built: the server's run composes these once
(`app.run.assemble`), in the order their parts depend on each other, and hands them over.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord

from strategies.node_names import NodeNames
from strategies.replies import Downlink, ReplyCheck, Unpack, WeightCap

# (node id, the connected node ids) -> keys merged into that node's copy of a training task's
# ConfigRecord (local DP's accountant history, the ledger's receipt). The connected ids are read
# once per round, not once per node.
NodeConfig = Callable[[int, Collection[int]], dict[str, Any]]


@dataclass(frozen=True)
class Sampling:
    """Who is asked to work, and how long to wait for them.

    fraction_train / min_train_nodes, fraction_evaluate / min_evaluate_nodes: Flower's sampling
    rule (a fraction of the connected nodes, at least the minimum; evaluation 0: none).
    min_available_nodes: the nodes a round waits for before sampling. round_wait_timeout_s: the
    longest it waits (then it goes on with fewer if the strategy can, else stops the run:
    strategies/node_wait.py). seed: the strategy's own sampler's seed, never the global
    `random`, which Flower's heartbeat and retry threads draw from at moments that depend on
    timing. FedBuff reads only the wait and the seed.
    """

    fraction_train: float = 1.0
    min_train_nodes: int = 2
    fraction_evaluate: float = 0.0
    min_evaluate_nodes: int = 2
    min_available_nodes: int = 2
    round_wait_timeout_s: float = 300.0
    seed: int = 0


@dataclass(frozen=True)
class ReplyLimits:
    """What the server takes from a reply, and for how long it waits for one.

    message_ttl_s: each task's lifetime (a node that has not answered by then is gone).
    weight_cap: (node id, metrics, message type) -> the most examples a reply may count for
    (None: `replies.MAX_WEIGHT` only); counts are claims (strategies/replies.py).
    unpack: a compressed uplink's decoder (None: replies carry the model as it is).
    check: the run's own check of each training reply (signed work records), None: none.
    """

    message_ttl_s: float = 3600.0
    weight_cap: WeightCap | None = None
    unpack: Unpack | None = None
    check: ReplyCheck | None = None


@dataclass(frozen=True)
class TaskWiring:
    """What every task carries besides the model, and how log lines name its node.

    frozen: the parameters kept frozen (model.trainable), sent with every task, never aggregated.
    downlink: how training tasks carry the model (None: as it is). node_config: per-node keys of a
    training task (local DP's history, the ledger's receipt), composed once by the run. names:
    how log lines name a node (its bound partition, or its site name) beside its id.
    """

    frozen: ArrayRecord | None = None
    downlink: Downlink | None = None
    node_config: NodeConfig | None = None
    names: NodeNames = field(default_factory=NodeNames)
