"""What the server's run keeps about privacy, one object per mode: its metrics.jsonl columns,
its summary, what it checkpoints and when spending has left the server.

The round loops ask this object instead of checking `privacy.name`; the mechanisms
themselves live in strategies/central_dp.py (central) and app/privacy/ (local DP-SGD).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Collection
from typing import Any

from flwr.app import MessageType, MetricRecord

from app.config.schema import PrivacyConfig
from app.privacy.accounting import Allowance, HistoryBook, MalformedHistory, Prescription, history_key
from app.protocol import PARTITION_ID
from app.secagg.dp import DistributedDP
from strategies.central_dp import CentralDP
from strategies.node_names import NodeNames, label
from strategies.partitions import PartitionBinding
from strategies.replies import InvalidReply, WeightCap
from strategies.settings import NodeConfig

log = logging.getLogger("flwr.fedgpu." + __name__)


class NoPrivacy:
    """privacy=none: nothing to account, report or checkpoint."""

    drain = False  # FedBuff: leave tasks in flight at the stop (their replies spend nothing)
    exact_per_node = True  # the live metrics may show each node's exact metrics (no DP on them)

    def screening(self, cap: WeightCap | None) -> WeightCap | None:
        """The strategy's weight cap, with this mode's checks of a training reply around it."""
        return cap

    def node_config(self) -> NodeConfig | None:
        """Per-node keys of a training task (the strategy's `TaskWiring.node_config`); None: none."""
        return None

    def record_spending(self, client_metrics: list[tuple[int, MetricRecord]]) -> None:
        """Note what the replies spent (nothing here)."""

    def spent_before_release(self, federated_eval: bool) -> bool:
        """Has this round's spending left the server before its checkpoint (so that a crash must
        find it on record)?"""
        return False

    def row(self) -> dict[str, Any]:
        return {}

    def describe(self, row: dict[str, Any]) -> str | None:
        """The log line for a row's privacy columns."""
        return None

    def summary(self) -> dict[str, Any]:
        return {"mechanism": "none"}

    def state(self) -> dict[str, Any]:
        """The run state to checkpoint (central DP's accountant is in the strategy's own state)."""
        return {}


class CentralPrivacy(NoPrivacy):
    """Central DP: the strategy's mechanism releases noised aggregates and keeps the accountant."""

    def __init__(self, dp: CentralDP, report_exact: bool) -> None:
        self.dp, self.report_exact = dp, report_exact
        self.exact_per_node = report_exact

    def spent_before_release(self, federated_eval: bool) -> bool:
        # Federated evaluation sends the release out before the round's checkpoint; a release
        # nobody has seen yet needs no record: re-running its round releases it afresh.
        return federated_eval

    def row(self) -> dict[str, Any]:
        dp = self.dp
        row: dict[str, Any] = {"epsilon": dp.epsilon(), "clip_norm": dp.clip_norm, "releases": dp.releases}
        if dp.adaptive is not None:  # b̃ was released (noised, accounted): covered by epsilon
            row["noised_unclipped_fraction"] = dp.last_noised_unclipped_fraction
        if self.report_exact:
            row["clipped_fraction"] = dp.last_clipped_fraction
        return row

    def describe(self, row: dict[str, Any]) -> str | None:
        return f"epsilon {row['epsilon']:.3f} (delta {self.dp.delta:g}), clip {row['clip_norm']:.4g}"

    def summary(self) -> dict[str, Any]:
        return self.dp.summary()


class LocalPrivacy(NoPrivacy):
    """Local DP-SGD: every client's accountant history under the server's name for it
    (app/privacy/); each training message carries only the history that can be its node's own.

    With a `prescription` (app/run/factory.py:_local_privacy) a history must also match what the
    server prescribed for the tasks it sent the node (`Prescription`): this object counts each
    node's training tasks (`prior` is asked once per training message) and what it accepted from
    it, and `screening` makes the strategy reject a training reply whose history it would refuse,
    so that reply's update is not aggregated either.
    """

    drain = True  # FedBuff waits for the tasks in flight: their steps are spent either way

    def __init__(
        self,
        cfg: PrivacyConfig,
        partitions: PartitionBinding,
        state: dict[str, Any] | None,
        prescription: Prescription | None = None,
        names: NodeNames | None = None,
    ) -> None:
        self.cfg, self.partitions, self.prescription = cfg, partitions, prescription
        self.names = names  # how log lines name nodes (the strategy's)
        self.exact_per_node = cfg.report_exact
        self.ledger = HistoryBook(cfg.delta, state, prescription)
        self.rejections: list[dict[str, Any]] = []  # refused histories since the last row
        self.examples: WeightCap | None = None  # the strategy's cap on a reply's examples (`screening`)
        self.tasks: Counter[int] = Counter()  # node id -> training tasks sent in this run
        self.steps: Counter[int] = Counter()  # node id -> DP-SGD steps accepted from it in this run
        # node id -> (σ, q) pairs it extended, in accepted histories and in refused ones whose RDP was
        # computed: at most one per task sent, so a node can make the server compute one RDP per task
        self.pairs: Counter[int] = Counter()

    def node_config(self) -> NodeConfig:
        return self.prior

    def prior(self, node_id: int, connected: Collection[int]) -> dict[str, str]:
        """What a training message to `node_id` adds to its config (the strategy's node_config;
        `connected`: the node ids connected now, read once for the whole cohort)."""
        self.tasks[node_id] += 1
        partition = self.partitions.partition_of(node_id)
        return self.ledger.prior(node_id, partition, self.partitions.unbound(), connected)

    def allowance(self, node: int, metrics: MetricRecord, examples: float | None = None) -> Allowance | None:
        """What `node` may have added to its history in this run (None without a prescription).
        `examples`: the strategy's cap for this reply (its partition's training size, or
        federation.max_examples_per_node), asked here when not given."""
        p = self.prescription
        if p is None:
            return None
        if examples is None:
            try:
                examples = p.max_examples if self.examples is None else self.examples(node, metrics, MessageType.TRAIN)
            except InvalidReply:  # a contested partition claim: the node is held to the deployment cap
                examples = p.max_examples
        return Allowance(max(1, int(examples)), self.tasks[node], self.steps[node], self.pairs[node])

    def screening(self, cap: WeightCap | None) -> WeightCap:
        """The strategy's weight cap, which also refuses a training reply whose accountant history
        would be refused (InvalidReply naming the reason; the strategy logs it with the node id)."""
        self.examples = cap

        def cap_and_check(node: int, metrics: MetricRecord, kind: str) -> float:
            limit = cap(node, metrics, kind) if cap is not None else math.inf  # binds a partition claim first
            if kind == MessageType.TRAIN:
                key = history_key(self.partitions.partition_of(node), node)
                try:
                    self.ledger.check(key, metrics, self.allowance(node, metrics, limit if cap is not None else None))
                except MalformedHistory as err:
                    raise InvalidReply(f"local-DP accountant history refused: {err}") from None
            return limit

        return cap_and_check

    def record_spending(self, client_metrics: list[tuple[int, MetricRecord]]) -> None:
        """Keep every reply's accountant history, whatever becomes of its update (the steps were
        taken either way), under the node's bound partition or its node id, never the reply's
        claim alone. A malformed, shrinking, unprescribed or unaccountable history is logged and
        listed in the next row (`dp_history_rejected`); the one on record stays."""
        for node, metrics in client_metrics:
            try:
                partition = self.partitions.bind(node, metrics.get(PARTITION_ID))
            except InvalidReply:  # a contested claim: the screening rejects the reply; the history is the node's
                partition = self.partitions.partition_of(node)
            key = history_key(partition, node)
            try:
                grown = self.ledger.record(key, node, metrics, self.allowance(node, metrics))
            except MalformedHistory as err:
                log.warning("%s: local-DP accountant history for %s refused: %s", label(node, self.names), key, err)
                self.rejections.append({"node_id": node, "key": key, "reason": str(err)})
                self.pairs[node] += err.computed  # refused after its RDP was computed: still charged
                continue
            self.steps[node] += sum(n for _, _, n in grown)
            self.pairs[node] += len(grown)

    def spent_before_release(self, federated_eval: bool) -> bool:
        return True  # the clients took their steps before replying

    def row(self) -> dict[str, Any]:
        # Over every client on record (this run's and, after a resume, earlier ones), by the server's accountant.
        eps = list(self.ledger.epsilons().values())
        row: dict[str, Any] = (
            {"client_epsilon_max": max(eps), "client_epsilon_mean": sum(eps) / len(eps)} if eps else {}
        )
        if self.rejections:
            row["dp_history_rejected"], self.rejections = self.rejections, []
        return row

    def describe(self, row: dict[str, Any]) -> str | None:
        if "client_epsilon_max" not in row:
            return None
        return f"client epsilon max {row['client_epsilon_max']:.3f}, mean {row['client_epsilon_mean']:.3f}"

    def summary(self) -> dict[str, Any]:
        per_client = self.ledger.epsilons()  # bound partition or node id -> epsilon
        eps = list(per_client.values())
        p = self.cfg
        return {
            "mechanism": "local DP-SGD (Opacus), sample-level per client",
            "client_epsilon_max": max(eps) if eps else None,
            "client_epsilon_mean": sum(eps) / len(eps) if eps else None,
            "client_epsilon": per_client,
            "delta": p.delta,
            "noise_multiplier": p.noise_multiplier,
            "target_epsilon": p.target_epsilon or None,
            "clip_norm": p.clip_norm,
        }

    def state(self) -> dict[str, Any]:
        return {"local_dp": self.ledger.state()}


class DistributedPrivacy(NoPrivacy):
    """Distributed DP under secure aggregation: the nodes noise, the strategy's `DistributedDP`
    accounts what the survivors' sum carried (app/secagg/dp.py); the server never holds an exact
    per-node value, so nothing is left out of the rows."""

    def __init__(self, dp: DistributedDP) -> None:
        self.dp = dp

    def spent_before_release(self, federated_eval: bool) -> bool:
        return federated_eval  # as central DP: the release leaves the server with the evaluation tasks

    def row(self) -> dict[str, Any]:
        row: dict[str, Any] = {"epsilon": self.dp.epsilon(), "clip_norm": self.dp.clip_norm}
        if self.dp.adaptive:
            row["noised_unclipped_fraction"] = self.dp.last_noised_unclipped_fraction
        return row

    def describe(self, row: dict[str, Any]) -> str | None:
        return (
            f"epsilon {row['epsilon']:.3f} (delta {self.dp.delta:g}, distributed Skellam), clip {row['clip_norm']:.4g}"
        )

    def summary(self) -> dict[str, Any]:
        return self.dp.summary()


RunPrivacy = NoPrivacy | CentralPrivacy | LocalPrivacy | DistributedPrivacy
