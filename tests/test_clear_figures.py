"""What leaves a run in the clear (issue 48, findings 9 and 14).

Under `secagg=plus` a node's example count travels only inside its masked vector: no clear figure
of a masked reply, nor the heartbeat built from it, may determine it (samples-per-s x wall-time-s
was exactly the count x epochs). With privacy on, every metrics.jsonl column is declared public or
exact (app/config/schema.py ROW_COLUMN_PRIVACY) and only public ones reach the rows, Prometheus,
the status channel and the live page, under every privacy mode and topology.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Message
from prometheus_client import generate_latest

from app import protocol
from app.config.schema import EXACT, PUBLIC, PUBLIC_COLUMNS, ROW_COLUMN_PRIVACY, ROW_COLUMNS
from app.live.runs import ROW_KEYS, RunView
from app.run import monitoring
from app.status import node as status_node
from app.status import server as status_server
from app.tools.in_process import run_in_process

client_module = importlib.import_module("app.client_app")  # the module (app.client_app.app is the ClientApp)

FAST = "federation.rounds=1 train.epochs=1 seed=5 model.width=8 train.batch_size=64 tracking.tensorboard=false "
# The figures that measure a node's work: with the public epochs and batch size, each alone or
# together gives its example count (samples-per-s x wall-time-s is exactly count x epochs).
WORK = {
    protocol.NUM_EXAMPLES,
    protocol.SAMPLES_PER_S,
    protocol.WALL_TIME_S,
    protocol.STEPS,
    protocol.DEVICE_S,
    protocol.ENCODE_S,
    protocol.BATCH_SIZE,
    protocol.OOM_RETRIES,
    protocol.MICRO_BATCH_SIZE,
    protocol.AMP_SKIPPED_STEPS,
    protocol.PEAK_GPU_MEM_MB,
    protocol.TRAIN_LOSS,
    protocol.TRAIN_ACCURACY,
}


def _rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]


def _entries(summary: dict[str, Any]) -> list[dict[str, Any]]:
    path = Path(summary["run_dir"]) / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ----------------------------------------------------------------------------- finding 9


def test_a_masked_reply_and_its_heartbeat_carry_no_clear_figure_that_gives_the_count(tmp_path, monkeypatch):
    """Three nodes with different example counts (Dirichlet partitions) under secagg=plus: every
    masked reply the server receives carries in the clear the same figures, with the same values,
    apart from the simulated partition id, so no function of them tells the counts apart; the
    product samples-per-s x wall-time-s is gone, and so are the heartbeat's and the ledger's work
    figures."""
    counts: dict[int, float] = {}
    real = client_module.trained

    def counting(msg, context):  # noqa: ANN001, ANN202 - the node's own count, which the server must not learn
        job, state, metrics, seed = real(msg, context)
        counts[context.node_id] = metrics[protocol.NUM_EXAMPLES]
        return job, state, metrics, seed

    monkeypatch.setattr(client_module, "trained", counting)
    clear: dict[int, dict[str, Any]] = {}
    beats: dict[int, dict[str, Any]] = {}

    def spy(node: int, reply: Message) -> Message:
        if not reply.has_error() and reply.metadata.message_type == protocol.SECAGG_TRAIN:
            (metrics,) = reply.content.metric_records.values()
            clear[node] = dict(metrics)
            beats[node] = status_node.telemetry(reply)
        return reply

    summary, _ = run_in_process(
        FAST + "secagg=plus partition=dirichlet federation.min_train_nodes=3 federation.min_available_nodes=3",
        tmp_path,
        nodes=3,
        tamper=spy,
    )
    assert summary["status"] == "completed" and len(clear) == 3
    assert len(set(counts.values())) == 3, counts  # three different counts to hide
    for node, metrics in clear.items():
        assert not WORK & set(metrics), (node, sorted(metrics))
        assert set(metrics) <= protocol.SECAGG_CLEAR, sorted(metrics)
    device = {n: {k: v for k, v in m.items() if k != protocol.PARTITION_ID} for n, m in clear.items()}
    first = next(iter(device.values()))
    if not first.get(protocol.GPU_TELEMETRY):  # on a CPU every clear figure is the same for every count
        assert all(d == first for d in device.values()), device
    for beat in beats.values():
        assert not WORK & set(beat), beat
    for entry in _entries(summary):
        for record in entry["nodes"]:
            assert not {k for k in record if k.startswith("reported_")}, record


# ----------------------------------------------------------------------------- finding 14


def test_every_row_column_is_declared_public_or_exact_in_one_place():
    """A new column must choose: ROW_COLUMNS is the declaration's keys, each public or exact."""
    assert ROW_COLUMNS == tuple(ROW_COLUMN_PRIVACY)
    assert set(ROW_COLUMN_PRIVACY.values()) == {PUBLIC, EXACT}
    assert PUBLIC_COLUMNS == {c for c, kind in ROW_COLUMN_PRIVACY.items() if kind == PUBLIC}
    # what names nodes, counts their replies or sums their counts is exact
    for column in ("num_clients", "rejected", "train", "bytes_up_total", "secagg", "regions", "wan_bytes"):
        assert ROW_COLUMN_PRIVACY[column] == EXACT, column


class Published:
    """Stands in for the status channel's Channel, on the server and on every node: keeps what
    each publishes."""

    messages: list[tuple[str, dict[str, Any]]] = []

    def __init__(self, broker: Any, client_id: str, will: Any = None) -> None:  # noqa: ANN401
        pass

    def publish(self, topic: str, payload: dict[str, Any], retain: bool = False) -> bool:
        Published.messages.append((topic, json.loads(json.dumps(payload))))
        return True

    def counts(self) -> dict[str, int]:
        return {"sent": 0, "delivered": 0, "dropped": 0}

    def flush(self, timeout_s: float, reconnect: bool = False) -> None:
        pass

    def close(self, timeout_s: float = 0.0) -> None:
        pass


# privacy mode -> (overrides, whether exact figures may be shown, nodes)
MODES = {
    "none": ("", True, 4),
    "central": ("privacy=central privacy.noise_multiplier=0.5", False, 4),
    "local": ("privacy=local privacy.noise_multiplier=1.0", False, 4),
    "local-regions": ("privacy=local privacy.noise_multiplier=1.0 topology=regions topology.regions=2", False, 4),
    "distributed": ("secagg=plus privacy=distributed privacy.noise_multiplier=0.5", True, 4),
    "secagg-regions": ("secagg=plus topology=regions topology.regions=2", True, 4),
}


def _exact_metric_names() -> set[str]:
    """The Prometheus metrics fed by an exact column or by one node's reply."""
    exact = {name for key, (name, _) in monitoring.ROW_GAUGES.items() if ROW_COLUMN_PRIVACY[key] == EXACT}
    exact |= {name for key, (name, _) in monitoring.ROW_COUNTERS.items() if ROW_COLUMN_PRIVACY[key] == EXACT}
    exact |= {name for name, _ in monitoring.TRAIN_GAUGES.values()}
    return exact | {name for name, *_ in monitoring.NODE_GAUGES.values()} | {"fedgpu_node_last_seen_timestamp_seconds"}


@pytest.mark.parametrize("mode", list(MODES))
def test_no_exact_figure_reaches_rows_prometheus_the_channel_or_the_live_page(tmp_path, monkeypatch, mode):
    overrides, exact, nodes = MODES[mode]
    monitors: list[monitoring.Monitor] = []

    class Kept(monitoring.Monitor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
            super().__init__(*args, **kwargs)
            monitors.append(self)

    monkeypatch.setattr("app.run.assemble.Monitor", Kept)
    monkeypatch.setattr(status_server, "Channel", Published)
    monkeypatch.setattr(status_node, "Channel", Published)
    monkeypatch.setattr(status_node, "_channels", {})
    monkeypatch.setattr(Published, "messages", [])
    summary, _ = run_in_process(
        f"{FAST} {overrides} federation.fraction_evaluate=1 monitoring.mqtt.host=127.0.0.1 name=run "
        f"federation.min_train_nodes={nodes} federation.min_available_nodes={nodes}",
        tmp_path,
        nodes=nodes,
    )
    assert summary["status"] == "completed"
    public = PUBLIC_COLUMNS | {"accuracy"}
    rows = _rows(summary)
    rounds = [p["row"] for t, p in Published.messages if t.endswith("/rounds") and p["event"] == "ended"]
    beats = [p for t, p in Published.messages if "/nodes/" in t and p["state"] == "finished"]
    (monitor,) = monitors
    exposition = generate_latest(monitor.registry).decode()
    shown = {line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if not line.startswith("#")}
    view = RunView.of_dir(Path(summary["run_dir"]))
    view.poll()
    page = view.as_dict()
    assert rows and rounds == rows and beats
    secure = "secagg" in overrides
    if exact and not secure:  # the control: without privacy each output shows exact figures
        assert set(rows[0]) - public and shown & _exact_metric_names()
        assert any(WORK & set(b) for b in beats) and any(s["examples"] for s in page["nodes"].values())
        return
    if not exact:
        for row in rows:
            assert set(row) <= public, sorted(set(row) - public)
        assert not shown & _exact_metric_names(), sorted(shown & _exact_metric_names())
        assert not any(r[k] is not None for r in page["rows"] for k in ROW_KEYS if ROW_COLUMN_PRIVACY.get(k) == EXACT)
        assert page["nodes"] == {}, page["nodes"]  # the ledger's per-node records stay off the page
        assert not any("node" in p for t, p in Published.messages if t.endswith("/alerts"))
    # under every mode that hides them (and under secure aggregation, which hides them from the server
    # too) no node's work figure or count leaves it in the clear
    for beat in beats:
        assert not WORK & set(beat), beat
    if secure:
        assert not {n for n in shown if n.startswith("fedgpu_node_") and "gpu" not in n} - {
            "fedgpu_node_last_seen_timestamp_seconds"
        }, sorted(shown)
        assert all(not s["examples"] for s in page["nodes"].values())
