"""A virtual clock for simulated fleets: a Grid that hands replies back in simulated-time order.

Flower's simulation engine runs ClientApps on a few workers, so a slow node cannot be played by
sleeping: it would block a worker, and every aggregation rule would see the same throughput.
Instead (as FedScale and Plato do) each task gets a simulated duration and nothing sleeps:

    duration = latency + downlink bytes / downlink rate + work / speed + latency + uplink bytes / uplink rate

with the node's profile (app/simulation/fleet.py), the task's real serialised sizes, and its
work counted by the server (its partition's training examples x epochs; evaluation: its
validation examples). A task starts when it is sent or, if its node is still busy, when the
node's previous task ends.

The grid is a conservative discrete-event simulator. The ClientApps run for real, in parallel,
in whatever order Flower runs them; a reply is handed to the strategy only once no task still
out could finish earlier in simulated time: every task's finish is at least its start plus
latency, downlink and compute, known when it is sent. Replies are released one at a time, in
(finish, partition, send order) order, and the clock moves to each one's finish: a FedBuff
node is sent its next task at the simulated moment it became idle. The order, and so the
versions, staleness values and models, do not depend on the host or on how many simulation
workers there are.

Tasks are scheduled (start and earliest finish) the moment the strategy sends them, and pushed
to the SuperLink together when the strategy next waits for a reply: one round trip per batch,
not per task. The strategy sees the clock's own message ids.

A task whose node drops out (`fleet.completion_p`) or goes offline (`fleet.trace`) before its
predicted finish is never run: its error reply comes back at that moment. The prediction uses
the node's last reply's size for the upload (this task's download size before any reply).

Regions (`topology=regions`, `Regions`): a node's profile is its link to its region's aggregator;
the model first crosses the region's WAN link (latency + bytes / rate), then every member's task
starts; once a synchronous round's member replies are in, the region's update crosses the WAN
back (`finish_regions`, with the size the aggregator sent), and the round ends with the slowest
region. The aggregator's own compute is not charged (a sum of a few models, milliseconds).
"""

from __future__ import annotations

import copy
import heapq
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count

import numpy as np
from flwr.app import ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from app.config.schema import ConfigError
from app.simulation.fleet import NodeProfile, WanLink
from strategies.keys import PARTITION_ID
from strategies.node_text import printable
from strategies.replies import payload_bytes

log = logging.getLogger("flwr.fedgpu." + __name__)

FLEET_ERROR_CODE = 0  # flwr ErrorCode.UNKNOWN: the node is gone, as a real dropout looks to the server
Work = Callable[[int, str], float]  # (partition, message type) -> examples the task processes
NODES_TTL_S = 2.0  # how long the connected-node list is reused


@dataclass
class Task:
    node: int
    partition: int
    seq: int  # send order: the last tie-break
    start: float
    bound: float  # the earliest possible finish: start + latency + downlink + compute
    arrived: bool = False


@dataclass(frozen=True)
class Regions:
    """Two-level timing: the region of each partition and each region's WAN link."""

    region_of_partition: list[int]
    wan: list[WanLink]

    def lead_in(self, partition: int, down_bytes: int) -> float:
        """How long the model takes to reach `partition`'s aggregator over its region's WAN link."""
        link = self.wan[self.region_of_partition[partition]]
        return link.latency_s + down_bytes / link.downlink_bps


class WrappingGrid(Grid):
    """A Grid over another (`inner`), which keeps Flower's bookkeeping: the run, message creation."""

    inner: Grid

    def set_run(self, run) -> None:  # noqa: ANN001 - Flower's Run
        self.inner.set_run(run)

    @property
    def run(self):  # noqa: ANN201
        return self.inner.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: ANN001, ANN201
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)


class VirtualClockGrid(WrappingGrid):
    """`grid` with simulated time: `now`, replies in simulated-finish order, offline nodes hidden."""

    def __init__(
        self,
        grid: Grid,
        profiles: list[NodeProfile],
        partitions: dict[int, int],
        work: Work,
        seed: int,
        min_nodes: int = 1,
        regions: Regions | None = None,
    ) -> None:
        self.inner, self.profiles, self.partitions, self.work, self.seed = grid, profiles, partitions, work, seed
        self.regions = regions
        self.region_done: dict[int, float] = {}  # region -> when its aggregator had its last member reply
        self.min_nodes = min_nodes  # what the strategy needs online to send work
        self.now = 0.0
        self.busy_until: dict[int, float] = {}
        self.in_flight: dict[str, Task] = {}
        self._arrived: list[tuple[float, int, int, str, Message]] = []  # heap of (finish, partition, seq, id, reply)
        self._seq = count()
        self._tasks_per_partition: dict[int, int] = {}
        self._upload_bytes: dict[int, int] = {}  # node -> its last reply's size
        self._nodes: list[int] = []
        self._nodes_at: float | None = None
        self._unsent: list[tuple[str, Message]] = []  # (clock id, task) scheduled, not yet pushed
        self._clock_id: dict[str, str] = {}  # Flower's message id -> the clock's, for tasks out

    # --- Grid --------------------------------------------------------------------------
    def _known_nodes(self) -> list[int]:
        """The simulated nodes connected (Flower's grid asks its SuperLink: at most every
        NODES_TTL_S of real time, as FedBuff asks for every task it sends)."""
        now = time.monotonic()
        if self._nodes_at is None or now - self._nodes_at > NODES_TTL_S:
            self._nodes = [n for n in self.inner.get_node_ids() if n in self.partitions]
            self._nodes_at = now
        return self._nodes

    def get_node_ids(self) -> list[int]:
        """The simulated nodes online now, in partition order. Fewer than `min_nodes` with nothing
        in flight: a caller would wait for nodes, so the clock jumps to when enough are back."""
        known = self._known_nodes()
        while True:
            online = [n for n in known if self._profile(n).online_at(self.now)]
            if len(online) >= self.min_nodes or self.in_flight or self._arrived:
                return sorted(online, key=self.partitions.__getitem__)
            back = [self._profile(n).back_online(self.now) for n in known if n not in online]
            if not back:  # never enough: the caller's own wait reports it
                return sorted(online, key=self.partitions.__getitem__)
            self.now = min(back)
            log.info("virtual clock: %d node(s) online, waiting for more: t=%.1f s", len(online), self.now)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Schedule each task now, in simulated time; send them to the nodes in one batch when the
        caller next waits for a reply (`pull_messages`): FedBuff sends one task per released
        reply, and a push per task would cost a round trip to the SuperLink each. The ids are the
        clock's own; replies come back under them."""
        ids = []
        for msg in messages:
            task, failure = self._schedule(msg)
            mid = f"clock-{task.seq}"
            msg.metadata.__dict__["_message_id"] = mid  # as the caller will see its reply's reply_to
            self.in_flight[mid] = task
            ids.append(mid)
            if failure is None:
                self._unsent.append((mid, msg))
                continue
            at, reason = failure  # never sent: this error reply answers it at that moment
            reply = Message(Error(code=FLEET_ERROR_CODE, reason=reason), reply_to=msg)
            task.arrived = True
            heapq.heappush(self._arrived, (at, task.partition, task.seq, mid, reply))
            self.busy_until[task.node] = at
        return ids

    def _flush(self) -> None:
        """Send the tasks scheduled since the last flush, in one push. Each goes as a copy that
        Flower's grid gives its own id: the caller's message keeps the clock's."""
        if not self._unsent:
            return
        unsent, self._unsent = self._unsent, []
        copies = []
        for _, msg in unsent:
            sent = copy.copy(msg)
            sent.__dict__["_metadata"] = copy.copy(msg.metadata)
            copies.append(sent)
        for (mid, msg), real in zip(unsent, self.inner.push_messages(copies), strict=True):
            if not real:
                raise RuntimeError(f"Flower did not accept the task for node {msg.metadata.dst_node_id}")
            self._clock_id[real] = mid

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """At most one reply: the earliest in simulated time, once no task out can finish before it."""
        wanted = set(message_ids)
        released = self._next(wanted)
        if released is None:  # nothing can go yet: take what the ClientApps have sent back since
            self._collect()
            released = self._next(wanted)
        return [released] if released is not None else []

    def _next(self, wanted: set[str]) -> Message | None:
        """The earliest reply come back, released, if no task of `wanted` still out could finish
        before it."""
        while self._arrived and self._arrived[0][3] not in wanted:  # given up by the caller
            _, _, _, mid, _ = heapq.heappop(self._arrived)
            self.in_flight.pop(mid, None)
        if not self._arrived:
            return None
        finish, partition, seq, mid, reply = self._arrived[0]
        waiting_on = [(t.bound, t.partition, t.seq) for m, t in self.in_flight.items() if not t.arrived and m in wanted]
        if waiting_on and min(waiting_on) < (finish, partition, seq):
            return None
        heapq.heappop(self._arrived)
        self._release(mid, finish)
        return reply

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """A synchronous round: every reply that finishes within `timeout` simulated seconds of the
        round's start, in finish order. The clock then stands at the slowest of them, or at the
        timeout when some node missed it (that node stays busy until its task ends)."""
        start = self.now
        ids = set(self.push_messages(messages))
        while any(not self.in_flight[m].arrived for m in ids):
            self._collect()
            if any(not self.in_flight[m].arrived for m in ids):
                time.sleep(0.02)
        deadline = start + timeout if timeout else math.inf
        mine = sorted(e for e in self._arrived if e[3] in ids)
        self._arrived = [e for e in self._arrived if e[3] not in ids]
        heapq.heapify(self._arrived)
        replies = []
        self.region_done = {}
        for finish, partition, _, mid, reply in mine:
            region = self.regions.region_of_partition[partition] if self.regions is not None else 0
            if finish <= deadline:
                self._release(mid, finish)
                replies.append(reply)
                self.region_done[region] = max(self.region_done.get(region, start), finish)
            else:
                node = self.in_flight.pop(mid).node
                self.busy_until[node] = finish
                self.region_done[region] = deadline  # its aggregator waited for it until the timeout
                log.info("virtual clock: node %s finishes at t=%.1f s, after the round's timeout", node, finish)
        if len(replies) < len(mine):
            self.now = max(self.now, deadline)
        return replies

    def inject(self, reply: Message, node: int, at: float) -> str:
        """An event of the caller's own, e.g. a region's update (FedBuff over regions: its
        aggregator heard its last member at `now`; the update crosses the WAN until `at`): released by
        `pull_messages` (its id wanted) in simulated-time order with every member reply. Its id."""
        seq = next(self._seq)
        mid = f"clock-{seq}"
        self.in_flight[mid] = Task(node, -1, seq, self.now, at, arrived=True)
        heapq.heappush(self._arrived, (at, -1, seq, mid, reply))
        return mid

    def wan_up(self, region: int, nbytes: int) -> float:
        """How long `nbytes` take up `region`'s WAN link (0 without one)."""
        if self.regions is None:
            return 0.0
        link = self.regions.wan[region]
        return link.latency_s + nbytes / link.uplink_bps

    @contextmanager
    def side_by_side(self) -> Iterator[Callable[[], None]]:
        """Groups of exchanges that run at the same time (SecAgg+ inside regions: each region's
        stages): call the yielded `branch()` before each group, which then starts at the clock's
        time on entry; on exit the clock stands at the latest group's end, with every group's
        regions' last replies kept for `finish_regions`. The groups' nodes are disjoint."""
        start, ends, done = self.now, [self.now], {}

        def branch() -> None:
            ends.append(self.now)
            done.update(self.region_done)
            self.now, self.region_done = start, {}

        yield branch
        branch()
        self.now, self.region_done = max(ends), done

    def finish_regions(self, bytes_up: dict[int, int]) -> None:
        """Regions: each region that took part in the last round sends its update (`bytes_up[r]`
        bytes; 0 or missing: latency only) over its WAN link; the round ends with the last one."""
        if self.regions is None:
            return
        for region, done in self.region_done.items():
            self.now = max(self.now, done + self.wan_up(region, bytes_up.get(region, 0)))
        self.region_done = {}

    # --- the clock ---------------------------------------------------------------------
    def _profile(self, node: int) -> NodeProfile:
        return self.profiles[self.partitions[node]]

    def _schedule(self, msg: Message) -> tuple[Task, tuple[float, str] | None]:
        """The task's start and earliest finish, and (when, why) if its node will not finish it."""
        node = msg.metadata.dst_node_id
        partition = self.partitions[node]
        p = self.profiles[partition]
        down = payload_bytes(msg.content) if msg.has_content() else 0
        # The model crosses the region's WAN link first; a task without arrays (a SecAgg+ key, share
        # or unmask stage inside a region) runs between the sites and their aggregator only.
        crosses = self.regions is not None and msg.has_content() and len(msg.content.array_records) > 0
        lead_in = self.regions.lead_in(partition, down) if crosses else 0.0
        start = max(self.now + lead_in, self.busy_until.get(node, 0.0))
        compute = self.work(partition, msg.metadata.message_type) / p.samples_per_s
        bound = start + p.latency_s + down / p.downlink_bps + compute
        predicted = bound + p.latency_s + self._upload_bytes.get(node, down) / p.uplink_bps
        task = Task(node, partition, next(self._seq), start, bound)
        self.busy_until[node] = predicted
        n = self._tasks_per_partition.get(partition, 0)
        self._tasks_per_partition[partition] = n + 1
        failures = []
        if not p.online_at(start):
            failures.append((start, f"node offline at t={start:.1f} s (fleet.trace)"))
        if (left := p.leaves_during(start, predicted)) is not None:
            failures.append((left, f"node went offline at t={left:.1f} s, mid-task (fleet.trace)"))
        if p.completion_p < 1:
            rng = np.random.default_rng([self.seed, 0xF1EE7, partition, n])
            if rng.random() >= p.completion_p:
                at = start + float(rng.random()) * (predicted - start)
                failures.append((at, f"node dropped out at t={at:.1f} s, mid-task (fleet.completion_p)"))
        return task, min(failures) if failures else None

    def _collect(self) -> None:
        """Send what is scheduled, then take the replies that have come back from the ClientApps,
        each at its simulated finish, under the clock's id."""
        self._flush()
        if not self._clock_id:
            return
        for reply in self.inner.pull_messages(list(self._clock_id)):
            mid = self._clock_id.pop(reply.metadata.reply_to_message_id)
            reply.metadata.__dict__["_reply_to_message_id"] = mid
            task = self.in_flight[mid]
            task.arrived = True
            finish = task.bound
            if reply.has_content():
                size = payload_bytes(reply.content)
                self._upload_bytes[task.node] = size
                finish += self._profile(task.node).latency_s + size / self._profile(task.node).uplink_bps
            heapq.heappush(self._arrived, (finish, task.partition, task.seq, mid, reply))

    def _release(self, mid: str, finish: float) -> None:
        task = self.in_flight.pop(mid)
        self.now = max(self.now, finish)
        self.busy_until[task.node] = finish


def discover_partitions(grid: Grid, nodes: list[int], timeout_s: float) -> dict[int, int]:
    """node id -> the partition it simulates, asked of every node (a QUERY message, answered by
    the ClientApp from its node config). A node without one is a deployed node: fleet profiles
    are for simulation only, and the run stops here, before any training."""
    queries = [
        Message(RecordDict({"config": ConfigRecord({"fleet": True})}), n, MessageType.QUERY, ttl=timeout_s)
        for n in nodes
    ]
    ids = list(grid.push_messages(queries))
    node_of = dict(zip(ids, nodes, strict=True))
    found: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < len(nodes) and time.monotonic() < deadline:
        for reply in grid.pull_messages([m for m in ids if node_of[m] not in found]):
            node = node_of[reply.metadata.reply_to_message_id]
            records = [] if reply.has_error() else list(reply.content.metric_records.values())
            metrics = records[0] if records else MetricRecord()
            if PARTITION_ID not in metrics:
                why = (
                    printable(reply.error.reason) if reply.has_error() else "it has no partition-id in its node config"
                )
                raise ConfigError(
                    f"fleet: node {node} is not a simulated node ({why}); fleet profiles and stragglers "
                    "simulate nodes under `flwr run` simulation: a deployment runs in real time (fleet=none "
                    "stragglers=none)"
                )
            found[node] = int(metrics[PARTITION_ID])
        if len(found) < len(nodes):
            time.sleep(0.02)
    if len(found) < len(nodes):
        raise RuntimeError(f"fleet: {len(nodes) - len(found)} node(s) did not say their partition in {timeout_s:.0f} s")
    return found
