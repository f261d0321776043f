"""Shared fixtures: reply builders for strategy tests, and the in-process grid."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Error, Message, MetricRecord, RecordDict

from app.simulation.local_grid import act_as_server
from app.tools.processes import free_ports  # noqa: F401 - re-exported for the tests

sys.path.insert(0, str(Path(__file__).parent))

act_as_server()


def make_reply(
    node_id: int, arrays: dict[str, np.ndarray] | None, metrics: dict | None, error: str | None = None
) -> Message:
    """A reply as it arrives at the server from node `node_id`."""
    ins = Message(RecordDict(), dst_node_id=node_id, message_type="train")
    ins.metadata.__dict__["_message_id"] = f"m{node_id}"
    if error is not None:
        return Message(Error(code=0, reason=error), reply_to=ins)
    content = RecordDict()
    if arrays is not None:
        content["arrays"] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    if metrics is not None:
        content["metrics"] = MetricRecord(metrics)
    return Message(content, reply_to=ins)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture
def model_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "conv.weight": rng.normal(size=(4, 3, 3, 3)).astype(np.float32),
        "conv.bias": rng.normal(size=(4,)).astype(np.float32),
        "fc.weight": rng.normal(size=(10, 4)).astype(np.float32),
    }


def context_for(partition_id: int, num_partitions: int, node_config: dict | None = None) -> Context:
    return Context(
        run_id=1,
        node_id=1000 + partition_id,
        node_config=node_config or {"partition-id": partition_id, "num-partitions": num_partitions},
        state=RecordDict(),
        run_config={},
    )


def load_script(name: str) -> ModuleType:
    """A module from scripts/ (not a package: the scripts run as files)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
