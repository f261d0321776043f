"""The ServerApp's side of the status channel: the run's state (retained), its rounds and its
alerts (app/status/schema.py), from the rows metrics.jsonl records, so that the channel says
nothing the results files do not (with privacy on, no per-node fact outside ε: the rows leave
them out, and so do the alerts)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from app.config.schema import Config, ConfigError, MqttConfig
from app.protocol import (
    STATUS_CA_PEM,
    STATUS_FLUSH_S,
    STATUS_HOST,
    STATUS_PORT,
    STATUS_PREFIX,
    STATUS_QOS,
    STATUS_RUN,
)
from app.status.alerts import AlertRules
from app.status.channel import Broker, Channel
from app.status.schema import payload, run_topic

log = logging.getLogger("flwr.fedgpu." + __name__)


def server_broker(cfg: MqttConfig) -> Broker:
    """The broker settings of the server's connection; ConfigError for a file it cannot read."""
    password = None
    if cfg.password_file:
        try:
            password = Path(cfg.password_file).expanduser().read_text().strip()
        except OSError as err:
            raise ConfigError(f"monitoring.mqtt.password_file={cfg.password_file}: cannot read it ({err})") from None
    for key in ("ca", "cert", "key"):
        if (path := getattr(cfg, key)) and not os.path.isfile(Path(path).expanduser()):
            raise ConfigError(f"monitoring.mqtt.{key}={path}: no such file")
    return Broker(
        host=str(cfg.host),
        port=cfg.port,
        ca_file=str(Path(cfg.ca).expanduser()) if cfg.ca else None,
        cert=str(Path(cfg.cert).expanduser()) if cfg.cert else None,
        key=str(Path(cfg.key).expanduser()) if cfg.key else None,
        username=cfg.username,
        password=password,
        qos=cfg.qos,
        queue=cfg.queue,
    )


class RunStatus:
    """Publishes one run's state, rounds and alerts; every call returns at once."""

    def __init__(
        self, cfg: MqttConfig, run: str, unit: str, primary: str, rules: AlertRules, channel: Channel | Broker
    ) -> None:
        self.cfg, self.run, self.unit, self.primary, self.rules = cfg, run, unit, primary, rules
        self.state_topic = run_topic(cfg.topic_prefix, run, "state")
        self.rounds_topic = run_topic(cfg.topic_prefix, run, "rounds")
        self.alerts_topic = run_topic(cfg.topic_prefix, run, "alerts")
        if isinstance(channel, Broker):  # a server that dies without a goodbye leaves the broker saying so
            will = (self.state_topic, payload(run=run, state="failed", why="the ServerApp lost its broker connection"))
            channel = Channel(channel, "fedgpu-srv", will=will)
        self.channel = channel
        self.step = 0
        scheme = "mqtts" if cfg.ca else "mqtt"
        log.info("status channel: %s://%s:%d, topics %s/runs/%s/#", scheme, cfg.host, cfg.port, cfg.topic_prefix, run)

    def _alerts(self, alerts: list[dict[str, Any]]) -> None:
        for alert in alerts:
            self.channel.publish(self.alerts_topic, payload(run=self.run, **alert))

    def state(self, state: str, **fields: Any) -> None:  # noqa: ANN401
        """The run's last state, retained: a subscriber that comes later reads it at once."""
        self.channel.publish(
            self.state_topic, payload(run=self.run, state=state, step=self.step, unit=self.unit, **fields), retain=True
        )

    def started(self, **about: Any) -> None:  # noqa: ANN401
        self.state("started", **about)

    def round_begun(self, step: int) -> None:
        self.step = step
        self.channel.publish(self.rounds_topic, payload(run=self.run, event="begun", step=step, unit=self.unit))

    def round_ended(self, row: dict[str, Any]) -> None:
        """The row as metrics.jsonl records it, the run's state, and the alerts the row shows."""
        self.step = int(row.get("round", self.step))
        ended = payload(run=self.run, event="ended", step=self.step, unit=self.unit, row=row)
        self.channel.publish(self.rounds_topic, ended)
        self.state("running", **{k: row[k] for k in (self.primary, "loss", "epsilon") if row.get(k) is not None})
        self._alerts(self.rules.of_row(row))

    def stopped(self, status: str, why: str | None) -> None:
        """The run's final state (completed, stopped, failed) and why; the budget's end is an alert too."""
        self._alerts(self.rules.of_end(self.step, why))
        self.state(status, why=why)

    def counts(self) -> dict[str, int]:
        return self.channel.counts()

    def close(self) -> None:
        """After the run: let the last messages leave, waiting up to monitoring.mqtt.close_s for a
        broker that is away to come back, then disconnect."""
        self.channel.close(self.cfg.close_s)


def run_status(cfg: Config, broker: Broker | None, run: str, unit: str, primary: str) -> RunStatus | None:
    """The run's publisher when `monitoring.mqtt.host` is set (`broker`: `server_broker`'s, read
    before the run wrote anything), else None."""
    if broker is None:
        return None
    return RunStatus(cfg.monitoring.mqtt, run, unit, primary, AlertRules.of_config(cfg, unit, primary), broker)


def node_settings(cfg: MqttConfig, run: str) -> dict[str, Any]:
    """What every task tells its node about the channel (app/status/node.py): the broker, the CA's
    text (nodes need not share the server's files), topics and QoS; no credential."""
    if not cfg.host or not cfg.nodes:
        return {}
    ca = Path(cfg.ca).expanduser().read_text() if cfg.ca else ""
    return {
        STATUS_HOST: cfg.host,
        STATUS_PORT: cfg.port,
        STATUS_CA_PEM: ca,
        STATUS_PREFIX: cfg.topic_prefix,
        STATUS_QOS: cfg.qos,
        STATUS_RUN: run,
        STATUS_FLUSH_S: cfg.flush_s,
    }
