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
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
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
from strategies.keys import NUM_EXAMPLES
from strategies.node_names import label
from strategies.regional import RegionModel
from strategies.replies import Rejection, ValidReply, weighted_metrics
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

    def graph(self, cohort: int) -> tuple[int, int]:
        """(k, t) for a round of `cohort` nodes."""
        k = min(self.degree or default_degree(cohort), cohort - 1)
        return k, self.threshold or default_threshold(k + 1)

    def group_problem(self, cohort: int) -> str | None:
        """Why `cohort` nodes (a round's, or a region's) could never run a SecAgg+ round."""
        k, t = self.graph(cohort)
        if cohort < 2:
            return f"secure aggregation needs at least 2 nodes in a round, the cohort is {cohort}"
        if not 2 <= t <= k + 1:
            return f"secagg.threshold={t} must be within 2..{k + 1} (secagg.degree + 1) for a cohort of {cohort}"
        return None

    def ring_for(self, cohort: int) -> Ring:
        """The round's ring: the configured one, or with `compact` Z_2^16 with the most steps
        (a power of two) whose sum over `cohort` inputs cannot wrap: 4096 for 10 nodes, 1024
        for 50. The int8 codec is not run: quantizing once, into this ring, is the compression."""
        if not self.compact:
            return self.ring
        steps = 2 ** int(math.log2((COMPACT_MODULUS - 1) // max(cohort, 1)))
        return Ring(self.ring.clipping_range, steps, COMPACT_MODULUS)


COMPACT_MODULUS = 2**16  # compression=int8: each masked coordinate takes 2 bytes on the wire


SideBySide = Callable[[], AbstractContextManager[Callable[[], None]]]
"""Groups of exchanges that run at the same time: call the yielded `branch()` before each group."""


@contextmanager
def one_after_another() -> Iterator[Callable[[], None]]:
    """`SideBySide` in real time: the groups simply run in turn."""
    yield lambda: None


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
        self.sum_digest: str | dict[str, str] | None = None  # sha256 of the last unmasked sum (per region: regions)

    def held_replies(self, num_nodes: int, streamed: bool) -> int:
        """None: each masked input is folded into the sum as it arrives and its arrays dropped."""
        return 0

    def node_count_problem(self, num_nodes: int) -> str | None:
        n = self.cohort_size(num_nodes)
        if (why := self.secagg.group_problem(n)) is not None:
            return why
        if n > COMPACT_MODULUS // 4 and self.secagg.compact:
            return f"compression=int8 under secure aggregation holds at most {COMPACT_MODULUS // 4} nodes a round"
        if (why := self.secagg.ring_for(n).room(n)) is not None:
            return why
        if self.dp is not None and (why := self.dp.room_problem(n)) is not None:
            return why
        return None

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
        self,
        server_round: int,
        messages: list[Message],
        exchange: Callable[[list[Message]], list[Message]],
        side_by_side: SideBySide | None = None,
    ) -> tuple[ArrayRecord | None, MetricRecord | None, Outcome]:
        """A SecAgg+ round with `messages` (configure_train's tasks) as its training stage; under
        topology=regions one SecAgg+ round per region (`_regional`), side by side on a virtual
        clock (`side_by_side`: VirtualClockGrid's), else one after another."""
        n = len(messages)
        layout = Layout.of(self._global, self.extras())
        if self.regions is not None:
            return self._regional(server_round, messages, exchange, layout, side_by_side or one_after_another)
        outcome, ring = self._secure_sum(server_round, messages, exchange, layout)
        self.last_outcome = outcome
        report = self._report(n, outcome)
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
            metrics = self._plain_metrics(extras)
            metrics[NUM_EXAMPLES] = divisor * self.secagg.max_weight  # in the sum: a region's weight when deployed
        new = self.server_step(server_round, self._step(sums, divisor))
        metrics["secagg-survivors"] = float(len(outcome.survivors))
        return tensors_to_record(new, consume=True), MetricRecord(metrics), outcome

    def _secure_sum(
        self,
        server_round: int,
        messages: list[Message],
        exchange: Callable[[list[Message]], list[Message]],
        layout: Layout,
    ) -> tuple[Outcome, Ring]:
        """One SecAgg+ round over `messages`' nodes: its outcome and the ring it summed in."""
        n = len(messages)
        k, t = self.secagg.graph(n)
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
        return protocol.run(server_round, messages, exchange, layout.size, record), ring

    def _regional(
        self,
        server_round: int,
        messages: list[Message],
        exchange: Callable[[list[Message]], list[Message]],
        layout: Layout,
        side_by_side: SideBySide,
    ) -> tuple[ArrayRecord | None, MetricRecord | None, Outcome]:
        """SecAgg+ inside each region (topology=regions): each region's sampled sites run their own
        SecAgg+ round (their own graph, threshold and ring), so its aggregator learns the region's
        sums only; the region's model (global + its weighted update sum / its weight sum) then goes
        to the top level as any region's would (`RegionalCombine.combine_made`: WAN leg, this
        strategy's weighted mean over regions). A region whose round aborts sends nothing; the
        round aborts (secagg.on_too_few) only when every region does. One outcome for the row and
        the ledger: every region's stages, survivors and drops (an aborted region's sites named
        with the reason), the masked and unmasked sums' digests per region."""
        assert self.regions is not None and self.dp is None  # validation: no distributed DP over regions
        groups: dict[int, list[Message]] = {}
        merged = Outcome()
        for m in messages:
            node = m.metadata.dst_node_id
            if (region := self.regions.region_of(node)) is None:
                merged.dropped[node] = "its node has no region (topology.regions)"
            else:
                groups.setdefault(region, []).append(m)
        made: dict[int, RegionModel] = {}
        aborted: dict[int, str] = {}
        sums_digests: dict[str, str] = {}
        outcomes: dict[int, tuple[Outcome, Ring]] = {}
        with side_by_side() as branch:
            for region, group in sorted(groups.items()):
                branch()
                outcomes[region] = self._secure_sum(server_round, group, exchange, layout)
        for region, (outcome, ring) in outcomes.items():
            group = groups[region]
            merged.merge(region, outcome)
            why = outcome.aborted
            if outcome.total is not None:
                sums, extras = layout.split(ring.decode(outcome.total))
                if extras[WEIGHT] > 0:
                    sums_digests[str(region)] = hashlib.sha256(outcome.total.tobytes()).hexdigest()
                    metrics = MetricRecord(self._plain_metrics(extras))
                    model = self._step(sums, extras[WEIGHT])
                    weight = extras[WEIGHT] * self.secagg.max_weight  # the nodes sent w / max_weight
                    made[region] = RegionModel(model, weight, metrics, outcome.survivors)
                    continue
                why = f"its survivors' weights sum to {extras[WEIGHT]:g}"
            aborted[region] = str(why)
            log.warning("round %d: region %d sends nothing: its secure round: %s", server_round, region, why)
            for m in group:  # none of the region is used: named, as a flat abort's nodes are not
                merged.dropped.setdefault(m.metadata.dst_node_id, f"region {region}'s secure round aborted: {why}")
        self.last_outcome = merged
        report = self._report(len(messages), merged)
        if not made:
            merged.aborted = "; ".join(f"region {r}: {why}" for r, why in aborted.items()) or "no region sampled"
            report.policy = "aborted: " + merged.aborted
            if self.secagg.on_too_few == "stop":
                raise SecureAbort(
                    f"round {server_round}: secure aggregation aborted in every region ({merged.aborted})"
                )
            return None, None, merged
        merged.survivors = sorted(n for m in made.values() for n in m.members)
        self.sum_digest = sums_digests
        names = self.wiring.names
        new = self.regions.combine_made(server_round, self._global, made, self.aggregate_models, report, names)
        report.accepted = merged.survivors
        if new is None:
            return None, None, merged
        metrics = dict(weighted_metrics([ValidReply(-1, m.weight, m.metrics) for m in made.values()]))
        metrics["secagg-survivors"] = float(len(merged.survivors))
        return tensors_to_record(self.server_step(server_round, new), consume=True), MetricRecord(metrics), merged

    def _report(self, sampled: int, outcome: Outcome) -> RoundReport:
        """The round's report: every node sampled is a survivor or rejected, none "missing"."""
        report = RoundReport(sampled=sampled)
        survived = set(outcome.survivors)  # a survivor that left at the unmask stage is still in the sum
        report.rejected = [Rejection(node, why) for node, why in outcome.dropped.items() if node not in survived]
        self.train_report, self.last_valid = report, []
        return report

    @staticmethod
    def _plain_metrics(extras: dict[str, float]) -> dict[str, float]:
        """The survivors' weighted-mean loss, accuracy and clipped fraction, from the summed extras."""
        w = extras[WEIGHT]
        return {
            TRAIN_LOSS: extras[LOSS] / w,
            TRAIN_ACCURACY: extras[ACCURACY] / w,
            "secagg-clipped-fraction": extras[CLIPPED] / w,
        }

    def _step(self, sums: dict[str, torch.Tensor], divisor: float) -> dict[str, torch.Tensor]:
        """The global model plus `sums` / `divisor` (float64, then each tensor's own dtype)."""
        new = {k: v.clone() for k, v in self._global.items()}
        for key, total in sums.items():
            g = self._global[key]
            new[key] = (g.double() + total.to(g.device) / divisor).to(g.dtype)
        return new

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **({"distributed_dp": self.dp.state_dict()} if self.dp else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.dp is not None and "distributed_dp" in state:
            self.dp.load_state_dict(state["distributed_dp"])
