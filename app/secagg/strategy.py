"""FedAvg over secure aggregation (secagg=plus): the server learns the cohort's sums, never a reply.

Each round is a SecAgg+ round (server.py) with the nodes FedAvg samples: the training task goes
out in its third stage, and the strategy gets back only the survivors' summed ring vector. It
holds the weighted update sum and the weight sum (FedAvg: global + sum(w x update) / sum(w),
the weights capped on the nodes), or under distributed DP the noised sum of clipped updates,
divided by the number of tasks sent (dp.py). Robust rules, contribution scores and per-node
ledger entries need individual updates, so validation refuses them with secure aggregation.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, Message, MetricRecord

from app.protocol import (
    SECAGG_CLIP_NORM,
    SECAGG_CLIPPING,
    SECAGG_COUNT_NOISE,
    SECAGG_EXTRAS,
    SECAGG_MAX_WEIGHT,
    SECAGG_MODULUS,
    SECAGG_NOISE,
    SECAGG_QUANTIZATION,
    TRAIN_ACCURACY,
    TRAIN_LOSS,
)
from app.secagg.dp import DistributedDP
from app.secagg.ring import ACCURACY, CLIPPED, LOSS, PLAIN_EXTRAS, UNCLIPPED, WEIGHT, Layout, Ring
from app.secagg.server import Outcome, SecureRound, default_degree, default_threshold
from strategies.fedavg import FedAvg, RoundReport
from strategies.node_names import label
from strategies.replies import Rejection
from strategies.tensor_ops import tensors_to_record

log = logging.getLogger("flwr.fedgpu." + __name__)


@dataclass(frozen=True)
class SecAggSettings:
    """secagg.* as the strategy uses them."""

    ring: Ring
    threshold: int = 0  # 0: default_threshold of the neighbourhood
    degree: int = 0  # 0: default_degree of the cohort
    max_weight: float = 100_000.0  # the cap every node's weight is divided by
    on_too_few: str = "skip"  # skip (keep the model, go on) | stop (end the run)
    compact: bool = False  # compression=int8: a 2-byte ring, its steps as fine as the cohort allows

    def ring_for(self, cohort: int) -> Ring:
        """The round's ring: the configured one, or with `compact` Z_2^16 with the most steps
        (a power of two) whose sum over `cohort` inputs cannot wrap: 4096 for 10 nodes, 1024
        for 50. The int8 codec is not run: quantizing once, into this ring, is the compression."""
        if not self.compact:
            return self.ring
        steps = 2 ** int(math.log2((COMPACT_MODULUS - 1) // max(cohort, 1)))
        return Ring(self.ring.clipping_range, steps, COMPACT_MODULUS)


COMPACT_MODULUS = 2**16  # compression=int8: each masked coordinate takes 2 bytes on the wire


class SecureAbort(RuntimeError):
    """A round aborted with secagg.on_too_few=stop."""


class SecureFedAvg(FedAvg):
    """FedAvg whose rounds are SecAgg+ rounds (app/run/federation.py calls `secure_train`)."""

    secure = True
    streams = False  # no `aggregate_stream`: the masked inputs are summed as they arrive by `secure_train`

    def __init__(self, *, secagg: SecAggSettings, dp: DistributedDP | None = None, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self.secagg, self.dp = secagg, dp
        self.last_outcome: Outcome | None = None
        self.sum_digest: str | None = None  # sha256 of the last unmasked sum (the ledger's record)

    def held_replies(self, num_nodes: int, streamed: bool) -> int:
        """None: each masked input is folded into the sum as it arrives and its arrays dropped."""
        return 0

    def node_count_problem(self, num_nodes: int) -> str | None:
        n = self.cohort_size(num_nodes)
        k, t = self.graph(n)
        if n < 2:
            return f"secure aggregation needs at least 2 nodes in a round, the cohort is {n}"
        if not 2 <= t <= k + 1:
            return f"secagg.threshold={t} must be within 2..{k + 1} (secagg.degree + 1) for a cohort of {n}"
        if n > COMPACT_MODULUS // 4 and self.secagg.compact:
            return f"compression=int8 under secure aggregation holds at most {COMPACT_MODULUS // 4} nodes a round"
        if (why := self.secagg.ring_for(n).room(n)) is not None:
            return why
        if self.dp is not None and (why := self.dp.room_problem(n)) is not None:
            return why
        return None

    def graph(self, cohort: int) -> tuple[int, int]:
        """(k, t) for a round of `cohort` nodes."""
        k = min(self.secagg.degree or default_degree(cohort), cohort - 1)
        return k, self.secagg.threshold or default_threshold(k + 1)

    def summary(self) -> None:
        super().summary()
        s = self.secagg
        log.info(
            "secure aggregation (SecAgg+): threshold %s, degree %s, ring %s, %s quantization steps over +-%g%s",
            s.threshold or "auto", s.degree or "auto",
            "2^16 (compression=int8)" if s.compact else f"2^{s.ring.modulus.bit_length() - 1}",
            "as many" if s.compact else s.ring.quantization_range, s.ring.clipping_range,
            f", {self.dp.mechanism}" if self.dp is not None else "",
        )  # fmt: skip

    def run_summary(self) -> dict[str, Any]:
        s = self.secagg
        return {"secagg": {"threshold": s.threshold, "degree": s.degree, "modulus_range": s.ring.modulus}}

    def extras(self) -> tuple[str, ...]:
        if self.dp is None:
            return PLAIN_EXTRAS
        return (UNCLIPPED,) if self.dp.adaptive else ()

    def secure_train(
        self, server_round: int, messages: list[Message], exchange: Callable[[list[Message]], list[Message]]
    ) -> tuple[ArrayRecord | None, MetricRecord | None, Outcome]:
        """A SecAgg+ round with `messages` (configure_train's tasks) as its training stage."""
        n = len(messages)
        k, t = self.graph(n)
        layout = Layout.of(self._global, self.extras())
        ring = self.secagg.ring_for(n)
        record: dict[str, Any] = {
            SECAGG_MODULUS: ring.modulus,
            SECAGG_QUANTIZATION: ring.quantization_range,
            SECAGG_CLIPPING: ring.clipping_range,
            SECAGG_EXTRAS: list(layout.extras),
            SECAGG_MAX_WEIGHT: float(self.secagg.max_weight),
        }
        if self.dp is not None:
            self.dp.check_budget(n, t)
            update_var, count_var = self.dp.plan(n)
            record |= {SECAGG_CLIP_NORM: self.dp.clip_norm, SECAGG_NOISE: update_var, SECAGG_COUNT_NOISE: count_var}
        protocol = SecureRound(t, k, ring, self.limits.message_ttl_s, name=lambda node: label(node, self.wiring.names))
        outcome = protocol.run(server_round, messages, exchange, layout.size, record)
        self.last_outcome = outcome
        report = RoundReport(sampled=n)  # every node sampled is a survivor or rejected: none is "missing"
        survived = set(outcome.survivors)  # a survivor that left at the unmask stage is still in the sum
        report.rejected = [Rejection(node, why) for node, why in outcome.dropped.items() if node not in survived]
        self.train_report, self.last_valid = report, []
        if outcome.total is None:
            report.policy = "aborted: " + str(outcome.aborted)
            if self.secagg.on_too_few == "stop":
                raise SecureAbort(f"round {server_round}: secure aggregation aborted ({outcome.aborted})")
            return None, None, outcome
        report.accepted = outcome.survivors
        self.sum_digest = hashlib.sha256(outcome.total.tobytes()).hexdigest()
        sums, extras = layout.split(ring.decode(outcome.total))
        if self.dp is not None:
            divisor = float(n)  # public: the tasks sent, never the survivors
            self.dp.account(n, len(outcome.survivors), extras.get(UNCLIPPED))
            metrics: dict[str, float] = {}
        else:
            divisor = extras[WEIGHT]
            if divisor <= 0:
                log.warning("round %d: the survivors' weights sum to %g; keeping the model", server_round, divisor)
                return None, None, outcome
            metrics = {TRAIN_LOSS: extras[LOSS] / divisor, TRAIN_ACCURACY: extras[ACCURACY] / divisor}
            metrics["secagg-clipped-fraction"] = extras[CLIPPED] / divisor
        new = {k: v.clone() for k, v in self._global.items()}
        for key, total in sums.items():
            new[key] = (self._global[key].double() + total.to(self._global[key].device) / divisor).to(
                self._global[key].dtype
            )
        metrics["secagg-survivors"] = float(len(outcome.survivors))
        return tensors_to_record(new, consume=True), MetricRecord(metrics), outcome

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **({"distributed_dp": self.dp.state_dict()} if self.dp else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.dp is not None and "distributed_dp" in state:
            self.dp.load_state_dict(state["distributed_dp"])
