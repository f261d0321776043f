"""Live Prometheus metrics of a run (monitoring.prometheus_port): what an operator watches in
Grafana while a federation runs (docker/monitoring/), fed with the same per-round rows as
metrics.jsonl and the successful replies' metrics.

Each Monitor has its own CollectorRegistry, never the process-wide default one: several runs
(and tests) in one process would otherwise clash on metric names. metrics.jsonl stays the
record; counters here restart at zero with the process, which PromQL's rate() absorbs.

Labels are bounded: task metric names come from the run's config (trusted, few), node labels
from node ids, of which a deployment may have any number (the operator does not choose how many
SuperNodes register). So at most `max_node_labels` node values are created; further nodes share
node="other", which holds the latest value any of them reported. No other reply-provided string
ever becomes a label.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from app.config.schema import check_columns
from app.protocol import (
    GPU_MEM_USED_MAX_MB,
    GPU_POWER_MEAN_W,
    GPU_TEMP_MAX_C,
    GPU_UTIL_MEAN_PCT,
    SAMPLES_PER_S,
    TRAIN_LOSS,
    WALL_TIME_S,
)

OTHER_NODE = "other"

# Row key -> (gauge name, help): the latest round's (or FedBuff version's) values.
ROW_GAUGES = {
    "round": ("fedgpu_round", "Current round (FedBuff: model version)."),
    "loss": ("fedgpu_loss", "Central evaluation loss at the latest evaluated round."),
    "round_time_s": ("fedgpu_last_round_duration_seconds", "Duration of the latest round (FedBuff: version)."),
    "num_sampled": ("fedgpu_nodes_sampled", "Nodes sampled in the latest round."),
    "num_clients": ("fedgpu_nodes_aggregated", "Replies aggregated into the model in the latest round."),
    "epsilon": ("fedgpu_privacy_epsilon", "Differential privacy epsilon spent so far (private runs only)."),
}
# Row key -> (counter name, help): summed over rounds.
ROW_COUNTERS = {
    "num_rejected": ("fedgpu_replies_rejected_total", "Replies rejected by the strategy's checks."),
    "num_missing": ("fedgpu_replies_missing_total", "Sampled nodes that did not reply in time."),
    "num_failed": ("fedgpu_replies_failed_total", "Replies that carried an error (FedBuff)."),
    "num_discarded_stale": ("fedgpu_replies_stale_total", "Replies discarded as too stale (FedBuff)."),
    "bytes_down_total": ("fedgpu_downlink_bytes_total", "Array bytes of the tasks sent to nodes."),
    "bytes_up_total": ("fedgpu_uplink_bytes_total", "Array bytes of the replies received."),
}
# Key of the row's `train` section (weighted mean over the round's clients) -> (gauge name, help).
TRAIN_GAUGES = {
    SAMPLES_PER_S: ("fedgpu_train_samples_per_second", "Clients' training throughput, sample-weighted mean."),
    TRAIN_LOSS: ("fedgpu_train_loss", "Clients' training loss, sample-weighted mean."),
}
# Reply metric key -> (per-node gauge name, help, factor to the base unit).
NODE_GAUGES = {
    SAMPLES_PER_S: ("fedgpu_node_samples_per_second", "Training throughput of the node's latest reply.", 1.0),
    WALL_TIME_S: ("fedgpu_node_train_duration_seconds", "Training time of the node's latest reply.", 1.0),
    GPU_UTIL_MEAN_PCT: ("fedgpu_node_gpu_utilization_ratio", "Mean GPU utilisation (0..1).", 0.01),
    # The telemetry's "mb" is MiB (NVML bytes / 2**20: app/task/telemetry.py), so bytes = MiB * 2**20.
    GPU_MEM_USED_MAX_MB: ("fedgpu_node_gpu_memory_used_bytes", "Peak GPU memory used.", float(2**20)),
    GPU_TEMP_MAX_C: ("fedgpu_node_gpu_temperature_celsius", "Peak GPU temperature.", 1.0),
    GPU_POWER_MEAN_W: ("fedgpu_node_gpu_power_watts", "Mean GPU power draw.", 1.0),
}
# The row columns read here (besides the task's metrics) are metrics.jsonl's, declared in
# app/config/schema.py ROW_COLUMNS: a column renamed there must not leave a gauge silently unfed.
ROUND_TIME, TRAIN_SECTION = "round_time_s", "train"
check_columns((*ROW_GAUGES, *ROW_COUNTERS, ROUND_TIME, TRAIN_SECTION))
# Rounds last seconds to hours; the default buckets (5 ms .. 10 s) would put every round over 10 s in +Inf.
ROUND_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, math.inf)


def _number(value: Any) -> float | None:
    """`value` as a float if it is a real number (not a bool, list or None), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


class Monitor:
    """A run's metrics in a private registry, served over HTTP between `start` and `close`."""

    def __init__(self, metric_names: Iterable[str], max_node_labels: int = 256) -> None:
        self.registry = CollectorRegistry()
        self.metric_names = tuple(metric_names)
        self.max_node_labels = max_node_labels
        self._nodes: set[str] = set()
        self._nodes_lock = threading.Lock()  # the bound holds even if the ledger calls from another thread
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._registered: set[Gauge | Counter] = set()
        # Unlabelled gauges and the counters join the registry on their first value: before it,
        # Prometheus would read 0, a real-looking value (epsilon 0 claims no privacy loss, loss 0 a
        # perfect model, and with privacy on, whose rows leave the exact counts out, 0 rejected
        # replies would be a count no epsilon covers: docs/privacy.md).
        self._row_gauges = {key: Gauge(name, doc, registry=None) for key, (name, doc) in ROW_GAUGES.items()}
        self._train_gauges = {key: Gauge(name, doc, registry=None) for key, (name, doc) in TRAIN_GAUGES.items()}
        self._counters = {key: Counter(name, doc, registry=None) for key, (name, doc) in ROW_COUNTERS.items()}
        self._round_hist = Histogram(
            "fedgpu_round_duration_seconds",
            "Round (FedBuff: version) durations.",
            buckets=ROUND_BUCKETS,
            registry=self.registry,
        )
        self._eval = Gauge(
            "fedgpu_eval_metric",
            "Central evaluation metrics at the latest evaluated round.",
            ["metric"],
            registry=self.registry,
        )
        self._last_seen = Gauge(
            "fedgpu_node_last_seen_timestamp_seconds",
            "Unix time of the node's latest successful reply.",
            ["node"],
            registry=self.registry,
        )
        self._node_gauges = {
            key: (Gauge(name, doc, ["node"], registry=self.registry), factor)
            for key, (name, doc, factor) in NODE_GAUGES.items()
        }
        self._contribution = Gauge(
            "fedgpu_node_contribution", "Cumulative contribution score of the node.", ["node"], registry=self.registry
        )

    # --- serving -------------------------------------------------------------------
    def start(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics on `host`:`port` from a daemon thread; port 0 picks a free one.

        Returns the bound port. Loopback by default: a container scraped by Prometheus needs 0.0.0.0.
        """
        if self._server is not None:
            raise RuntimeError("the monitor is already serving")
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        """Stop serving and free the port; closing twice (or unstarted) does nothing."""
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join()

    # --- updates -------------------------------------------------------------------
    def observe(self, row: Mapping[str, Any], client_metrics: Iterable[tuple[int, Mapping[str, Any]]]) -> None:
        """Update from one round's (or FedBuff version's) metrics.jsonl row and the successful replies'
        (node id, metrics). Missing, None or non-numeric values leave the previous value."""
        for key, gauge in self._row_gauges.items():
            self._set(gauge, row.get(key))
        if (duration := _number(row.get(ROUND_TIME))) is not None:
            self._round_hist.observe(duration)
        for name in self.metric_names:
            if (value := _number(row.get(name))) is not None:
                self._eval.labels(metric=name).set(value)
        for key, counter in self._counters.items():
            value = _number(row.get(key))
            if value is not None and math.isfinite(value) and value >= 0:  # a counter only goes up
                self._join(counter)
                counter.inc(value)
        train = row.get(TRAIN_SECTION)
        if isinstance(train, Mapping):
            for key, gauge in self._train_gauges.items():
                self._set(gauge, train.get(key))
        now = time.time()
        for node, metrics in client_metrics:
            label = self._node_label(node)
            self._last_seen.labels(node=label).set(now)
            for key, (gauge, factor) in self._node_gauges.items():
                if (value := _number(metrics.get(key))) is not None:
                    gauge.labels(node=label).set(value * factor)

    def contribution(self, node: int, value: float) -> None:
        """Set the node's cumulative contribution score (the contribution ledger's)."""
        self._contribution.labels(node=self._node_label(node)).set(value)

    def _set(self, gauge: Gauge, value: Any) -> None:
        if (number := _number(value)) is None:
            return
        self._join(gauge)
        gauge.set(number)

    def _join(self, metric: Gauge | Counter) -> None:
        """Register `metric` on its first value (see __init__)."""
        if metric not in self._registered:
            self.registry.register(metric)
            self._registered.add(metric)

    def _node_label(self, node: int) -> str:
        """The node's label value: its id while fewer than `max_node_labels` ids have one, else "other"."""
        label = str(int(node))
        with self._nodes_lock:
            if label in self._nodes:
                return label
            if len(self._nodes) < self.max_node_labels:
                self._nodes.add(label)
                return label
        return OTHER_NODE
