"""FedBuff: staleness-bounded buffered asynchronous aggregation.

Nguyen et al. 2022, "Federated Learning with Buffered Asynchronous Aggregation",
https://arxiv.org/abs/2106.06639. Up to `concurrency` nodes train at once, each on the
model version it was sent. A reply's update Δ = model − that version is weighted by
s(τ)·num-examples, τ being how many versions the global model moved on meanwhile,
and buffered; updates older than `max_staleness` versions are discarded and counted.
With K updates buffered the server steps: global ← global + η·v, v ← β·v + Σwᵢ Δᵢ / Σwᵢ
(β = 0: plain FedBuff), and idle nodes get the new version at once. Nobody waits for
the slowest node.

Optionally the buffer goes through a Byzantine-robust rule (Krum, Multi-Krum,
median, trimmed mean) instead of the weighted mean: the rules work on updates
against each one's own base version (`ValidReply.base`), so the staleness bound and
the robust rule hold together.

With `federation.aggregation` streaming (`streamed`), the weighted mean is folded as updates
enter the buffer (`streaming.UpdateFold`): a buffered update keeps only its weight and metrics,
whatever K (docs/strategies.md#server-memory).

Flower's `Strategy.start` is a synchronous round loop; `run` is the asynchronous one,
built on `grid.push_messages` / `grid.pull_messages`, with at most one message in
flight per node. Error replies (a ClientApp crash, an expired TTL, a node the
SuperLink reports unavailable) and replies that never come (a local deadline of TTL +
grace) free the node and lose nothing but that one task; nodes that join later are
given work on the next pass.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from strategies.fedavg import RoundReport, task_content
from strategies.keys import NUM_EXAMPLES, SERVER_ROUND, TASK
from strategies.liveness import Stalled, stall_reason, tally
from strategies.node_names import label
from strategies.node_wait import TooFewNodes
from strategies.norm_bound import NormBound
from strategies.replies import (
    ArraySpec,
    InvalidReply,
    Rejection,
    Screened,
    ValidReply,
    arrays_digest,
    error_text,
    payload_bytes,
    screen_reply,
    specs_of,
    warn_rejected,
    weighted_metrics,
)
from strategies.robust import RobustRule
from strategies.robust_ops import apply_update, update_dtype, weighted_update_mean
from strategies.server_opt import Moments, ServerOptimizer
from strategies.settings import ReplyLimits, Sampling, TaskWiring
from strategies.staleness import StalenessFn
from strategies.streaming import UpdateFold
from strategies.tensor_ops import NON_FINITE_STEP, Part, TensorDict, finite_step, record_to_tensors, tensors_to_record

log = logging.getLogger("flwr.fedgpu." + __name__)


@dataclass
class InFlight:
    """One training task out at a node."""

    node_id: int
    version: int
    deadline: float  # time.monotonic() after which the task is given up


@dataclass
class VersionReport:
    """What went into one server update (one metrics.jsonl row), and what did not."""

    version: int = 0
    applied: list[dict[str, Any]] = field(default_factory=list)  # node_id, staleness, num_examples, weight, scale
    discarded_stale: int = 0  # since the previous version
    rejected: list[Rejection] = field(default_factory=list)  # invalid replies since the previous version
    failed: list[Rejection] = field(default_factory=list)  # error replies and timeouts since the previous version
    robust: dict[str, Any] | None = None  # the robust buffer rule's picks
    metrics: MetricRecord | None = None  # clients' training metrics, weighted
    bytes_up: list[int] = field(default_factory=list)  # each reply's array bytes since the previous version
    bytes_down: list[int] = field(default_factory=list)  # each task's array bytes since the previous version
    stale_nodes: list[int] = field(default_factory=list)  # whose updates were discarded as too stale
    digests: dict[int, str] = field(default_factory=dict)  # node -> sha256 of its last reply's arrays
    clipped: list[dict[str, Any]] = field(default_factory=list)  # node_id, norm, bound: updates cut to the norm bound
    # Every successful reply's metrics since the previous version, whatever became of its update
    # (discarded stale, rejected, excluded by a robust rule): a local-DP client's ε is spent either way.
    client_metrics: list[tuple[int, MetricRecord]] = field(default_factory=list)


class _Momentum:
    """The server momentum as an item of `finite_step`: dropped, it is reset."""


MOMENTUM = _Momentum()


@dataclass
class BufferStep:
    """One buffer's combined update, how each update moved it, and what the rule made of it."""

    update: TensorDict
    parts: list[Part]  # (reply, model, base, scale) of each update in the step (`tensor_ops.Part`)
    rejected: list[Rejection] = field(default_factory=list)  # updates the rule found bad (NaN or Inf)
    robust: dict[str, Any] | None = None  # the robust rule's picks


def server_step(
    current: TensorDict, update: TensorDict, lr: float, momentum: float, velocity: TensorDict | None
) -> tuple[TensorDict, TensorDict | None]:
    """global + η·v with v = β·v + Δ (v = Δ when β = 0), for floating-point tensors.

    Integer tensors (BatchNorm counters) take the plain mean update, rounded: a
    learning rate or momentum on a counter means nothing.
    """
    floating = {k: current[k].is_floating_point() for k in update}  # updates are all float (update_dtype)
    if momentum > 0:
        velocity = {
            k: (momentum * velocity[k] + d if velocity is not None else d.clone()) if floating[k] else d
            for k, d in update.items()
        }
        update = velocity
    step = {k: d * lr if floating[k] and lr != 1.0 else d for k, d in update.items()}
    return apply_update(current, step), velocity


FEDBUFF_SERVER_LR = 0.5  # η when strategy.server_lr is 0 (auto)
AUTO_BUFFER = 0  # strategy.buffer_size=0: K from the nodes training at once (`auto_buffer_size`)
AUTO_BUFFER_MAX = 10  # Nguyen et al.'s K, for federations of 20 nodes and more


def auto_buffer_size(cohort: int, rule: RobustRule | None = None) -> int:
    """K for `cohort` nodes training at once: half of them, rounded up, at most 10 (FedBuff's K).

    Why: with K at or above the cohort a version waits for the slowest nodes like a synchronous
    round, so FedBuff loses its point (measured with 5 nodes on the default task and a lognormal
    fleet: K = 10 reached 90% in 15.4 simulated seconds, sync FedAvg in 10.3, K = 3 in 7.2); a
    tiny K steps on one or two noisy client models, and past 20 nodes the paper's K = 10 already
    leaves most nodes free (docs/strategies.md). A robust rule's minimum (e.g. Krum's 2f + 3)
    wins, even if a cohort that small cannot meet it: `node_count_problem` then refuses the run
    with the reason."""
    k = max(1, min(AUTO_BUFFER_MAX, -(-cohort // 2)))
    while rule is not None and rule.too_few(k) is not None and k < MAX_AUTO_BUFFER:
        k += 1
    return k


MAX_AUTO_BUFFER = 10_000  # ends the search for a rule's minimum (no rule here needs more than 2f + 3)


class FedBuff(Strategy):
    """FedBuff [Nguyen et al., 2022]: buffered asynchronous aggregation with a staleness
    bound (see the module docstring).

    Parameters
    ----------
    buffer_size : int (default: 0, AUTO_BUFFER)
        K, the updates buffered per server step; 0: `auto_buffer_size` of the nodes training at
        once, chosen by `size_buffer` before the first task.
    concurrency : int (default: 0)
        Nodes training at once; 0: every connected node.
    max_staleness : int (default: 10)
        Updates trained from a version older than this many versions are discarded.
    staleness : StalenessFn
        s(τ), the weight of an update τ versions stale (`strategies.staleness`).
    staleness_name : str (default: "polynomial")
        The name of `staleness`, for logs.
    server_lr : float (default: 0.5)
        η, the server's step size (> 0).
    server_momentum : float (default: 0.0)
        β, the server's momentum, in [0, 1); 0 is plain FedBuff.
    server_opt : ServerOptimizer | None (default: None)
        A server optimizer (strategies/server_opt.py) in place of the η, β step: the flush steps
        from the current model along the buffer's update (`server_lr`, `server_momentum` unused).
    buffer_rule : RobustRule | None (default: None)
        A Byzantine-robust rule aggregating the buffer in place of the weighted mean;
        each update is taken against its own base version, and a node's newer update
        replaces its older one in the buffer. K must satisfy the rule's `too_few`.
    sampling : Sampling
        Only the longest wait for nodes (`round_wait_timeout_s`: then the run stops) and
        the seed of the sampler that picks which idle nodes get tasks.
    limits : ReplyLimits
        Each training task's lifetime (one task may take this long), the weight cap and a
        compressed uplink's decoder, as in `FedAvg`.
    wiring : TaskWiring
        Frozen parameters, downlink, per-node task keys and node names, as in `FedAvg`.
    poll_interval_s : float (default: 0.02)
        Pause between polls for replies when none arrived.
    deadline_grace_s : float (default: 5.0)
        A task unanswered for message_ttl_s + this is given up locally.
    device : torch.device | str (default: "cpu")
        Where the buffer is aggregated.
    norm_bound : NormBound | None (default: None)
        `strategy.norm_bound` (strategies/norm_bound.py): each update is bounded against the median of
        the recently applied ones as it arrives, before it enters the buffer; None: no bound.
    stall_versions : int (default: 0)
        `federation.stall_rounds`: `run` stops with `Stalled` once this many versions' worth of
        replies (K each) came in since the last version without making one; 0: never.
    """

    def __init__(
        self,
        *,
        buffer_size: int = AUTO_BUFFER,
        concurrency: int = 0,
        max_staleness: int = 10,
        staleness: StalenessFn,
        staleness_name: str = "polynomial",
        server_lr: float = FEDBUFF_SERVER_LR,
        server_momentum: float = 0.0,
        buffer_rule: RobustRule | None = None,
        sampling: Sampling | None = None,
        limits: ReplyLimits | None = None,
        wiring: TaskWiring | None = None,
        poll_interval_s: float = 0.02,
        deadline_grace_s: float = 5.0,
        device: torch.device | str = "cpu",
        server_opt: ServerOptimizer | None = None,
        norm_bound: NormBound | None = None,
        stall_versions: int = 0,
    ) -> None:
        if buffer_size < 0:
            raise ValueError(f"buffer_size={buffer_size} must be >= 1, or 0 (AUTO_BUFFER: from the nodes at the start)")
        if concurrency < 0 or max_staleness < 0 or server_lr <= 0 or not 0 <= server_momentum < 1:
            raise ValueError(
                f"need concurrency >= 0, max_staleness >= 0, server_lr > 0 and 0 <= server_momentum < 1 "
                f"(got {concurrency}, {max_staleness}, {server_lr}, {server_momentum})"
            )
        if buffer_size and buffer_rule is not None and (problem := buffer_rule.too_few(buffer_size)) is not None:
            raise ValueError(f"a buffer of {buffer_size} updates is too small: {problem}")
        self.buffer_size = buffer_size
        self.auto_buffer = buffer_size == AUTO_BUFFER  # K chosen by `size_buffer` once the nodes are known
        self.concurrency = concurrency
        self.max_staleness = max_staleness
        self.staleness = staleness
        self.staleness_name = staleness_name
        self.server_lr = server_lr
        self.server_momentum = 0.0 if server_opt is not None else server_momentum
        self.server_opt = server_opt
        self.buffer_rule = buffer_rule
        self.norm_bound = norm_bound
        self.stall_versions = stall_versions
        self.sampling = sampling or Sampling()
        self.limits = limits or ReplyLimits(message_ttl_s=600.0)
        self.wiring = wiring or TaskWiring()
        self.poll_interval_s = poll_interval_s
        # Past a message's TTL the SuperLink answers with an error; the local deadline
        # (TTL + grace) is the backstop for a reply that never comes.
        self.deadline_grace_s = deadline_grace_s
        self.device = torch.device(device)
        self.sampler = random.Random(self.sampling.seed)  # which idle nodes get tasks (as FedAvg's)
        self.version = 0
        self.tasks_sent = 0
        self.discarded_total = 0
        self.velocity: TensorDict | None = None
        self._proposed: Moments = ({}, {})  # the server optimizer's moments of the step being tried
        self.buffer: list[ValidReply] = []
        # The last version's buffer and the model it stepped from, for contribution scores.
        self.last_buffer: list[ValidReply] = []
        self.last_base: TensorDict = {}
        self.in_flight: dict[str, InFlight] = {}  # message id -> task
        self.report = VersionReport()
        self._specs: dict[str, ArraySpec] = {}
        self._arrays = ArrayRecord()
        self._models: dict[int, TensorDict] = {}  # version -> global model, while some task or update needs it
        # federation.aggregation chose streaming (app/run/memory.py): each accepted update is folded into
        # `_fold` as it enters the buffer, which then keeps only its weight and metrics.
        self.streamed = False
        self._fold: UpdateFold | None = None

    # How the server's run drives this strategy (app/run/federation.py): `run`, one callback per version.
    name = "FedBuff"
    asynchronous = True
    unit = "version"

    # Why a buffer may take at most one update per node (None: no such limit); see node_count_problem.
    one_update_per_node: str | None = None

    def size_buffer(self, num_nodes: int) -> int:
        """K for `num_nodes` connected nodes: the configured one, or (auto) `auto_buffer_size` of
        the nodes training at once, chosen once; a resumed run keeps the K it checkpointed."""
        if self.buffer_size == AUTO_BUFFER:
            cohort = min(num_nodes, self.concurrency or num_nodes)
            self.buffer_size = auto_buffer_size(cohort, self.buffer_rule)
            log.info(
                "FedBuff: buffer K=%d chosen for %d nodes training at once (strategy.buffer_size=0: half of "
                "them, rounded up, at most %d%s)",
                self.buffer_size,
                cohort,
                AUTO_BUFFER_MAX,
                f", at least {self.buffer_rule.name}'s minimum" if self.buffer_rule is not None else "",
            )
        elif self.buffer_size >= (cohort := min(num_nodes, self.concurrency or num_nodes)) and cohort:
            log.warning(
                "FedBuff: strategy.buffer_size=%d >= the %d nodes training at once: each version waits for "
                "the slowest of them, like a synchronous round; strategy.buffer_size=0 would choose %d",
                self.buffer_size,
                cohort,
                auto_buffer_size(cohort, self.buffer_rule),
            )
        return self.buffer_size

    def node_count_problem(self, num_nodes: int) -> str | None:
        """Checked before the start: a buffer that takes one update per node needs K nodes training at once."""
        kind = "robust" if self.buffer_rule is not None else self.one_update_per_node
        cohort = min(num_nodes, self.concurrency or num_nodes)
        if kind is None or cohort >= self.buffer_size:
            return None
        return (
            f"strategy.buffer_size={self.buffer_size}: a {kind} buffer takes one update per node, but only "
            f"{cohort} nodes train at once ({num_nodes} nodes, strategy.concurrency={self.concurrency})"
        )

    @property
    def streams(self) -> bool:
        """The weighted mean folds; a robust rule compares the K updates, so it holds them."""
        return self.buffer_rule is None

    def held_replies(self, num_nodes: int, streamed: bool) -> int:
        """The buffer: K replies, each with its own base; none when the mean is streamed (`UpdateFold`)."""
        return 0 if streamed and self.streams else self.buffer_size

    def run_summary(self) -> dict[str, Any]:
        """Strategy-specific entries of summary.json."""
        return {
            "fedbuff": {
                "versions": self.version,
                "tasks_sent": self.tasks_sent,
                "discarded_stale": self.discarded_total,
            }
        }

    def summary(self) -> None:
        log.info(
            "FedBuff: buffer K=%d, concurrency %s, max staleness %d, staleness weight %s, server lr %g, "
            "momentum %g, buffer aggregated by %s, message TTL %.0f s, aggregating on %s",
            self.buffer_size,
            self.concurrency or "all nodes",
            self.max_staleness,
            self.staleness_name,
            self.server_lr,
            self.server_momentum,
            self.buffer_rule.name if self.buffer_rule else "weighted mean",
            self.limits.message_ttl_s,
            self.device,
        )
        if self.norm_bound is not None:
            log.info("FedBuff: %s", self.norm_bound.describe())

    def check_nodes(self, grid: Grid, stalled_s: float) -> None:
        """No server update for longer than `round_wait_timeout_s`: TooFewNodes if the connected
        nodes can no longer make one (none at all, or too few for a buffer of distinct nodes)."""
        connected = len(list(grid.get_node_ids()))
        problem = "no node connected" if not connected else self.node_count_problem(connected)
        if problem is not None:
            raise TooFewNodes(
                f"FedBuff: no server update for {stalled_s:.0f} s (federation.round_wait_timeout_s="
                f"{self.sampling.round_wait_timeout_s:g}) and {problem}. The last version is checkpointed: restart the "
                "missing SuperNodes and run the same command with name=... resume=auto"
            )

    # --- state -----------------------------------------------------------------
    def set_model(self, arrays: ArrayRecord, version: int) -> None:
        """Start from `arrays` as version `version` (0, or a checkpoint's)."""
        self._arrays, self.version = arrays, version
        self._specs = specs_of(arrays)
        self._models[version] = record_to_tensors(arrays)

    @property
    def arrays(self) -> ArrayRecord:
        return self._arrays

    def _prune_models(self) -> None:
        """Keep only the versions an in-flight task or a buffered update can still use."""
        needed = {self.version} | {t.version for t in self.in_flight.values()}
        needed = {v for v in needed if self.version - v <= self.max_staleness}
        for version in list(self._models):
            if version not in needed:
                del self._models[version]

    # --- sending -----------------------------------------------------------------
    def held_nodes(self) -> set[int]:
        """Idle nodes not to task now (none here; DPFedBuff holds those with a buffered update)."""
        return set()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Messages for idle connected nodes, up to `concurrency` tasks in flight.

        Each message carries the current version (`server-round`) and a task number
        (`task`), so a node that trains twice on one version still draws new batches.
        """
        busy = {t.node_id for t in self.in_flight.values()} | self.held_nodes()
        connected = list(grid.get_node_ids())
        idle = [n for n in connected if n not in busy]
        limit = self.concurrency or len(idle) + len(busy)
        free = min(len(idle), limit - len(self.in_flight))
        messages = []
        for node in self.sampler.sample(idle, free) if free > 0 else []:
            self.tasks_sent += 1
            extra = self.wiring.node_config(node, connected) if self.wiring.node_config is not None else {}
            sent = arrays
            if self.wiring.downlink is not None:
                sent, entries = self.wiring.downlink.task(node, self._models[self.version], arrays)
                extra = {**extra, **entries}
            cfg = ConfigRecord({**config, SERVER_ROUND: server_round, TASK: self.tasks_sent, **extra})
            content = task_content(sent, cfg, self.wiring.frozen)
            messages.append(
                Message(content, node, MessageType.TRAIN, ttl=self.limits.message_ttl_s, group_id=str(server_round))
            )
        return messages

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """None: FedBuff evaluates the global model centrally (federated evaluation is a
        synchronous round, the thing this strategy avoids)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def _push(self, grid: Grid, config: ConfigRecord) -> None:
        messages = list(self.configure_train(self.version, self._arrays, config, grid))
        if not messages:
            return
        deadline = time.monotonic() + self.limits.message_ttl_s + self.deadline_grace_s
        for msg, mid in zip(messages, grid.push_messages(messages), strict=True):
            self.in_flight[mid] = InFlight(msg.metadata.dst_node_id, self.version, deadline)
            self.report.bytes_down.append(payload_bytes(msg.content))

    # --- receiving -----------------------------------------------------------------
    def receive(self, reply: Message) -> None:
        """Take one reply: free its node, then discard, reject or buffer the update."""
        task = self.in_flight.pop(reply.metadata.reply_to_message_id, None)
        if task is None:  # not ours, or given up already
            return
        node = task.node_id
        if self.wiring.downlink is not None:
            self.wiring.downlink.settle(node, not reply.has_error())
        if reply.has_error():
            self.report.failed.append(Rejection(node, error_text(reply.error)))
            log.warning("%s: training task failed: %s", label(node, self.wiring.names), error_text(reply.error))
            return
        self.report.client_metrics += [(node, m) for m in reply.content.metric_records.values()]
        self.report.bytes_up.append(payload_bytes(reply.content))
        if len(reply.content.array_records) == 1:  # else screening rejects it below
            self.report.digests[node] = arrays_digest(next(iter(reply.content.array_records.values())))
        tau = self.version - task.version
        if tau > self.max_staleness or task.version not in self._models:
            self.report.discarded_stale += 1
            self.report.stale_nodes.append(node)
            self.discarded_total += 1
            log.info(
                "%s: update from version %d is %d versions stale (> %d): discarded",
                label(node, self.wiring.names),
                task.version,
                tau,
                self.max_staleness,
            )
            return
        base = self._models[task.version]
        try:
            valid = screen_reply(
                reply,
                self._specs,
                node=node,
                weight_cap=self.limits.weight_cap,
                unpack=self.limits.unpack,
                check=self.limits.check,
                base=base,
                names=self.wiring.names,
            )
        except InvalidReply as err:
            self.report.rejected.append(Rejection(node, str(err)))
            warn_rejected(node, str(err), self.wiring.names)
            return
        valid.node_id, valid.staleness, valid.base = node, tau, base
        if self.norm_bound is not None and (
            why := self.norm_bound.admit(valid, base, self.report.clipped, self.wiring.names)
        ):
            self.report.rejected.append(Rejection(node, why))
            warn_rejected(node, why, self.wiring.names)
            return
        valid.scale = self.staleness(tau)
        valid.weight *= valid.scale  # the capped count times s(τ)
        if self.buffer_rule is not None:
            # A robust rule counts Byzantine *nodes*: one fast attacker must not fill the
            # buffer, so a node's newer update replaces its older one.
            self.buffer = [r for r in self.buffer if r.node_id != node]
        if self.streamed:
            if self._fold is None:
                self._fold = UpdateFold(self._models[self.version], self.device)
            self._fold.add(valid.arrays, base, valid.weight)
            valid.arrays, valid.base = {}, None  # folded: only its weight and metrics stay for the report
        self.buffer.append(valid)

    def settle(self, replies: Iterable[Message]) -> None:
        """Replies pulled when the run stops: their nodes are freed and their metrics kept in
        `report.client_metrics` (a local-DP client's ε is spent); their updates go unused."""
        for reply in replies:
            task = self.in_flight.pop(reply.metadata.reply_to_message_id, None)
            if task is not None and not reply.has_error():
                self.report.client_metrics += [(task.node_id, m) for m in reply.content.metric_records.values()]

    def expire(self, now: float) -> None:
        """Give up tasks past their deadline: the node is free again, the task lost."""
        for mid, task in list(self.in_flight.items()):
            if now > task.deadline:
                del self.in_flight[mid]
                if self.wiring.downlink is not None:
                    self.wiring.downlink.settle(task.node_id, False)
                self.report.failed.append(Rejection(task.node_id, "no reply before the message TTL"))
                log.warning(
                    "%s: no reply within %.0f s; task given up",
                    label(task.node_id, self.wiring.names),
                    self.limits.message_ttl_s,
                )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Take replies in order; each time K updates are buffered, step the global model.

        Returns the newest model (None when no step happened) and the clients'
        metrics of the last step. Replies after a step count their staleness against
        the new version.
        """
        new = None
        for reply in replies:
            self.receive(reply)
            if len(self.buffer) >= self.buffer_size and (stepped := self.flush()) is not None:
                new = stepped
        return new, (self.report.metrics if new is not None else None)

    def _aggregate_buffer(self, current: TensorDict, buffer: list[ValidReply]) -> BufferStep:
        """The combined update of `buffer`: weighted mean, or the robust rule's."""
        lr = self.server_lr
        if self._fold is not None:  # streamed: the replies are gone, so no per-reply parts (finite_step)
            return BufferStep(self._fold.mean(), [])
        if self.buffer_rule is None:
            total = float(sum(r.weight for r in buffer))
            update = weighted_update_mean(
                [r.arrays for r in buffer], [r.base for r in buffer], [r.weight for r in buffer], self.device
            )
            return BufferStep(update, [(r, r.arrays, r.base, lr * r.weight / total) for r in buffer])
        screened = Screened(valid=list(buffer), names=self.wiring.names)
        proposed, outcome = self.buffer_rule.aggregate(self.version + 1, current, screened, [r.base for r in buffer])
        picks = RoundReport(
            accepted=[r.node_id for r in screened.valid if r.node_id not in outcome.excluded],
            # Replies the rule itself found bad (NaN or Inf) are left out too.
            excluded=outcome.excluded + [r.node_id for r in screened.rejected],
            scores=outcome.scores,
            policy=outcome.policy,
        )
        used = [r for r in screened.valid if r.node_id not in outcome.excluded]
        parts: list[Part] = [(r, r.arrays, r.base, lr / max(len(used), 1)) for r in used]
        if proposed is None:  # the rule's too-few policy said skip: the model stays
            zero = {k: torch.zeros(t.shape, dtype=update_dtype(t), device=self.device) for k, t in current.items()}
            return BufferStep(zero, [], screened.rejected, picks.robust_row())
        update = {
            k: proposed[k].to(self.device, update_dtype(t)) - t.to(self.device, update_dtype(t))
            for k, t in current.items()
        }
        return BufferStep(update, parts, screened.rejected, picks.robust_row())

    def _step(
        self, current: TensorDict, kept: list[ValidReply | _Momentum]
    ) -> tuple[TensorDict | None, list[Part], tuple[BufferStep, TensorDict | None] | None]:
        """One server step from the updates in `kept` (with the server momentum when `MOMENTUM` is
        there): the new model, how each item moved it, and what `flush` keeps of it."""
        buffer = [r for r in kept if isinstance(r, ValidReply)]
        if not buffer:
            return None, [], None
        velocity = self.velocity if any(k is MOMENTUM for k in kept) else None
        outcome = self._aggregate_buffer(current, buffer)
        if self.server_opt is not None:  # its moments are kept once the step is (`flush`)
            new, self._proposed = self.server_opt.propose(
                current, apply_update(current, outcome.update), self.version + 1
            )
            return new, list(outcome.parts), (outcome, None)
        new, velocity_after = server_step(current, outcome.update, self.server_lr, self.server_momentum, velocity)
        parts = list(outcome.parts)
        if velocity is not None:
            parts.append((MOMENTUM, velocity, None, self.server_lr * self.server_momentum))
        return new, parts, (outcome, velocity_after)

    def flush(self) -> ArrayRecord | None:
        """Apply the buffer: one server update, version + 1.

        The step is checked (`finite_step`): updates that would make the model non-finite are
        rejected (named in the log and the version's report) and the step is made without them;
        momentum that would carry the model there is reset. None when no update is left: the model
        and the version stay, the buffer is emptied.
        """
        current = self._models[self.version]
        last: list[tuple[BufferStep, TensorDict | None]] = []

        def step(kept: list[ValidReply | _Momentum]) -> tuple[TensorDict | None, list[Part]]:
            new, parts, kept_state = self._step(current, kept)
            last[:] = [kept_state] if kept_state is not None else []
            return new, parts

        momentum: list[_Momentum] = [MOMENTUM] if self.velocity is not None else []
        new, dropped = finite_step([*self.buffer, *momentum], step)
        report = self.report
        for item, reason in dropped:
            if item is MOMENTUM:
                log.warning("version %d: server momentum would carry the model to NaN or Inf: reset", self.version + 1)
                self.velocity = None
                continue
            report.rejected.append(Rejection(item.node_id, reason))
            warn_rejected(item.node_id, reason, self.wiring.names)
        gone = {id(item) for item, _ in dropped}
        buffer = [r for r in self.buffer if id(r) not in gone]
        self._fold = None
        if new is None:
            log.warning("version %d: %s; keeping the global model", self.version + 1, NON_FINITE_STEP)
            self.buffer = []
            if self.norm_bound is not None:
                self.norm_bound.commit([])
            return None
        outcome, self.velocity = last[0]
        if self.server_opt is not None:
            self.server_opt.commit(self._proposed)
        report.rejected += outcome.rejected
        report.robust = outcome.robust
        excluded = set(report.robust["excluded"]) if report.robust else set()
        excluded |= {r.node_id for r in outcome.rejected}  # the updates the rule or the release left out
        report.applied = [
            {
                "node_id": r.node_id,
                "staleness": r.staleness,
                "num_examples": r.metrics[NUM_EXAMPLES],
                "weight": r.weight,
                "scale": r.scale,  # s(τ): the weight of rules that ignore counts (the ledger's, under them)
            }
            for r in buffer
            if r.node_id not in excluded
        ]
        used = [r for r in buffer if r.node_id not in excluded]
        report.metrics = weighted_metrics(used)
        if self.norm_bound is not None:
            self.norm_bound.commit(used)
        self.version += 1
        report.version = self.version
        self._arrays = tensors_to_record(new, consume=True)
        self._models[self.version] = record_to_tensors(self._arrays)
        self.last_buffer, self.last_base, self.buffer = buffer, current, []
        self._prune_models()
        return self._arrays

    # --- the asynchronous loop -------------------------------------------------------
    def run(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        config: ConfigRecord,
        on_version: Callable[[VersionReport, ArrayRecord], bool],
        *,
        first_version: int = 0,
        deadline: float | None = None,
        drain: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> ArrayRecord:
        """Keep nodes busy and step the model until `on_version` returns True (stop) or
        `clock()` (monotonic time, or a simulation's virtual clock) passes `deadline`. Returns
        the last global model.

        `drain=True` then waits for the tasks still out (each until its deadline) and keeps
        their metrics in `report.client_metrics`: a local-DP node spends ε on a task whether
        or not its update is used, and that spending must reach the server's record.

        `Stalled` (after the drain) once `stall_versions` versions' worth of replies made no version."""
        self.set_model(arrays, first_version)
        next_wait_log = 0.0
        stalled: str | None = None
        progress = time.monotonic()  # the last server update (or the start)
        while deadline is None or clock() < deadline:
            self._push(grid, config)
            replies = list(grid.pull_messages(list(self.in_flight))) if self.in_flight else []
            self.expire(time.monotonic())
            if time.monotonic() - progress > self.sampling.round_wait_timeout_s:
                self.check_nodes(grid, time.monotonic() - progress)
            stop = False
            for i, reply in enumerate(replies):
                new, _ = self.aggregate_train(self.version, [reply])
                if new is not None:
                    progress = time.monotonic()
                    report, self.report = self.report, VersionReport()
                    if on_version(report, new):
                        stop = True
                        self.settle(replies[i + 1 :])
                        break
            if stop:
                break
            if (stalled := self.stall()) is not None:
                break
            if not replies:
                if not self.in_flight and time.monotonic() >= next_wait_log:
                    log.info("FedBuff: no node to train on; waiting for nodes to connect")
                    next_wait_log = time.monotonic() + 10.0
                time.sleep(self.poll_interval_s)
        else:
            log.info("FedBuff: wall-clock budget reached at version %d", self.version)
        if self.in_flight and drain:
            log.info("FedBuff: waiting for the %d task(s) still out to record what they spent", len(self.in_flight))
            while self.in_flight:
                self.settle(grid.pull_messages(list(self.in_flight)))
                self.expire(time.monotonic())
                if self.in_flight:
                    time.sleep(self.poll_interval_s)
        if self.in_flight:
            log.info("FedBuff: %d task(s) still out are abandoned (their TTL ends them)", len(self.in_flight))
        if stalled is not None:
            raise Stalled(stalled)
        return self._arrays

    def stall(self) -> str | None:
        """Why the run has stalled (`Stalled`'s message), once `stall_versions` versions' worth of
        replies (K each: rejected, failed or discarded stale) came in since the last version; else None."""
        r = self.report
        missed = len(r.rejected) + len(r.failed) + r.discarded_stale
        if not self.stall_versions or missed < self.stall_versions * max(self.buffer_size, 1):
            return None
        outcomes = tally([x.reason for x in r.rejected + r.failed], stale=r.discarded_stale)
        return stall_reason(self.stall_versions, "version", self.version, outcomes)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's entry point: `num_rounds` server updates (versions) within `timeout`
        seconds, with `evaluate_fn` after each one."""
        result = Result()

        def on_version(report: VersionReport, arrays: ArrayRecord) -> bool:
            if report.metrics is not None:
                result.train_metrics_clientapp[report.version] = report.metrics
            if evaluate_fn is not None and (metrics := evaluate_fn(report.version, arrays)) is not None:
                result.evaluate_metrics_serverapp[report.version] = metrics
            return report.version >= num_rounds

        result.arrays = self.run(
            grid, initial_arrays, train_config or ConfigRecord(), on_version, deadline=time.monotonic() + timeout
        )
        return result

    # --- checkpointing ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Version, counters, server momentum and the norm bound's history. Buffered updates and tasks
        in flight are not saved: after a resume the nodes are simply sent the current version."""
        # Velocity on the CPU, copied: checkpoints load with map_location="cpu", and later steps must not change it.
        velocity = (
            None if self.velocity is None else {k: v.detach().to("cpu", copy=True) for k, v in self.velocity.items()}
        )
        return {
            "strategy": "FedBuff",
            "version": self.version,
            "tasks_sent": self.tasks_sent,
            "discarded_total": self.discarded_total,
            "velocity": velocity,
            "buffer_size": self.buffer_size,
            **({"server_optimizer": self.server_opt.state_dict()} if self.server_opt is not None else {}),
            **({"norm_bound": self.norm_bound.state_dict()} if self.norm_bound is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("strategy") != "FedBuff":
            raise ValueError(f"checkpoint holds {state.get('strategy')} state, not FedBuff")
        self.version = int(state["version"])
        self.tasks_sent = int(state["tasks_sent"])
        self.discarded_total = int(state["discarded_total"])
        if self.auto_buffer and int(state.get("buffer_size", 0)) >= 1:  # K stays what the run started with
            self.buffer_size = int(state["buffer_size"])
        if self.server_opt is not None and "server_optimizer" in state:
            self.server_opt.load_state_dict(state["server_optimizer"], self.device)
        if self.norm_bound is not None and "norm_bound" in state:
            self.norm_bound.load_state_dict(state["norm_bound"])
        velocity = state["velocity"]
        if velocity is not None and not (
            isinstance(velocity, dict) and all(isinstance(v, torch.Tensor) for v in velocity.values())
        ):
            raise ValueError(f"checkpoint's FedBuff velocity must be None or a dict of tensors, not {type(velocity)}")
        # Back to the aggregation device (the checkpoint was loaded onto the CPU); dtype kept.
        self.velocity = None if velocity is None else {k: v.to(self.device, copy=True) for k, v in velocity.items()}
