"""Topics and payloads of the status channel, version 1 (docs/monitoring.md#topics-and-payloads).

Every payload is a JSON object with `v` (this version) and `time` (UTC, ISO 8601). A consumer
reads `v` first: a new field is not a new version, a renamed or removed one is.

    <prefix>/runs/<run>/state      retained: the run's last state (started, running, completed,
                                   stopped, failed), its step, and why it stopped
    <prefix>/runs/<run>/rounds     each round (FedBuff version) begun and ended, the ended one with
                                   the row metrics.jsonl records
    <prefix>/runs/<run>/alerts     a node lost or rejected and why, a round skipped, a privacy
                                   budget nearly (90%) or fully spent, the target reached
    <prefix>/nodes/<node>/tasks    a ClientApp's heartbeat per task: started, then finished or
                                   failed with its telemetry (device, GPU utilisation and memory
                                   where NVML reads them, examples/s, steps, seconds)

`<run>` is the run's results directory name, `<node>` the Flower node id.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

VERSION = 1
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


def node_topic(prefix: str, node: int | str) -> str:
    return f"{prefix}/nodes/{level(node)}/tasks"


def payload(**fields: Any) -> dict[str, Any]:  # noqa: ANN401
    """A message: the version, the time, then `fields`."""
    return {"v": VERSION, "time": datetime.now(UTC).isoformat(timespec="milliseconds"), **fields}
