"""A ClientApp's side of the status channel: a heartbeat per task on
`<prefix>/nodes/<login>/<node>/tasks` (the login: `status-username`, the one level the broker's ACL
lets it write), `started` when the task arrives and `finished` (with the reply's telemetry) or
`failed` (why) when it is over (app/status/schema.py).

Where the broker is and how its messages look (host, port, the CA's text, topic prefix, QoS,
run name) come with the task, from the server's `monitoring.mqtt`; credentials are the node's
own: node config `status-username`, `status-password-file`, `status-cert`, `status-key` (in
simulation, whose node config is Flower's: FEDGPU_STATUS_USERNAME, FEDGPU_STATUS_PASSWORD_FILE).
A node without the task keys publishes nothing and pays nothing. The connection is kept per
process (a simulation's worker trains many tasks; a deployed ClientApp process lives for one task,
so it waits at most `flush_s` for its last heartbeat, and only while the broker is reachable).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, Message

from app.protocol import (
    CONFIG,
    GPU_DEVICE_PREFIX,
    GPU_TELEMETRY,
    SAMPLES_PER_S,
    SERVER_ROUND,
    STATUS_CA_PEM,
    STATUS_FLUSH_S,
    STATUS_HOST,
    STATUS_PORT,
    STATUS_PREFIX,
    STATUS_QOS,
    STATUS_RUN,
    STEPS,
    WALL_TIME_S,
    ClientSettings,
)
from app.status.channel import Broker, Channel
from app.status.schema import exact_shown, node_topic, payload

log = logging.getLogger("flwr.fedgpu." + __name__)

# What a heartbeat may carry of the reply's metrics: telemetry, never a statistic of the node's data
# (loss, accuracy, example counts stay between the node and the server, and out of the channel).
TELEMETRY = (WALL_TIME_S, STEPS, SAMPLES_PER_S, GPU_TELEMETRY)
# Its work figures, only where the run shows exact figures (`exact_shown`): with the public epochs
# and batch size they give the example count (samples/s x seconds is count x epochs).
WORK = (WALL_TIME_S, STEPS, SAMPLES_PER_S)
WHY_CHARS = 1000  # of a failed task's error: a heartbeat stays far below a consumer's cap (64 KiB)
_channels: dict[Broker, Channel] = {}  # one connection per broker in this process


def _setting(context: Context, key: str, env: str) -> str | None:
    value = context.node_config.get(key) or os.environ.get(env)
    return str(value) if value else None


def node_broker(config: Any, context: Context) -> Broker | None:  # noqa: ANN401
    """The broker a task names, with this node's credentials; None for a task without one."""
    if STATUS_HOST not in config:
        return None
    password_file = _setting(context, "status-password-file", "FEDGPU_STATUS_PASSWORD_FILE")
    password = Path(password_file).expanduser().read_text().strip() if password_file else None
    return Broker(
        host=str(config[STATUS_HOST]),
        port=int(config[STATUS_PORT]),
        ca_pem=str(config[STATUS_CA_PEM]) or None,
        cert=_setting(context, "status-cert", "FEDGPU_STATUS_CERT"),
        key=_setting(context, "status-key", "FEDGPU_STATUS_KEY"),
        username=_setting(context, "status-username", "FEDGPU_STATUS_USERNAME"),
        password=password,
        qos=int(config[STATUS_QOS]),
        queue=100,
    )


def _channel(broker: Broker) -> Channel:
    if broker not in _channels:
        _channels[broker] = Channel(broker, "fedgpu-cli")
    return _channels[broker]


def telemetry(reply: Message, exact: bool = True) -> dict[str, Any]:
    """The reply's telemetry (TELEMETRY, less WORK unless `exact`, and NVML's gpu-device-*), or its error."""
    if reply.has_error():
        return {"outcome": "error", "why": reply.error.reason}
    metrics = next((r for r in reply.content.metric_records.values()), {})
    shown = TELEMETRY if exact else tuple(k for k in TELEMETRY if k not in WORK)
    keep = {k: v for k, v in metrics.items() if k in shown or k.startswith(GPU_DEVICE_PREFIX)}
    return {"outcome": "replied", "device": "cuda" if keep.get(GPU_TELEMETRY) else "cpu", **keep}


def watched(kind: str) -> Callable[[Callable[[Message, Context], Message]], Callable[[Message, Context], Message]]:
    """A handler that publishes the task's heartbeats when the task names a broker."""

    def wrap(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
        @functools.wraps(handler)
        def run(msg: Message, context: Context) -> Message:
            config = msg.content[CONFIG] if CONFIG in msg.content else {}
            try:
                broker = node_broker(config, context)
            except (OSError, ValueError) as err:  # the channel is optional: training goes on without it
                log.warning("status channel: not publishing (%s)", err)
                broker = None
            if broker is None:
                return handler(msg, context)
            channel = _channel(broker)
            topic = node_topic(str(config[STATUS_PREFIX]), broker.username, context.node_id)
            about = {"node": context.node_id, "run": str(config[STATUS_RUN]), "task": kind}
            about["step"] = int(config.get(SERVER_ROUND, 0))
            channel.publish(topic, payload(**about, state="started"))
            try:
                reply = handler(msg, context)
            except Exception as err:
                why = f"{type(err).__name__}: {err}"[:WHY_CHARS]
                channel.publish(topic, payload(**about, state="failed", why=why))
                channel.flush(float(config[STATUS_FLUSH_S]))
                raise
            privacy = ClientSettings.from_record(dict(config)).privacy
            exact = exact_shown(privacy.name, privacy.report_exact)
            channel.publish(topic, payload(**about, state="finished", **telemetry(reply, exact)))
            channel.flush(float(config[STATUS_FLUSH_S]))
            return reply

        return run

    return wrap
