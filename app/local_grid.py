"""A Flower Grid that runs our ClientApp in this process: fast, deterministic runs
for tests and experiment sweeps (no SuperLink, no Ray).

It follows the contract of Flower's InMemoryGrid (message ids set on push, replies
matched by reply_to_message_id, a ClientApp exception becomes an error reply) but
calls the ClientApp directly instead of going through a SuperLink.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


def act_as_server() -> None:
    """Give this process the task identity Flower's runtime would set for a ServerApp,
    so Messages can be built outside a real run (tests, sweeps, benchmarks)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1


class InProcessGrid(Grid):
    def __init__(
        self,
        client_app: Callable[[Message, Context], Message],
        num_nodes: int,
        tamper: Callable[[int, Message], Message] | None = None,
    ) -> None:
        # Messages take run and node ids from the process's task identity (set by
        # Flower's runtime in a real run).
        act_as_server()
        self.client_app = client_app
        self.tamper = tamper  # lets a test rewrite one node's reply (malformed / malicious)
        self.contexts = {
            1000 + i: Context(
                run_id=1,
                node_id=1000 + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        self._replies: dict[str, Message] = {}
        self.pushed: list[Message] = []

    def set_run(self, run) -> None:  # noqa: ANN001
        pass

    @property
    def run(self):  # noqa: ANN201
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: ANN001, ANN201
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            self.pushed.append(msg)
            node = msg.metadata.dst_node_id
            try:
                reply = self.client_app(msg, self.contexts[node])
            except Exception as err:  # noqa: BLE001 - mirrors Flower: exception -> error reply
                reply = Message(Error(code=1, reason=f"{type(err).__name__}: {err}"), reply_to=msg)
            if self.tamper is not None:
                reply = self.tamper(node, reply)
            if reply is not None:
                self._replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))
