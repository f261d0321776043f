"""What the server's run may ask of a strategy: declared here, once, and nothing else.

`RoundStrategy` is driven round by round through Flower's configure/aggregate calls
(FedAvg, its central-DP release, the robust strategy); `BufferStrategy` runs its own
asynchronous loop and calls the run back once per server version (FedBuff and its
central-DP release). Both share `ServerStrategy`. A strategy gets everything it needs in
its constructor (strategies/settings.py); the run never assigns to one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from strategies.replies import ValidReply
from strategies.tensor_ops import TensorDict


class ServerStrategy(Protocol):
    """What every strategy answers, whichever loop drives it."""

    name: str  # in logs, summaries and checkpoints
    unit: str  # "round" or "version": what a metrics.jsonl row is
    asynchronous: bool  # False: a RoundStrategy; True: a BufferStrategy
    sampler: random.Random  # the strategy's own sampler: its state goes into checkpoints

    def summary(self) -> None:
        """Log the settings once, before the first step."""

    def node_count_problem(self, num_nodes: int) -> str | None:
        """Why `num_nodes` connected nodes could never satisfy the strategy (None: they can)."""

    def run_summary(self) -> dict[str, Any]:
        """Strategy-specific entries of summary.json."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the strategy."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take up a checkpoint's state (refusing another strategy's)."""

    def held_replies(self, num_nodes: int, streamed: bool) -> int:
        """The most replies whose arrays the strategy holds at once with `num_nodes` connected nodes,
        streamed or gathered: what `federation.server_memory_gb` is checked against."""


class RoundStrategy(ServerStrategy, Protocol):
    """A synchronous strategy: the run sends what `configure_*` returns and hands back the replies."""

    train_report: Any  # fedavg.RoundReport of the last aggregation
    last_valid: list[ValidReply]  # the last round's valid replies (contribution scores)
    streams: bool  # whether `aggregate_stream` can fold replies as they arrive

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]: ...

    def aggregate_stream(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """`aggregate_train` over replies read once, as they arrive, none kept (`streams` only)."""

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None: ...

    def robust_row(self) -> dict[str, Any] | None:
        """The robust rule's picks in the last round (None: a plain mean)."""


class BufferStrategy(ServerStrategy, Protocol):
    """An asynchronous strategy: `run` drives the nodes and calls `on_version` after each server step."""

    version: int
    tasks_sent: int
    server_lr: float
    report: Any  # fedbuff.VersionReport of the last version
    streams: bool  # whether the buffer can be folded as updates enter it (the weighted mean)
    streamed: bool  # set before `run` when federation.aggregation chose streaming (app/run/memory.py)
    last_base: TensorDict  # the last version's base and buffer (contribution scores)
    last_buffer: list[ValidReply]

    def size_buffer(self, num_nodes: int) -> int:
        """K for the connected nodes (chosen once when configured as automatic)."""

    def run(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        train_config: ConfigRecord,
        on_version: Callable[[Any, ArrayRecord], bool],
        *,
        first_version: int = 0,
        deadline: float | None = None,
        drain: bool = False,
        clock: Callable[[], float] | None = None,
    ) -> ArrayRecord: ...


class SecureStrategy(RoundStrategy, Protocol):
    """A round strategy whose rounds are secure-aggregation rounds (app/secagg/strategy.py): it drives
    the round's stages itself through `exchange` and never holds a reply's update."""

    secure: bool  # True
    sum_digest: str | None  # sha256 of the last unmasked sum (the row and the ledger record it)

    def secure_train(
        self, server_round: int, messages: list[Message], exchange: Callable[[list[Message]], list[Message]]
    ) -> tuple[ArrayRecord | None, MetricRecord | None, Any]:
        """The round's new model, its summed train metrics and the protocol's outcome."""
