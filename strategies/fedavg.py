"""Federated Averaging with validated replies and in-place tensor aggregation.

McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from
Decentralized Data", https://arxiv.org/abs/1602.05629: the new global model is the
mean of the client models weighted by their example counts.

Those counts are the clients' claims. Taken as they stand, one node claiming 1e300
examples *is* the new model; so each weight is capped (`weight_cap`, see
`strategies/replies.py`) at what the server can vouch for: the node's real partition
size in simulation, `federation.max_examples_per_node` in deployment. A lying node's
share of the mean is then at most cap / (cap + the honest weights), and the weight
sum is always finite.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from strategies.keys import ARRAYS, CONFIG, FROZEN, NUM_EXAMPLES, SERVER_ROUND
from strategies.node_wait import wait_for_nodes
from strategies.norm_bound import NormBound
from strategies.replies import (
    ArraySpec,
    EncodedModel,
    Rejection,
    Screened,
    ValidReply,
    records_of,
    reject,
    screen_each,
    screen_replies,
    specs_of,
    weighted_metrics,
)
from strategies.server_opt import ServerOptimizer
from strategies.settings import ReplyLimits, Sampling, TaskWiring
from strategies.streaming import MeanFold
from strategies.tensor_ops import (
    NON_FINITE_STEP,
    Part,
    TensorDict,
    finite_step,
    is_finite,
    record_to_tensors,
    stage,
    tensors_to_record,
    weighted_mean,
)

if TYPE_CHECKING:
    from strategies.regional import RegionalCombine

log = logging.getLogger("flwr.fedgpu." + __name__)


@dataclass
class RoundReport:
    """Who took part in the last aggregation, for logs and metrics.jsonl."""

    sampled: int = 0
    accepted: list[int] = field(default_factory=list)  # replies the new model is built from
    rejected: list[Rejection] = field(default_factory=list)  # invalid replies
    excluded: list[int] = field(default_factory=list)  # valid replies a robust rule left out
    scores: dict[int, float] = field(default_factory=dict)  # per-node robust scores (Krum)
    policy: str | None = None  # what happened when too few valid replies arrived
    capped: list[dict[str, float]] = field(default_factory=list)  # node_id, claimed, weight: claims cut to the cap
    clipped: list[dict[str, Any]] = field(default_factory=list)  # node_id, norm, bound: updates cut to the norm bound

    def robust_row(self) -> dict[str, Any]:
        """The robust-aggregation part of a metrics.jsonl row."""
        return {
            "selected": self.accepted,
            "excluded": self.excluded,
            "scores": {str(k): v for k, v in self.scores.items()},
            "policy": self.policy,
        }


def task_content(arrays: ArrayRecord, config: ConfigRecord, frozen: ArrayRecord | None) -> RecordDict:
    """A task's content: the model, its config and, when some parameters are frozen, those."""
    return RecordDict({ARRAYS: arrays, CONFIG: config, **({FROZEN: frozen} if frozen else {})})


def guarded_step(
    server_round: int, screened: Screened, step: Callable[[list[ValidReply]], tuple[TensorDict | None, list[Part]]]
) -> TensorDict | None:
    """`step` over the round's valid replies through `finite_step`: the replies that would make the
    model non-finite are rejected (named in the log and the round's report), the step is redone
    without them, and None (keep the model) when no finite step is left."""
    new, dropped = finite_step(list(screened.valid), step)
    for reply, reason in dropped:
        reject(screened, reply, reason)
    if new is None and dropped:
        log.warning("round %d: %s; keeping the previous global model", server_round, NON_FINITE_STEP)
    return new


def _released(valid: Iterable[ValidReply]) -> Iterator[ValidReply]:
    """Each reply in turn; once the caller has folded it, its arrays are dropped (the bytes they view
    go with the Message), so a streamed round holds one reply at a time."""
    for reply in valid:
        yield reply
        reply.arrays = {}


def _capped(screened: Screened) -> list[dict[str, float]]:
    """The valid replies whose claimed count was cut to the cap: node_id, claimed, weight."""
    return [
        {"node_id": r.node_id, "claimed": float(r.metrics[NUM_EXAMPLES]), "weight": r.weight}
        for r in screened.valid
        if r.weight < r.metrics[NUM_EXAMPLES]
    ]


def _destinations(messages: list[Message]) -> dict[str, int]:
    """message id -> destination node, for the messages the grid has pushed."""
    return {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}


class FedAvg(Strategy):
    """Sample-weighted FedAvg (a Flower message-API strategy).

    Every reply is screened first (error replies, non-finite values, keys, byte size,
    shapes or dtypes that differ from the global model sent out, a missing or
    non-positive `num-examples`); rejected replies are logged with node id and reason
    and left out. Claimed counts are capped by `weight_cap` (None: only at
    `replies.MAX_WEIGHT`), in training and evaluation replies alike. A round with no
    valid reply returns no arrays, so the caller keeps the old model.

    Parameters
    ----------
    sampling : Sampling
        Who trains and evaluates each round, the nodes to wait for and for how long, the
        sampler's seed (`strategies.settings`).
    limits : ReplyLimits
        Each task's lifetime, the cap on claimed example counts (None: only
        `replies.MAX_WEIGHT`), a compressed uplink's decoder.
    wiring : TaskWiring
        The frozen parameters every task carries, the downlink codec, per-node task keys,
        and how log lines name nodes.
    device : torch.device | str (default: "cpu")
        Where replies are aggregated.
    regions : RegionalCombine | None (default: None)
        topology=regions: each region's replies combined first, this strategy's rule over the
        regions (`strategies/regional.py`); streamed with the mean inside regions (one running mean
        each), gathered with a robust rule inside.
    server_opt : ServerOptimizer | None (default: None)
        A server optimizer (strategies/server_opt.py): the new model is its step along the aggregate.
    norm_bound : NormBound | None (default: None)
        `strategy.norm_bound` (strategies/norm_bound.py): each valid reply's update is bounded against
        the median of the recently accepted ones before it reaches the mean; None: no bound.
    """

    def __init__(
        self,
        *,
        sampling: Sampling | None = None,
        limits: ReplyLimits | None = None,
        wiring: TaskWiring | None = None,
        device: torch.device | str = "cpu",
        regions: RegionalCombine | None = None,
        server_opt: ServerOptimizer | None = None,
        norm_bound: NormBound | None = None,
    ) -> None:
        self.regions = regions
        self.server_opt = server_opt
        self.norm_bound = norm_bound
        if regions is not None and regions.rule is not None:
            self.streams = False  # a robust rule inside regions needs each region's replies together
        self.sampling = sampling or Sampling()
        self.limits = limits or ReplyLimits()
        self.wiring = wiring or TaskWiring()
        self.device = torch.device(device)
        self.sampler = random.Random(self.sampling.seed)
        self.seen: set[int] = set()  # nodes sampled so far: the missing ones are named while waiting
        self.train_report = RoundReport()
        self.evaluate_report = RoundReport()
        self._specs: dict[str, ArraySpec] = {}
        self._global: TensorDict = {}  # the model sent this round: every reply's base
        self._sent_train: list[Message] = []  # this round's messages (to name a rejection's node)
        self._sent_evaluate: list[Message] = []
        self.last_valid: list[ValidReply] = []

    # How the server's run drives this strategy (app/run/federation.py): synchronous rounds.
    asynchronous = False
    unit = "round"

    @property
    def name(self) -> str:
        """How logs, summaries and checkpoints call this strategy."""
        return type(self).__name__

    def robust_row(self) -> dict[str, Any] | None:
        """The robust rule's picks in the last round, for metrics.jsonl (None: a plain mean)."""
        return None

    def cohort_size(self, num_nodes: int) -> int:
        """The most nodes a round samples out of `num_nodes` (Flower's sampling rule)."""
        return min(num_nodes, max(int(num_nodes * self.sampling.fraction_train), self.sampling.min_train_nodes))

    def node_count_problem(self, num_nodes: int) -> str | None:
        """Checked before the first round: why `num_nodes` nodes could never satisfy this strategy."""
        return None

    def run_summary(self) -> dict[str, Any]:
        """Strategy-specific entries of summary.json."""
        return {}

    def summary(self) -> None:
        log.info(
            "%s: train %.2f of nodes (min %d), evaluate %.2f (min %d), min available %d, "
            "message TTL %.0f s, aggregating on %s",
            self.name,
            self.sampling.fraction_train,
            self.sampling.min_train_nodes,
            self.sampling.fraction_evaluate,
            self.sampling.min_evaluate_nodes,
            self.sampling.min_available_nodes,
            self.limits.message_ttl_s,
            self.device,
        )
        if self.norm_bound is not None:
            log.info("%s: %s", self.name, self.norm_bound.describe())

    # --- sending ---------------------------------------------------------------
    def _messages(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        fraction: float,
        minimum: int,
        kind: str,
    ) -> list[Message]:
        if fraction == 0.0:
            return []
        node_ids = self.select_nodes(grid, fraction, minimum, kind)
        config[SERVER_ROUND] = server_round
        content = task_content(arrays, config, self.wiring.frozen)
        per_node = self.wiring.node_config if kind == MessageType.TRAIN else None
        downlink = self.wiring.downlink if kind == MessageType.TRAIN else None
        connected = set(grid.get_node_ids()) if per_node is not None else set()

        def content_for(node: int) -> RecordDict:
            extra = per_node(node, connected) if per_node is not None else {}
            sent = arrays
            if downlink is not None:
                sent, entries = downlink.task(node, self._global, arrays)
                extra = {**extra, **entries}
            return task_content(sent, ConfigRecord({**config, **extra}), self.wiring.frozen) if extra else content

        return [
            Message(
                content=content_for(node),
                message_type=kind,
                dst_node_id=node,
                ttl=self.limits.message_ttl_s,
                group_id=str(server_round),
            )
            for node in node_ids
        ]

    def select_nodes(self, grid: Grid, fraction: float, minimum: int, kind: str) -> list[int]:
        """`fraction` of the connected nodes (at least `minimum`), sampled the way Flower does,
        after a bounded wait for them (strategies/node_wait.py): past `round_wait_timeout_s`
        the round goes on with the nodes there if the strategy can work with that many."""
        wanted = max(int(len(list(grid.get_node_ids())) * fraction), minimum)
        nodes = wait_for_nodes(
            grid,
            max(self.sampling.min_available_nodes, wanted),
            self.fewest_nodes(minimum) if kind == MessageType.TRAIN else max(minimum, 1),
            self.sampling.round_wait_timeout_s,
            self.seen,
            names=self.wiring.names,
        )
        self.seen.update(nodes)
        nodes = self.eligible(nodes)
        return self.sampler.sample(nodes, min(wanted, len(nodes)))

    def eligible(self, nodes: list[int]) -> list[int]:
        """The connected nodes a round may sample: all of them (SecureFedAvg leaves out the nodes it
        excluded for the run)."""
        return nodes

    def fewest_nodes(self, minimum: int) -> int:
        """The smallest training cohort a round can go on with: `minimum`, or more for a rule that
        needs it (evaluation needs no more than its minimum)."""
        n = max(minimum, 1)
        while self.node_count_problem(n) is not None and n < 10_000:
            n += 1
        return n

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes and send them the global model; remember its layout to screen replies."""
        self._specs = specs_of(arrays)
        self._global = record_to_tensors(arrays)
        messages = self._messages(
            server_round,
            arrays,
            config,
            grid,
            self.sampling.fraction_train,
            self.sampling.min_train_nodes,
            MessageType.TRAIN,
        )
        self.train_report = RoundReport(sampled=len(messages))
        self._sent_train = messages  # the grid gives them their ids when it pushes them
        return messages

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = self._messages(
            server_round,
            arrays,
            config,
            grid,
            self.sampling.fraction_evaluate,
            self.sampling.min_evaluate_nodes,
            MessageType.EVALUATE,
        )
        self.evaluate_report = RoundReport(sampled=len(messages))
        self._sent_evaluate = messages
        return messages

    # --- aggregating ------------------------------------------------------------
    # Robust aggregators override these two.
    screen_finite = False  # FedAvg finds NaN/Inf in its own output instead of a separate pass

    def aggregate_models(self, server_round: int, screened: Screened) -> TensorDict | None:
        """The new global model from the screened replies, or None to keep the old one.

        The weighted mean is computed first and checked (`finite_step`): a NaN or Inf in the
        result points to the replies that caused it (their own NaN or Inf, or the largest weighted
        values where the sum overflowed float32), which are rejected before the mean is recomputed.
        The common case thus reads every reply once (and uploads it once to a GPU: a recomputation
        reuses the staged copies).
        """
        if (out := self._mean_of_encoded(screened)) is not None:
            return out
        staged = dict(zip(map(id, screened.valid), stage([r.arrays for r in screened.valid], self.device), strict=True))

        def mean(kept: list[ValidReply]) -> tuple[TensorDict | None, list[Part]]:
            if not kept:
                return None, []
            total = float(sum(r.weight for r in kept))
            parts: list[Part] = [(r, staged[id(r)], None, r.weight / total) for r in kept]
            return weighted_mean([staged[id(r)] for r in kept], [r.weight for r in kept], self.device), parts

        return guarded_step(server_round, screened, mean)

    def _mean_of_encoded(self, screened: Screened) -> TensorDict | None:
        """The weighted mean as the sent model plus each compressed reply's update added in place
        (`EncodedModel.add_update_to`): one model-sized accumulator, no dense copy per reply.
        None when it does not apply (plain replies, a non-fp32/fp64 model) or the result is not
        finite (the dense path then finds the culprits)."""
        valid = screened.valid
        floats = [k for k, t in self._global.items() if t.dtype in (torch.float32, torch.float64)]
        if not valid or len(floats) != sum(t.is_floating_point() for t in self._global.values()):
            return None
        if not all(isinstance(r.arrays, EncodedModel) and r.arrays.base is self._global for r in valid):
            return None
        total = float(sum(r.weight for r in valid))
        out = {k: self._global[k].to(self.device, copy=True) for k in floats}
        for reply in valid:
            reply.arrays.add_update_to(out, reply.weight / total)
        rest = [k for k in self._global if k not in out]  # integer buffers: sent as they are, averaged
        if rest:
            out |= weighted_mean(
                [{k: r.arrays[k] for k in rest} for r in valid], [r.weight for r in valid], self.device
            )
        return out if all(is_finite(t) for t in out.values()) else None

    def _settle_downlink(self, answered: set[int | None]) -> None:
        """Tell the downlink which nodes' tasks are over and which of them replied (not an error)."""
        if self.wiring.downlink is not None:
            for node in _destinations(self._sent_train).values():
                self.wiring.downlink.settle(node, node in answered)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's model from its gathered replies (in send order: the run is then bit for bit
        the same however the replies were timed)."""
        replies = list(replies)
        sent = _destinations(self._sent_train)
        self._settle_downlink({sent.get(r.metadata.reply_to_message_id) for r in replies if not r.has_error()})
        screened = screen_replies(
            replies,
            self._specs,
            check_finite=self.screen_finite,
            sent=sent,
            weight_cap=self.limits.weight_cap,
            unpack=self.limits.unpack,
            check=self.limits.check,
            base=self._global,
            names=self.wiring.names,
        )
        capped = _capped(screened)  # before aggregating: a reply it rejects still had its claim cut
        for reply in list(screened.valid):  # in send order, as the round is summed
            self.admit(reply, screened)
        return self._finish_train(server_round, screened, self.combine(server_round, screened), capped)

    def admit(self, reply: ValidReply, screened: Screened) -> bool:
        """Whether a valid reply goes on to the mean: `strategy.norm_bound` may reject it (moved to
        `screened.rejected` with the reason) or clip it (`train_report.clipped`)."""
        if self.norm_bound is None:
            return True
        why = self.norm_bound.admit(reply, self._global, self.train_report.clipped, self.wiring.names)
        if why is not None:
            reject(screened, reply, why)
        return why is None

    def combine(self, server_round: int, screened: Screened) -> TensorDict | None:
        """`aggregate_models` over the replies, or over their regions' models (topology=regions)."""
        if self.regions is None:
            return self.aggregate_models(server_round, screened)
        return self.regions.combine(server_round, self._global, screened, self.aggregate_models, self.train_report)

    # A strategy that folds replies as they arrive (`aggregate_stream`); a robust rule must see them all.
    streams = True

    def held_replies(self, num_nodes: int, streamed: bool) -> int:
        """The most replies whose arrays a round holds at once: the cohort gathered, none streamed
        (its accumulator is a constant number of model-sized tensors: `strategies/streaming.py`)."""
        return 0 if streamed and self.streams else self.cohort_size(num_nodes)

    def aggregate_stream(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's model from replies folded as they arrive (`replies` is read once, lazily):
        each is screened on its own (NaN or Inf included), folded, and its arrays dropped before the
        next is read; its Message keeps its metrics, not its arrays. Equal to `aggregate_train` to
        float rounding (strategies/streaming.py)."""
        sent = _destinations(self._sent_train)
        answered: set[int | None] = set()

        def arrived() -> Iterator[Message]:
            for msg in replies:
                if not msg.has_error():
                    answered.add(sent.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id))
                yield msg
                if not msg.has_error():  # folded: its arrays go now, whoever still holds the Message
                    for key in records_of(msg.content, ArrayRecord):
                        del msg.content[key]
                del msg  # not held while the next reply is fetched

        screened = Screened(names=self.wiring.names)
        valid = screen_each(
            arrived(),
            self._specs,
            screened,
            check_finite=True,
            sent=sent,
            weight_cap=self.limits.weight_cap,
            unpack=self.limits.unpack,
            check=self.limits.check,
            base=self._global,
        )
        new = self.fold_models(server_round, _released(r for r in valid if self.admit(r, screened)), screened)
        self._settle_downlink(answered)
        return self._finish_train(server_round, screened, new, _capped(screened))

    def fold_models(self, server_round: int, valid: Iterable[ValidReply], screened: Screened) -> TensorDict | None:
        """The new model from valid replies taken one at a time (`screened` fills as they come); with
        regions, one running mean per region, then this strategy's rule over them."""
        if self.regions is not None:
            report = self.train_report
            return self.regions.fold(server_round, self._global, valid, screened, self.aggregate_models, report)
        fold = MeanFold(self._global, self.device)
        for reply in valid:
            fold.add(reply.arrays, reply.weight)
        return fold.result()

    def _finish_train(
        self, server_round: int, screened: Screened, new: TensorDict | None, capped: list[dict[str, float]]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's report, and the new model with the metrics of the replies it used."""
        report = self.train_report
        report.capped = capped
        report.rejected = screened.rejected
        report.accepted = [r.node_id for r in screened.valid if r.node_id not in report.excluded]
        self.last_valid = list(screened.valid)  # the round's valid replies, for contribution scores
        used = [r for r in screened.valid if r.node_id in report.accepted] if new is not None else []
        if self.norm_bound is not None:
            self.norm_bound.commit(used)
        if new is None:
            if not screened.valid:
                log.warning("round %d: no valid training reply; keeping the previous global model", server_round)
            return None, None
        return tensors_to_record(self.server_step(server_round, new), consume=True), weighted_metrics(used)

    def server_step(self, server_round: int, aggregate: TensorDict) -> TensorDict:
        """The new model: the round's aggregate, or the server optimizer's step towards it
        (`strategy.server_optimizer`, strategies/server_opt.py)."""
        if self.server_opt is None:
            return aggregate
        return self.server_opt.step(self._global, aggregate, server_round)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        screened = screen_replies(
            replies,
            None,
            sent=_destinations(self._sent_evaluate),
            weight_cap=self.limits.weight_cap,
            names=self.wiring.names,
        )
        self.evaluate_report.accepted = [r.node_id for r in screened.valid]
        self.evaluate_report.rejected = screened.rejected
        return weighted_metrics(screened.valid) if screened.valid else None

    # --- checkpointing ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Strategy state for checkpoints: the norm bound's history of accepted norms; the regions' WAN
        residuals (topology=regions); the server optimizer's moments."""
        regions = self.regions.state_dict() if self.regions is not None else {}
        opt = {"server_optimizer": self.server_opt.state_dict()} if self.server_opt is not None else {}
        bound = {"norm_bound": self.norm_bound.state_dict()} if self.norm_bound is not None else {}
        return {"strategy": self.name, **({"regions": regions} if regions else {}), **opt, **bound}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("strategy") != self.name:
            raise ValueError(f"checkpoint holds {state.get('strategy')} state, not {self.name}")
        if self.regions is not None and "regions" in state:
            self.regions.load_state_dict(state["regions"])
        if self.server_opt is not None and "server_optimizer" in state:
            self.server_opt.load_state_dict(state["server_optimizer"], self.device)
        if self.norm_bound is not None and "norm_bound" in state:
            self.norm_bound.load_state_dict(state["norm_bound"])
