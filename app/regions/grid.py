"""FedBuff over regions (`topology=regions strategy=fedbuff`, simulation): a Grid on which every
region is one node, so the asynchronous strategy runs unchanged with regions as its units.

A task the strategy sends to a region goes to each of the region's connected sites (the same
content: its model and config); the region answers once every one of them has answered or
failed (its quorum is its whole membership; a site's task is bounded by its TTL, and on the
virtual clock a dropped-out site fails at its simulated moment). The sites' replies are screened
as the strategy screens any reply (weight caps, shapes, NaN), combined by the region's rule
(`RegionalCombine`, WAN codec included), and the region replies with that model and the sum of
its sites' capped weights. Staleness is the region's: its sites all trained from the version the
task carried. On a virtual clock the region's update is an event of the clock, released at the
moment its last site finished plus the WAN leg, so every region and site reply keeps simulated
order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import count

from flwr.app import Error, Message, RecordDict
from flwr.serverapp import Grid

from app.protocol import REGION_NODES
from app.simulation.virtual_clock import VirtualClockGrid, WrappingGrid
from strategies.fedavg import RoundReport
from strategies.keys import ARRAYS, CONFIG, METRICS, SERVER_ROUND
from strategies.node_names import NodeNames
from strategies.regional import RegionalCombine, region_node
from strategies.replies import Screened, payload_bytes, screen_replies, specs_of, weighted_metrics
from strategies.settings import ReplyLimits
from strategies.tensor_ops import TensorDict, record_to_tensors, tensors_to_record

log = logging.getLogger("flwr.fedgpu." + __name__)

REGION_ERROR_CODE = 0  # flwr ErrorCode.UNKNOWN: a region without a valid site reply, as a lost node looks


@dataclass
class RegionTask:
    """One task of the strategy to one region, while its sites work on it."""

    region: int
    message: Message  # the strategy's (its id is this grid's)
    pending: dict[str, int] = field(default_factory=dict)  # a site's task id -> the site
    sites: dict[str, int] = field(default_factory=dict)  # every site task id -> the site
    replies: list[Message] = field(default_factory=list)
    event: str | None = None  # the clock's id of the region's reply, once it is on its way


class RegionGrid(WrappingGrid):
    """`inner` (Flower's grid or the virtual clock) with regions as its nodes (module docstring)."""

    def __init__(
        self,
        inner: Grid,
        region_of: Callable[[int], int | None],
        combine: RegionalCombine,
        limits: ReplyLimits,
        names: NodeNames,
    ) -> None:
        self.inner, self.region_of, self.combine, self.limits, self.names = inner, region_of, combine, limits, names
        self.clock = inner if isinstance(inner, VirtualClockGrid) else None
        self.tasks: dict[str, RegionTask] = {}  # the strategy's task id -> the region's work on it
        self._site_task: dict[str, str] = {}  # a site's task id -> the strategy's task id
        self._ids = count()

    # --- Grid ----------------------------------------------------------------------
    def get_node_ids(self) -> list[int]:
        """A region for every region with a connected site (a region whose sites are all gone is
        no node)."""
        regions = {self.region_of(n) for n in self.inner.get_node_ids()} - {None}
        return [region_node(r) for r in sorted(regions)]  # type: ignore[type-var]

    def _sites(self, region: int) -> list[int]:
        return [n for n in self.inner.get_node_ids() if self.region_of(n) == region]

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Each region's task to each of its connected sites (one push for all of them)."""
        ids, copies, owners = [], [], []
        for msg in messages:
            region = -1 - msg.metadata.dst_node_id
            mid = f"region-{next(self._ids)}"
            msg.metadata.__dict__["_message_id"] = mid  # as the strategy will see its reply's reply_to
            self.tasks[mid] = RegionTask(region, msg)
            ids.append(mid)
            for site in self._sites(region):
                meta = msg.metadata
                copies.append(Message(msg.content, site, meta.message_type, ttl=meta.ttl, group_id=meta.group_id))
                owners.append((mid, site))
        for (mid, site), sid in zip(owners, self.inner.push_messages(copies), strict=True):
            self.tasks[mid].pending[sid] = self.tasks[mid].sites[sid] = site
            self._site_task[sid] = mid
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """The regions' replies that are ready: every site of the region has answered (on a virtual
        clock, once the update's WAN leg is over too, in simulated order)."""
        wanted = [t for m in message_ids if (t := self.tasks.get(m)) is not None]
        for mid in [m for m in self.tasks if self.tasks[m] not in wanted]:  # given up by the strategy
            self._forget(mid)
        out: list[Message] = []
        while not out:
            ids = [sid for t in wanted for sid in t.pending] + [t.event for t in wanted if t.event]
            got = list(self.inner.pull_messages(ids)) if ids else []
            if not got:
                break
            for reply in got:
                rid = reply.metadata.reply_to_message_id
                if rid in self.tasks:  # a region's update, released by the clock
                    self._forget(rid)
                    out.append(reply)
                    continue
                task = self.tasks[self._site_task.pop(rid)]
                task.pending.pop(rid, None)
                task.replies.append(reply)
                if not task.pending:
                    if (ready := self._complete(task)) is not None:
                        self._forget(task.message.metadata.message_id)
                        out.append(ready)
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        raise NotImplementedError(
            "regions as nodes serve FedBuff's push and pull; a synchronous round combines regions itself"
        )

    def _forget(self, mid: str) -> None:
        task = self.tasks.pop(mid, None)
        if task is not None:
            for sid in task.pending:
                self._site_task.pop(sid, None)

    # --- a region's answer -------------------------------------------------------------
    def _complete(self, task: RegionTask) -> Message | None:
        """The region's reply once its sites are in: returned now, or (virtual clock) put on the clock
        as an event at the end of its WAN leg and returned when the clock releases it."""
        reply = self._region_reply(task)
        if self.clock is None:
            return reply
        nbytes = payload_bytes(reply.content) if reply.has_content() else 0
        at = self.clock.now + self.clock.wan_up(task.region, nbytes)
        task.event = self.clock.inject(reply, task.message.metadata.dst_node_id, at)
        return None

    def _region_reply(self, task: RegionTask) -> Message:
        """The region's model from its sites' replies (screened, then its rule and WAN codec), with
        the sum of their capped weights; an error reply when none is valid."""
        sent = task.message.content[ARRAYS]
        base: TensorDict = record_to_tensors(sent)
        screened: Screened = screen_replies(
            task.replies,
            specs_of(sent),
            sent=task.sites,
            weight_cap=self.limits.weight_cap,
            unpack=self.limits.unpack,
            check=self.limits.check,
            base=base,
            names=self.names,
        )
        version = int(task.message.content[CONFIG].get(SERVER_ROUND, 0))
        model = self.combine.combine(
            version, base, screened, lambda _r, s: s.valid[0].arrays if s.valid else None, RoundReport()
        )
        outcome = self.combine.last[task.region]
        if model is None:
            why = "; ".join(f"{r.node_id}: {r.reason}" for r in screened.rejected) or "no site replied"
            return Message(
                Error(code=REGION_ERROR_CODE, reason=f"region {task.region}: no valid site reply ({why})"),
                reply_to=task.message,
            )
        used = [r for r in screened.valid if r.node_id not in outcome.excluded]
        metrics = weighted_metrics(used)  # its NUM_EXAMPLES: the sum of the sites' capped weights
        metrics[REGION_NODES] = len(used)
        content = RecordDict(
            {ARRAYS: tensors_to_record({k: v.to(base[k].dtype) for k, v in model.items()}), METRICS: metrics}
        )
        log.debug("region %d: %d of %d sites in its update", task.region, len(used), len(task.sites))
        return Message(content, reply_to=task.message)
