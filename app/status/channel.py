"""A bounded, non-blocking MQTT publisher (paho-mqtt) for the status channel.

Training must never wait for the broker: the connection is made and kept by paho's own network
thread (`connect_async`, `loop_start`, reconnecting with a growing delay), `publish` only puts the
message into paho's queue, and that queue is bounded (`queue`): while the broker is away QoS 1/2
messages wait there and leave when it is back; a message that finds the queue full, or a QoS 0
message while the link is down, is dropped and counted. `counts()` says how many were handed
over, delivered and dropped, for the rows. A dropped *retained* message (a run's last state) is
kept, the latest per topic, and published again as soon as the connection is back: a subscriber
then reads the state the run is really in, whatever was lost in between.
"""

from __future__ import annotations

import logging
import ssl
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt

from app.status.schema import dumps

log = logging.getLogger("flwr.fedgpu." + __name__)


@dataclass(frozen=True)
class Broker:
    """Where and how to connect: host, port, TLS (a CA file or its PEM text), credentials."""

    host: str
    port: int = 1883
    ca_file: str | None = None
    ca_pem: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    password: str | None = None
    qos: int = 1
    queue: int = 1000


def paho_client(broker: Broker, client_id: str) -> mqtt.Client:
    """A paho client for `broker` (its TLS and login; reconnecting every 1-5 s: a status channel
    should be back within seconds), not yet connected. The publisher and the live page's
    subscriber (app/live/feed.py) both start here."""
    # at most 23 characters: what MQTT 3.1.1 obliges a broker to accept
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{client_id[:10]}-{uuid.uuid4().hex[:12]}")
    if broker.username:
        client.username_pw_set(broker.username, broker.password)
    if broker.ca_file or broker.ca_pem:
        context = ssl.create_default_context(cafile=broker.ca_file, cadata=broker.ca_pem)
        if broker.cert:
            context.load_cert_chain(broker.cert, broker.key)
        client.tls_set_context(context)
    client.reconnect_delay_set(min_delay=1, max_delay=5)
    return client


class Channel:
    """One connection to the broker, shared by whoever publishes in this process."""

    def __init__(self, broker: Broker, client_id: str, will: tuple[str, dict[str, Any]] | None = None) -> None:
        self.broker = broker
        self._lock = threading.Lock()
        self.sent = self.delivered = self.dropped = 0
        self._retained: dict[str, dict[str, Any]] = {}  # topic -> its latest dropped retained payload
        client = paho_client(broker, client_id)
        client.max_queued_messages_set(broker.queue)
        if will is not None:  # the broker publishes it if this connection dies without a goodbye
            client.will_set(will[0], dumps(will[1]), qos=broker.qos, retain=True)
        client.on_publish = self._on_publish
        client.on_connect = self._on_connect
        self._client = client
        client.connect_async(broker.host, broker.port, keepalive=30)
        client.loop_start()

    def _on_connect(self, client, userdata, flags, reason, properties) -> None:  # noqa: ANN001, ARG002
        if reason.is_failure:
            log.warning("status channel: broker %s:%d refused the connection: %s", *self._where(), reason)
            return
        with self._lock:
            again, self._retained = self._retained, {}
        for topic, body in again.items():
            self.publish(topic, body, retain=True)

    def _on_publish(self, client, userdata, mid, reason, properties) -> None:  # noqa: ANN001, ARG002
        with self._lock:
            self.delivered += 1
            again, self._retained = self._retained, {}
        for topic, body in again.items():  # room in the queue again: a dropped last state goes first
            self.publish(topic, body, retain=True)

    def _where(self) -> tuple[str, int]:
        return self.broker.host, self.broker.port

    @property
    def connected(self) -> bool:
        return self._client.is_connected()

    def publish(self, topic: str, payload: dict[str, Any], retain: bool = False) -> bool:
        """Hand one JSON message to paho (never waits for the network); False when it was dropped."""
        info = self._client.publish(topic, dumps(payload), qos=self.broker.qos, retain=retain)
        queued = info.rc == mqtt.MQTT_ERR_SUCCESS or (info.rc == mqtt.MQTT_ERR_NO_CONN and self.broker.qos > 0)
        with self._lock:
            if queued:
                self.sent += 1
                self._retained.pop(topic, None)
            else:
                self.dropped += 1
                if retain:
                    self._retained[topic] = payload
        return queued

    def counts(self) -> dict[str, int]:
        """Messages handed over, delivered to the broker (QoS 0: written to the socket), dropped."""
        with self._lock:
            return {"sent": self.sent, "delivered": self.delivered, "dropped": self.dropped}

    def _settled(self) -> bool:
        with self._lock:
            return self.delivered >= self.sent and not self._retained

    def flush(self, timeout_s: float, reconnect: bool = False) -> None:
        """Wait up to `timeout_s` for what is queued to leave: only while connected (a broker that
        is away costs nothing), or with `reconnect` also for the connection to come back."""
        waited, step = 0.0, 0.02
        while waited < timeout_s and (self.connected or reconnect) and not self._settled():
            threading.Event().wait(step)
            waited += step

    def close(self, timeout_s: float = 0.0) -> None:
        """Wait up to `timeout_s` (reconnecting if need be) for the queue and any dropped retained
        state to leave, then disconnect cleanly and stop the network thread."""
        self.flush(timeout_s, reconnect=True)
        self._client.disconnect()
        self._client.loop_stop()
