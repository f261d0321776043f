"""A round's replies as they arrive, and what the run keeps of each: `pull_replies` yields them one
at a time (the pull loop that `send_and_receive` gathers), `ReplyFacts` is the small record the
rows and the ledger are built from, so that a streamed round (`federation.aggregation`) drops
each reply's arrays once the strategy has folded them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp import Grid

from strategies.replies import arrays_digest, payload_bytes, records_of


def pull_replies(grid: Grid, ids: Iterable[str], timeout: float | None, max_poll_s: float = 0.2) -> Iterator[Message]:
    """The replies to the pushed messages `ids`, each yielded as soon as a pull brings it, until all
    are in or `timeout` passes. The loop keeps no reply once it is yielded.

    Flower's own `Grid.send_and_receive` under `flwr run` (HttpGrid) polls every 3 s: a round
    whose replies arrive after 0.9 s ends at 3 s, which at small tasks was most of a round
    (docs/benchmarks.md, "Simulation at scale"). Here the poll interval starts at 10 ms and
    doubles up to `max_poll_s`, so a round ends within a few polls of its last reply while a
    long round costs the SuperLink a handful of requests a second.
    """
    pending = set(ids)
    deadline = None if timeout is None else time.monotonic() + timeout
    interval = 0.01
    while pending:
        got = deque(grid.pull_messages(list(pending)))
        while got:
            reply = got.popleft()
            pending.discard(reply.metadata.reply_to_message_id)
            yield reply
            del reply
        if not pending or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))
        interval = min(2 * interval, max_poll_s)


@dataclass(frozen=True)
class ReplyFacts:
    """What a round's rows and ledger entry need of one reply, without its arrays."""

    reply_to: str  # the id of the message it answers
    src_node_id: int
    error: str | None  # an error reply's reason, as the node sent it
    metrics: list[MetricRecord] = field(default_factory=list)
    payload_bytes: int = 0  # `strategies.replies.payload_bytes` of its content
    digest: str | None = None  # sha256 of its one ArrayRecord (`arrays_digest`), when asked for

    @classmethod
    def of(cls, msg: Message, digest: bool) -> ReplyFacts:
        """The facts of `msg`; `digest`: hash its arrays too (the ledger records it)."""
        meta = msg.metadata
        if msg.has_error():
            return cls(meta.reply_to_message_id, meta.src_node_id, msg.error.reason)
        content = msg.content
        arrays = list(records_of(content, ArrayRecord).values())
        return cls(
            meta.reply_to_message_id,
            meta.src_node_id,
            None,
            list(records_of(content, MetricRecord).values()),
            payload_bytes(content),
            arrays_digest(arrays[0]) if digest and len(arrays) == 1 else None,
        )


def noted(replies: Iterable[Message], facts: list[ReplyFacts], digest: bool) -> Iterator[Message]:
    """`replies` passed on one at a time, the facts of each appended to `facts` first."""
    for msg in replies:
        facts.append(ReplyFacts.of(msg, digest))
        yield msg
        del msg
