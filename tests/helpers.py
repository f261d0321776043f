"""Helpers shared by the tests (fixtures live in tests/conftest.py).

Helpers that bench/ scripts need too live in the app: `app.tools.in_process.run_in_process`
(a whole federation in this process), `app.simulation.messages.make_reply` (a reply as the
server receives it), `app.tools.processes` (free ports, the `flwr` CLI's JSON answers).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from flwr.app import Context, Message, RecordDict

from app.protocol import NUM_PARTITIONS, PARTITION_ID

ROOT = Path(__file__).resolve().parents[1]


def context_for(partition_id: int, num_partitions: int, node_config: dict | None = None) -> Context:
    """A simulated node's Context, as the ClientApp gets it (node id 1000 + partition id)."""
    return Context(
        run_id=1,
        node_id=1000 + partition_id,
        node_config=node_config or {PARTITION_ID: partition_id, NUM_PARTITIONS: num_partitions},
        state=RecordDict(),
        run_config={},
    )


def reply_to_same_task(reply: Message) -> Message:
    """A stand-in instruction message, so that a tampered reply keeps the original's routing
    (its reply_to_message_id and destination)."""
    ins = Message(RecordDict(), dst_node_id=reply.metadata.src_node_id, message_type="train")
    ins.metadata.__dict__["_message_id"] = reply.metadata.reply_to_message_id
    return ins


def load_script(name: str, folder: str = "scripts") -> ModuleType:
    """A module from scripts/ or bench/ (not packages: the scripts run as files)."""
    path = ROOT / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
