"""Topics and payloads of the status channel, version 2 (docs/monitoring.md#topics-and-payloads).

Every payload is a JSON object with `v` (this version) and `time` (UTC, ISO 8601), standard JSON
(no NaN or Infinity: `dumps`). A consumer reads `v` first: a new field is not a new version, a
renamed or removed one (or a topic's new layout: version 2 put the login in the node topic) is.

    <prefix>/runs/<run>/state      retained: the run's last state (started, running, completed,
                                   stopped, failed), its step, and why it stopped
    <prefix>/runs/<run>/rounds     each round (FedBuff version) begun and ended, the ended one with
                                   the row metrics.jsonl records
    <prefix>/runs/<run>/alerts     a node lost or rejected and why, a round skipped, a privacy
                                   budget nearly (90%) or fully spent, the target reached
    <prefix>/nodes/<login>/<node>/tasks
                                   a ClientApp's heartbeat per task: started, then finished or
                                   failed with its telemetry (device, GPU utilisation and memory
                                   where NVML reads them, examples/s, steps, seconds)

`<run>` is the run's results directory name, `<node>` the Flower node id, `<login>` the node's
MQTT login: the broker's ACL (docker/monitoring/mosquitto.acl) lets a login write only its own
`<prefix>/nodes/<login>/+/tasks`, so a consumer knows which login spoke (app/live/feed.py).
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from typing import Any

from app.config.schema import DISTRIBUTED_PRIVACY

VERSION = 2
STATES = ("started", "running", "completed", "stopped", "failed")
ALERTS = ("node_lost", "node_rejected", "round_skipped", "budget_nearly_spent", "budget_spent", "target_reached")
NEARLY_SPENT = 0.9  # budget_nearly_spent: epsilon at this fraction of privacy.max_epsilon
_UNSAFE = re.compile(r"[#+/\x00-\x1f]")  # MQTT wildcards, the level separator, control characters


def level(name: str | int) -> str:
    """A topic level from a name: wildcards and separators replaced, so a run or node name cannot
    address other topics."""
    return _UNSAFE.sub("_", str(name)) or "_"


def run_topic(prefix: str, run: str, kind: str) -> str:
    return f"{prefix}/runs/{level(run)}/{kind}"


def node_topic(prefix: str, login: str | None, node: int | str) -> str:
    """A node's heartbeat topic under its login (none: `_`, which no ACL grants)."""
    return f"{prefix}/nodes/{level(login or '')}/{level(node)}/tasks"


def payload(**fields: Any) -> dict[str, Any]:  # noqa: ANN401
    """A message: the version, the time, then `fields`."""
    return {"v": VERSION, "time": datetime.now(UTC).isoformat(timespec="milliseconds"), **fields}


def finite(value: Any) -> Any:  # noqa: ANN401
    """`value` with every non-finite float as None: JSON has no NaN or Infinity, and a browser's
    JSON.parse (the live page) refuses the bare words Python's json writes for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(body: Any) -> str:  # noqa: ANN401
    """Standard JSON: non-finite floats as null, anything else JSON lacks as its text."""
    return json.dumps(finite(body), allow_nan=False, default=str)


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def loads(text: str | bytes) -> Any:  # noqa: ANN401
    """Standard JSON only: NaN, Infinity and nesting deeper than Python's recursion limit raise
    ValueError (json.loads takes the first two and raises RecursionError on the last)."""
    try:
        return json.loads(text, parse_constant=_refuse)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def exact_shown(privacy: str, report_exact: bool) -> bool:
    """Whether a run's exact per-node figures may reach the channel and the live page, as they reach
    metrics.jsonl (app/run/privacy.py `exact_per_node`, app/config/schema.py ROW_COLUMN_PRIVACY):
    without privacy, under distributed DP (its nodes send the server no exact figure; its cohort is
    public by assumption), or with privacy.report_exact. Only then does a heartbeat carry the node's
    work figures (seconds, steps, examples/s: with the public epochs and batch size, its example
    count) and the page its ledger's per-node records."""
    return privacy in ("none", *DISTRIBUTED_PRIVACY) or report_exact
