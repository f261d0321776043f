"""Replies as they arrive at the server, built outside a run: strategy tests and the
aggregation benchmark feed them straight to `aggregate_train` / `aggregate_evaluate`.

Call `app.simulation.local_grid.act_as_server()` first (tests/conftest.py does): a
Message takes its run and node ids from the process's task identity.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict

from strategies.keys import ARRAYS, METRICS


def make_reply(
    node_id: int,
    arrays: dict[str, np.ndarray] | None,
    metrics: dict[str, Any] | None,
    error: str | None = None,
    *,
    message_id: str | None = None,
    error_code: int = 0,
) -> Message:
    """The reply from node `node_id` to a train instruction with id `message_id` (default
    f"m{node_id}"): an "arrays" ArrayRecord and a "metrics" MetricRecord (each left out when
    None), or, with `error`, an error reply (code `error_code`) and no content."""
    ins = Message(RecordDict(), dst_node_id=node_id, message_type="train")
    ins.metadata.__dict__["_message_id"] = f"m{node_id}" if message_id is None else message_id
    if error is not None:
        return Message(Error(code=error_code, reason=error), reply_to=ins)
    content = RecordDict()
    if arrays is not None:
        content[ARRAYS] = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    if metrics is not None:
        content[METRICS] = MetricRecord(metrics)
    return Message(content, reply_to=ins)
