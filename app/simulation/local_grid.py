"""A Flower Grid that runs our ClientApp in this process: fast, deterministic runs
for tests, benchmarks and experiment sweeps (no SuperLink, no Ray).

It follows the contract of Flower's InMemoryGrid (message ids set on push, replies
matched by reply_to_message_id, a ClientApp exception becomes an error reply, a node
that went away answers with NODE_UNAVAILABLE) but calls the ClientApp directly instead
of going through a SuperLink. With `workers=0` each message is answered during
`push_messages`; with `workers > 0` nodes train concurrently in threads (PyTorch
releases the GIL in its kernels).

A whole federation on this grid (config, the ServerApp's loop, the real ClientApp):
app.tools.in_process.run_in_process.
"""

from __future__ import annotations

import ast
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from app.protocol import NUM_PARTITIONS, PARTITION_ID


def act_as_server() -> None:
    """Give this process the task identity Flower's runtime would set for a ServerApp,
    so Messages can be built outside a real run (tests, sweeps, benchmarks)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1


_AST_LOCK = threading.RLock()


def serialise_ast_parse() -> None:
    """Let one thread at a time run `ast.parse` in this process (idempotent).

    Why by hand: CPython 3.11 keeps the AST constructor's recursion depth per interpreter,
    not per thread, so two threads parsing at once (numpy reads every array header with
    `ast.literal_eval`; torch parses signatures on import) can raise "SystemError: AST
    constructor recursion depth mismatch" (python/cpython#106905): a node's training then
    fails at random. Only concurrent node threads need it; Flower runs each ClientApp in a
    process of its own. `ast.literal_eval` and `inspect` look `parse` up in the ast module,
    so replacing it there covers them.
    """
    if getattr(ast.parse, "serialised", False):
        return
    parse = ast.parse

    def serialised_parse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with _AST_LOCK:
            return parse(*args, **kwargs)

    serialised_parse.serialised = True  # type: ignore[attr-defined]
    ast.parse = serialised_parse  # type: ignore[assignment]


class InProcessGrid(Grid):
    def __init__(
        self,
        client_app: Callable[[Message, Context], Message],
        num_nodes: int,
        tamper: Callable[[int, Message], Message | None] | None = None,
        workers: int = 0,
    ) -> None:
        # Messages take run and node ids from the process's task identity (set by
        # Flower's runtime in a real run).
        act_as_server()
        self.client_app = client_app
        self.tamper = tamper  # rewrites one node's reply (malformed / malicious); None = no reply ever
        self.contexts = {
            1000 + i: Context(
                run_id=1,
                node_id=1000 + i,
                node_config={PARTITION_ID: i, NUM_PARTITIONS: num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        if workers > 0:
            serialise_ast_parse()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="node") if workers > 0 else None
        self._pending: dict[str, tuple[Message, Future[Message | None]]] = {}
        self._lock = threading.Lock()
        self.dead: set[int] = set()
        self.pushed: list[Message] = []
        self.in_flight: Counter[int] = Counter()  # node -> messages pushed and not yet pulled
        self.max_in_flight = 0  # the most messages one node ever had at once

    def set_run(self, run) -> None:  # noqa: ANN001
        pass

    @property
    def run(self):  # noqa: ANN201
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: ANN001, ANN201
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.dead]

    def kill(self, node_id: int) -> None:
        """The node vanishes: it leaves the node list and its tasks answer NODE_UNAVAILABLE."""
        self.dead.add(node_id)

    def _answer(self, msg: Message) -> Message | None:
        node = msg.metadata.dst_node_id
        try:
            reply = self.client_app(msg, self.contexts[node])
        except Exception as err:  # noqa: BLE001 - mirrors Flower: exception -> error reply
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(err).__name__}: {err}"), reply_to=msg
            )
        return self.tamper(node, reply) if self.tamper is not None else reply

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            node = msg.metadata.dst_node_id
            with self._lock:
                self.pushed.append(msg)
                self.in_flight[node] += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight[node])
            future: Future[Message | None]
            if self._pool is None or node in self.dead:
                future = Future()
                future.set_result(None if node in self.dead else self._answer(msg))
            else:
                future = self._pool.submit(self._answer, msg)
            self._pending[msg.metadata.message_id] = (msg, future)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = []
        for mid in list(message_ids):
            if mid not in self._pending:
                continue
            msg, future = self._pending[mid]
            node = msg.metadata.dst_node_id
            if node in self.dead:
                # What the SuperLink answers (from its own node id, not the vanished node's)
                reply = create_message_error_unavailable_res_message(msg.metadata, "node_unavail")
            elif future.done() and future.result() is not None:
                reply = future.result()
            else:
                continue
            del self._pending[mid]
            with self._lock:
                self.in_flight[node] -= 1
            out.append(reply)
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        wait([self._pending[i][1] for i in ids], timeout=timeout)
        return self.pull_messages(ids)

    def close(self) -> None:
        """Stop the worker threads (tasks still running finish first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
