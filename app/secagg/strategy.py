"""FedAvg over secure aggregation (secagg=plus): the server learns the cohort's sums, never a reply.

Each round is a SecAgg+ round (server.py) with the nodes FedAvg samples: the training task goes
out in its third stage, and the strategy gets back only the survivors' summed ring vector. It
holds the weighted update sum and the weight sum (FedAvg: global + sum(w x update) / sum(w),
the weights capped on the nodes), or under distributed DP the noised sum of clipped updates,
divided by the number of tasks sent (dp.py). Robust rules, contribution scores and per-node
ledger entries need individual updates, so validation refuses them with secure aggregation.

Nothing checks one masked input, so the sums are checked (groups.py): plain sums that no set of
honest survivors can send are refused (the model kept), and the next rounds split the cohort into
groups, each its own SecAgg+ round of at least 3, until the node behind them is isolated and
excluded for the run; under distributed DP the count of unclipped updates is clamped to what the
survivors can send (dp.py). Every step passes the finite-step check of the other strategies.
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
from app.secagg.groups import LEAST_CONTRIBUTORS, GroupSearch, sums_problem
from app.secagg.ring import ACCURACY, CLIPPED, LOSS, PLAIN_EXTRAS, UNCLIPPED, WEIGHT, Layout, Ring
from app.secagg.server import Outcome, SecureRound, default_degree, default_threshold
from strategies.fedavg import FedAvg, RoundReport
from strategies.keys import NUM_EXAMPLES
from strategies.node_names import label, labels
from strategies.regional import RegionModel
from strategies.replies import Rejection, ValidReply, weighted_metrics
from strategies.tensor_ops import TensorDict, finite_step, tensors_to_record

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

    def contributors_problem(self, cohort: int) -> str | None:
        """Why a round of `cohort` nodes (not a region's: its sum goes on to the top level) could end
        with fewer than 3 contributors: with 2, each subtracts its own update from the sum, which
        the next global model shows it, and learns the other's."""
        if cohort < LEAST_CONTRIBUTORS:
            return (
                f"secure aggregation needs at least {LEAST_CONTRIBUTORS} nodes in a round, the cohort is {cohort}: "
                "with 2, each subtracts its own update from the sum (the next model shows it) and learns the other's"
            )
        k, t = self.graph(cohort)
        if t < LEAST_CONTRIBUTORS:
            return (
                f"a threshold of t = {t} (secagg.threshold={self.threshold}, secagg.degree={self.degree}: "
                f"neighbourhoods of {k + 1} in a cohort of {cohort}) lets a round finish with {t} contributors, "
                f"each of whom learns the other's update from the sum: set secagg.threshold >= {LEAST_CONTRIBUTORS} "
                f"and secagg.degree >= {LEAST_CONTRIBUTORS - 1} (or 0 for the defaults)"
            )
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


@dataclass
class Summed:
    """One SecAgg+ group's decoded sums that passed the checks, and what they are divided by."""

    group: int
    sums: dict[str, torch.Tensor]
    extras: dict[str, float]
    divisor: float  # the group's weight sum; under distributed DP the tasks sent
    outcome: Outcome


class SecureFedAvg(FedAvg):
    """FedAvg whose rounds are SecAgg+ rounds (app/run/federation.py calls `secure_train`)."""

    secure = True
    streams = False  # no `aggregate_stream`: the masked inputs are summed as they arrive by `secure_train`

    def __init__(self, *, secagg: SecAggSettings, dp: DistributedDP | None = None, **fedavg: Any) -> None:
        super().__init__(**fedavg)
        self.secagg, self.dp = secagg, dp
        self.last_outcome: Outcome | None = None
        self.sum_digest: str | dict[str, str] | None = None  # sha256 of the last unmasked sum (per group or region)
        self.search = GroupSearch(least=max(LEAST_CONTRIBUTORS, secagg.threshold))  # kept in checkpoints

    @property
    def excluded(self) -> dict[int, str]:
        """Nodes excluded from secure rounds for the run, and why (`GroupSearch`)."""
        return self.search.excluded

    def eligible(self, nodes: list[int]) -> list[int]:
        """The connected nodes a round may sample: all but those excluded for the run."""
        return [v for v in nodes if v not in self.search.excluded]

    def held_replies(self, num_nodes: int, streamed: bool) -> int:
        """None: each masked input is folded into the sum as it arrives and its arrays dropped."""
        return 0

    def node_count_problem(self, num_nodes: int) -> str | None:
        n = self.cohort_size(num_nodes)
        if self.regions is None and (why := self.secagg.contributors_problem(n)) is not None:
            if n >= LEAST_CONTRIBUTORS:
                return why
            fix = (
                f"run at least {LEAST_CONTRIBUTORS} nodes (simulation: flwr run . --federation-config "
                '"num-supernodes=5 ..."; a deployment: more SuperNodes)'
                if num_nodes < LEAST_CONTRIBUTORS
                else f"set federation.min_train_nodes={LEAST_CONTRIBUTORS} or more (or a larger federation.fraction_train)"
            )
            return f"{why}. A round samples {n} of the {num_nodes} connected nodes: {fix}"
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
        excluded = {str(node): why for node, why in self.search.excluded.items()}  # nodes left out for the run
        return {
            "secagg": {
                "threshold": s.threshold,
                "degree": s.degree,
                "modulus_range": s.ring.modulus,
                "excluded": excluded,
            }
        }

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
        layout = Layout.of(self._global, self.extras())
        if self.regions is not None:
            return self._regional(server_round, messages, exchange, layout, side_by_side or one_after_another)
        if self.dp is not None:
            return self._private(server_round, messages, exchange, layout)
        return self._grouped(server_round, messages, exchange, layout, side_by_side or one_after_another)

    def _private(
        self,
        server_round: int,
        messages: list[Message],
        exchange: Callable[[list[Message]], list[Message]],
        layout: Layout,
    ) -> tuple[ArrayRecord | None, MetricRecord | None, Outcome]:
        """Distributed DP's round: one SecAgg+ round over the cohort (its noise is planned for the
        whole cohort); the noised sum of clipped updates divided by the tasks sent (public, never
        the survivors); the release charged, and the clip adapted from the clamped count."""
        assert self.dp is not None
        n = len(messages)
        outcome, ring = self._secure_sum(server_round, messages, exchange, layout)
        self.last_outcome = outcome
        report = self._report(n, outcome)
        if outcome.total is None:
            return self._aborted(server_round, report, outcome)
        report.accepted = outcome.survivors
        self.sum_digest = hashlib.sha256(outcome.total.tobytes()).hexdigest()
        sums, extras = layout.split(ring.decode(outcome.total))
        if (clamped := self.dp.account(n, len(outcome.survivors), extras.get(UNCLIPPED))) is not None:
            log.warning("round %d: %s", server_round, clamped)
        new, dropped = self._combine([Summed(0, sums, extras, float(n), outcome)])
        if new is None:
            self._refuse(server_round, outcome, dropped[0][1])
            self._report(n, outcome).policy = "aborted: " + str(outcome.aborted)
            return None, None, outcome
        metrics = {"secagg-survivors": float(len(outcome.survivors))}
        return tensors_to_record(self.server_step(server_round, new), consume=True), MetricRecord(metrics), outcome

    def _grouped(
        self,
        server_round: int,
        messages: list[Message],
        exchange: Callable[[list[Message]], list[Message]],
        layout: Layout,
        side_by_side: SideBySide,
    ) -> tuple[ArrayRecord | None, MetricRecord | None, Outcome]:
        """Plain secure aggregation: one SecAgg+ round over the cohort or, while the node behind sums
        that failed the checks is searched for, one per group (`GroupSearch.groups`; side by side on
        a virtual clock). Each group's sums are checked (`sums_problem`): a failing group is refused
        and its survivors narrow the search; the passing groups combine as FedAvg over their
        members (global + their summed weighted updates / their summed weights)."""
        by_node = {m.metadata.dst_node_id: m for m in messages}
        groups = self.search.groups(list(by_node))
        names = self.wiring.names
        if len(groups) > 1:
            log.info(
                "round %d: secure groups %s: group testing for the node behind refused sums among %s",
                server_round, ", ".join(labels(g, names) for g in groups), labels(sorted(self.search.suspects), names),
            )  # fmt: skip
        results: list[tuple[Outcome, Ring]] = []
        with side_by_side() as branch:
            for group in groups:
                branch()
                results.append(self._secure_sum(server_round, [by_node[v] for v in group], exchange, layout))
        passed: list[Summed] = []
        failing: list[tuple[list[int], str]] = []
        for i, (outcome, ring) in enumerate(results):
            if outcome.total is None:
                continue
            sums, extras = layout.split(ring.decode(outcome.total))
            if (why := sums_problem(sums, extras, len(outcome.survivors), ring, self.secagg.max_weight)) is None:
                passed.append(Summed(i, sums, extras, extras[WEIGHT], outcome))
                continue
            failing.append((outcome.survivors, why))
            self._refuse(server_round, outcome, f"its sums fail the checks: {why}")
        for node, why in self.search.record(server_round, failing):
            log.warning("round %d: %s is excluded: %s", server_round, label(node, names), why)
        new, dropped = self._combine(passed)
        for part, why in dropped:
            self._refuse(server_round, part.outcome, why)
        kept = [p for p in passed if not any(p is d for d, _ in dropped)]
        outcome = results[0][0] if len(results) == 1 else self._merged(groups, results, {p.group for p in kept})
        self.last_outcome = outcome
        report = self._report(len(messages), outcome)
        if new is None:
            if outcome.total is None and not failing and self.secagg.on_too_few == "stop":
                raise SecureAbort(f"round {server_round}: secure aggregation aborted ({outcome.aborted})")
            report.policy = "aborted: " + str(outcome.aborted)
            return None, None, outcome
        report.accepted = outcome.survivors
        digests = {str(p.group): hashlib.sha256(p.outcome.total.tobytes()).hexdigest() for p in kept}  # type: ignore[union-attr]
        self.sum_digest = digests["0"] if len(results) == 1 else digests
        extras = {key: sum(p.extras[key] for p in kept) for key in PLAIN_EXTRAS}
        metrics = self._plain_metrics(extras)
        metrics[NUM_EXAMPLES] = extras[WEIGHT] * self.secagg.max_weight  # in the sum: a region's weight when deployed
        metrics["secagg-survivors"] = float(len(outcome.survivors))
        return tensors_to_record(self.server_step(server_round, new), consume=True), MetricRecord(metrics), outcome

    def _combine(self, parts: list[Summed]) -> tuple[TensorDict | None, list[tuple[Summed, str]]]:
        """global + (the parts' summed updates) / (their summed divisors), through `finite_step`, the
        check every strategy makes: a part that would make the model non-finite is left out, named."""

        def step(kept: list[Summed]) -> tuple[TensorDict | None, list[Any]]:
            if not kept:
                return None, []
            divisor = sum(p.divisor for p in kept)
            total = {k: sum(p.sums[k] for p in kept) for k in kept[0].sums}
            return self._step(total, divisor), [(p, p.sums, None, 1.0 / divisor) for p in kept]  # type: ignore[misc]

        return finite_step(parts, step)

    def _refuse(self, server_round: int, outcome: Outcome, why: str) -> None:
        """A group's unmasked sum is not used: its survivors are named with `why`, none applied."""
        for node in outcome.survivors:
            outcome.dropped[node] = f"refused: {why}"
        log.warning(
            "round %d: the secure sum of %s is refused (the model keeps its values): %s",
            server_round, labels(outcome.survivors, self.wiring.names), why,
        )  # fmt: skip
        outcome.survivors, outcome.aborted = [], f"refused: {why}"

    def _merged(self, groups: list[list[int]], results: list[tuple[Outcome, Ring]], kept: set[int]) -> Outcome:
        """One outcome for the row and the ledger from the groups' (as `_regional`'s from the regions'):
        the survivors of the groups applied; a group that aborted or was refused names its nodes."""
        merged = Outcome()
        for i, (outcome, _) in enumerate(results):
            merged.merge(i, outcome)
            if i in kept:
                merged.survivors += outcome.survivors
                continue
            for node in groups[i]:
                merged.dropped.setdefault(node, f"group {i}'s secure round aborted: {outcome.aborted}")
        merged.survivors.sort()
        if not kept:
            merged.aborted = "; ".join(f"group {i}: {o.aborted}" for i, (o, _) in enumerate(results))
        return merged

    def _exclude_culprits(self, server_round: int, outcome: Outcome) -> None:
        """Nodes the SecAgg+ round proved to have deviated (`Outcome.culprits`) are excluded for the run."""
        for node, why in getattr(outcome, "culprits", {}).items():
            if node not in self.search.excluded:
                self.search.exclude(node, f"round {server_round}: the secure round proved it deviated: {why}")
                log.warning(
                    "round %d: %s is excluded from secure rounds for the rest of the run: %s",
                    server_round, label(node, self.wiring.names), self.search.excluded[node],
                )  # fmt: skip

    def _aborted(
        self, server_round: int, report: RoundReport, outcome: Outcome
    ) -> tuple[ArrayRecord | None, MetricRecord | None, Outcome]:
        report.policy = "aborted: " + str(outcome.aborted)
        if self.secagg.on_too_few == "stop":
            raise SecureAbort(f"round {server_round}: secure aggregation aborted ({outcome.aborted})")
        return None, None, outcome

    def _secure_sum(
        self,
        server_round: int,
        messages: list[Message],
        exchange: Callable[[list[Message]], list[Message]],
        layout: Layout,
        region: bool = False,
    ) -> tuple[Outcome, Ring]:
        """One SecAgg+ round over `messages`' nodes (a group of the round's, or a region's, which may
        have 2: its sum goes on to the top level): its outcome and the ring it summed in."""
        n = len(messages)
        k, t = self.secagg.graph(n)
        ring = self.secagg.ring_for(n)
        small = self.secagg.group_problem(n) if region else self.secagg.contributors_problem(n)
        if small is not None:  # exclusions or a bounded wait left too few: nothing is sent
            log.warning("secure aggregation: round %d not run: %s", server_round, small)
            return Outcome(aborted=small), ring
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
        self._exclude_culprits(server_round, outcome)
        return outcome, ring

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
                outcomes[region] = self._secure_sum(server_round, group, exchange, layout, region=True)
        for region, (outcome, ring) in outcomes.items():
            group = groups[region]
            merged.merge(region, outcome)
            why = outcome.aborted
            if outcome.total is not None:
                sums, extras = layout.split(ring.decode(outcome.total))
                survivors = len(outcome.survivors)
                if (why := sums_problem(sums, extras, survivors, ring, self.secagg.max_weight)) is None:
                    sums_digests[str(region)] = hashlib.sha256(outcome.total.tobytes()).hexdigest()
                    metrics = MetricRecord(self._plain_metrics(extras))
                    model = self._step(sums, extras[WEIGHT])
                    weight = extras[WEIGHT] * self.secagg.max_weight  # the nodes sent w / max_weight
                    made[region] = RegionModel(model, weight, metrics, outcome.survivors)
                    continue
                why = f"its sums fail the checks: {why}"
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
        dp = {"distributed_dp": self.dp.state_dict()} if self.dp else {}
        return {**super().state_dict(), "secure_groups": self.search.state_dict(), **dp}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "secure_groups" in state:  # absent from checkpoints written before the search existed
            self.search.load_state_dict(state["secure_groups"])
        if self.dp is not None and "distributed_dp" in state:
            self.dp.load_state_dict(state["distributed_dp"])
