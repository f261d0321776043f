"""The MQTT status channel (monitoring.mqtt, app/status/) against a real Mosquitto broker with TLS
and a password file: what a run and its nodes publish, the alerts, and a broker that dies
mid-run (training unaffected, the loss counted in the rows, publishing resumed when it is back)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from app.config.schema import ConfigError, MqttConfig
from app.run.results import read_rows
from app.status.alerts import AlertRules
from app.status.channel import Channel, paho_client
from app.status.schema import ALERTS, VERSION, payload
from app.status.server import RunStatus
from app.tools.broker import LocalBroker, missing
from app.tools.in_process import run_in_process
from tests.helpers import load_script
from tests.test_flwr_cli import flwr_env, flwr_run, run_status  # noqa: F401 - flwr_env is a fixture

FAST = "federation.rounds={rounds} train.epochs=1 seed=5"
credentials = load_script("credentials")


class Subscriber:
    """Everything published under fedgpu/#, as (topic, payload, retained), reconnecting by itself."""

    def __init__(self, broker: LocalBroker) -> None:
        self.messages: list[tuple[str, dict[str, Any], bool]] = []
        self.lock = threading.Lock()
        client = paho_client(broker.watcher(), "test-sub")
        client.on_connect = lambda c, *_: c.subscribe("fedgpu/#", qos=1)
        client.on_message = self._on_message
        client.connect("127.0.0.1", broker.port)
        client.loop_start()
        self.client = client
        deadline = time.monotonic() + 30
        while not client.is_connected():
            assert time.monotonic() < deadline, "the test's subscriber could not connect"
            time.sleep(0.05)

    def _on_message(self, client, userdata, msg) -> None:  # noqa: ANN001, ARG002
        with self.lock:
            self.messages.append((msg.topic, json.loads(msg.payload), bool(msg.retain)))

    def of(self, suffix: str) -> list[dict[str, Any]]:
        with self.lock:
            return [p for t, p, _ in self.messages if t.endswith(suffix)]

    def wait_for(self, check, timeout: float = 60.0) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"timed out; got {len(self.messages)} messages"
            time.sleep(0.1)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalBroker]:
    if (why := missing()) is not None:
        pytest.skip(why)
    b = LocalBroker(tmp_path / "broker")
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def node_credentials(broker: LocalBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated nodes' own credentials (their node config is Flower's: the environment)."""
    for key, value in broker.node_env().items():
        monkeypatch.setenv(key, value)


def _overrides(broker: LocalBroker, queue: int = 1000) -> str:
    return " ".join(broker.overrides(queue))


def test_a_run_publishes_its_state_rounds_and_each_nodes_tasks(broker, node_credentials, tmp_path):
    sub = Subscriber(broker)
    try:
        summary, _ = run_in_process(
            FAST.format(rounds=2) + " federation.fraction_evaluate=1 " + _overrides(broker), tmp_path, nodes=3
        )
        run = Path(summary["run_dir"]).name
        sub.wait_for(lambda: any(p["state"] == "completed" for p in sub.of(f"runs/{run}/state")))
    finally:
        sub.close()
    rows = read_rows(summary["run_dir"])
    assert all(p["v"] == VERSION and p["time"] for _, p, _ in sub.messages)
    states = [p["state"] for p in sub.of(f"runs/{run}/state")]
    assert states == ["started", "running", "running", "completed"]
    ended = [p for p in sub.of(f"runs/{run}/rounds") if p["event"] == "ended"]
    assert [p["step"] for p in sub.of(f"runs/{run}/rounds")] == [1, 1, 2, 2]
    # the ended round carries the row metrics.jsonl records (the row's own channel counts included)
    assert [e["row"] for e in ended] == json.loads(json.dumps(rows))
    # A node's messages may reach the broker out of order (one sent before its connection was up goes
    # after a later one): consumers order them by `time`, as here.
    beats = sorted(
        (p["time"], t.split("/")[3], p["task"], p["step"], p["state"]) for t, p, _ in sub.messages if "/nodes/" in t
    )
    # every heartbeat under the nodes' login, the one topic level the broker's ACL lets it write
    assert {t.split("/")[2] for t, _, _ in sub.messages if "/nodes/" in t} == {"node"}
    for node in ("1000", "1001", "1002"):
        for kind in ("train", "evaluate"):
            for step in (1, 2):
                assert [s for _, n, k, st, s in beats if (n, k, st) == (node, kind, step)] == ["started", "finished"]
    finished = [p for t, p, _ in sub.messages if "/nodes/" in t and p["state"] == "finished" and p["task"] == "train"]
    assert all(p["outcome"] == "replied" and p["device"] == "cpu" and p["steps"] > 0 for p in finished)
    assert not any("loss" in p or "num-examples" in p for p in finished)  # telemetry only
    assert all(r["status_channel"]["dropped"] == 0 for r in rows) and rows[-1]["status_channel"]["sent"] >= 4


def test_a_broker_killed_mid_run_neither_slows_nor_changes_training(broker, tmp_path):
    """The broker dies after round 1 and comes back after round 3: the run completes with the model
    a run without a channel trains; the queue (2 messages) overflows while it is away and the rows
    count what was dropped; the final state reaches the broker once it is back (the server waits up
    to monitoring.mqtt.close_s for that, after training)."""
    plain, _ = run_in_process(FAST.format(rounds=5), tmp_path / "plain", nodes=3)
    sub = Subscriber(broker)
    rows_file = tmp_path / "watched"
    seen = {"killed": False, "back": False}

    def chaos() -> None:  # kills and restarts the broker as rows arrive
        while not seen["back"]:
            rows = list(rows_file.rglob("metrics.jsonl"))
            n = len(rows[0].read_text().splitlines()) if rows else 0
            if n >= 1 and not seen["killed"]:
                broker.stop()
                seen["killed"] = True
            if n >= 3 and seen["killed"]:
                broker.start()
                seen["back"] = True
            time.sleep(0.05)

    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    try:
        summary, _ = run_in_process(
            FAST.format(rounds=5) + " monitoring.mqtt.nodes=false " + _overrides(broker, queue=2), rows_file, nodes=3
        )
        thread.join(timeout=600)
        run = Path(summary["run_dir"]).name
        sub.wait_for(lambda: any(p["state"] == "completed" for p in sub.of(f"runs/{run}/state")), timeout=120)
    finally:
        sub.close()
    assert summary["status"] == "completed" and summary["rounds_completed"] == 5
    assert seen == {"killed": True, "back": True}
    trained, reference = (torch.load(Path(s["run_dir"]) / "model_final.pt") for s in (summary, plain))
    for key, x in reference.items():
        assert torch.equal(trained[key], x), key
    counts = [r["status_channel"] for r in read_rows(summary["run_dir"])]
    assert counts[0]["dropped"] == 0 and counts[-1]["dropped"] > 0, counts
    assert all(a["dropped"] <= b["dropped"] for a, b in zip(counts, counts[1:], strict=False)), counts
    # Published after the broker came back: the final state (retained, republished if the full
    # queue had dropped it), so a late subscriber reads that the run completed.
    assert sub.of(f"runs/{run}/state")[-1]["state"] == "completed"


class Collected:
    """A Channel stand-in that keeps what is published (for the alert rules, no broker needed)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, dict[str, Any], bool]] = []

    def publish(self, topic: str, payload: dict[str, Any], retain: bool = False) -> bool:
        self.published.append((topic, payload, retain))
        return True

    def counts(self) -> dict[str, int]:
        return {"sent": len(self.published), "delivered": len(self.published), "dropped": 0}


def test_alerts_follow_the_rows():
    channel = Collected()
    rules = AlertRules("round", "accuracy", target=0.9, max_epsilon=10.0)
    status = RunStatus(MqttConfig(host="x"), "run1", "round", "accuracy", rules, channel)  # type: ignore[arg-type]
    status.round_ended({"round": 1, "accuracy": 0.5, "epsilon": 8.0, "model_updated": True, "rejected": []})
    status.round_ended(
        {
            "round": 2,
            "accuracy": 0.95,
            "epsilon": 9.5,
            "model_updated": False,
            "rejected": [{"node_id": 7, "reason": "non-finite values"}],
            "missing": [9],
        }
    )
    status.round_ended({"round": 3, "accuracy": 0.96, "epsilon": 9.9, "model_updated": True})
    status.stopped("completed", "privacy budget spent: the next release would exceed max_epsilon")
    alerts = [(p["alert"], p["step"]) for t, p, _ in channel.published if t.endswith("/alerts")]
    assert alerts == [
        ("node_rejected", 2),
        ("node_lost", 2),
        ("round_skipped", 2),
        ("budget_nearly_spent", 2),
        ("target_reached", 2),
        ("budget_spent", 3),
    ]
    assert {a for a, _ in alerts} == set(ALERTS)
    retained = [p["state"] for t, p, r in channel.published if r]
    assert retained == ["running", "running", "running", "completed"]
    assert all(t.startswith("fedgpu/runs/run1/") for t, _, _ in channel.published)
    rounds = [(p["event"], p["unit"]) for t, p, _ in channel.published if t.endswith("/rounds")]
    assert rounds == [("ended", "round")] * 3


def test_topic_levels_cannot_be_steered_by_names():
    from app.status.schema import node_topic, run_topic

    assert run_topic("fedgpu", "a/b#+c", "state") == "fedgpu/runs/a_b__c/state"
    assert node_topic("fedgpu", "lab/a+", "1/#") == "fedgpu/nodes/lab_a_/1__/tasks"
    assert node_topic("fedgpu", None, 7) == "fedgpu/nodes/_/7/tasks"  # no login: a level no ACL grants


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("monitoring.mqtt.password_file=/nonexistent/pw", "cannot read it"),
        ("monitoring.mqtt.ca=/nonexistent/ca.crt", "no such file"),
        ("monitoring.mqtt.qos=3", "0, 1 or 2"),
        ("monitoring.mqtt.cert=/x.crt", "needs its key"),
        ("monitoring.mqtt.topic_prefix='a/+'", "wildcards"),
    ],
)
def test_bad_channel_settings_are_refused_before_any_work(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        run_in_process(f"monitoring.mqtt.host=127.0.0.1 {extra}", tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_flwr_run_publishes_through_a_real_broker(broker, flwr_env, tmp_path):  # noqa: F811 - the fixture
    """`flwr run` as a user runs it, the simulated nodes with their own credentials (the environment
    of the `flwr run` that starts this module's local SuperLink)."""
    sub = Subscriber(broker)
    env = {**flwr_env, **broker.node_env()}
    try:
        code, out, run_id = flwr_run(env, tmp_path / "runs", "federation.rounds=2 train.epochs=1 " + _overrides(broker))
        assert code == 0 and run_id, out[-4000:]
        assert run_status(env, run_id)["status"] == "finished:completed", out[-4000:]
        (summary,) = (tmp_path / "runs").rglob("summary.json")
        run = summary.parent.name
        sub.wait_for(lambda: any(p["state"] == "completed" for p in sub.of(f"runs/{run}/state")))
    finally:
        sub.close()
    nodes = {t.split("/")[3] for t, p, _ in sub.messages if "/nodes/" in t and p["run"] == run}
    assert len(nodes) == 3, sub.messages
    assert sum(1 for t, p, _ in sub.messages if "/nodes/" in t and p["state"] == "finished") == 6


def test_a_site_writes_only_its_own_logins_node_topics(broker):
    """Issue 48, finding 10: the shipped ACL (docker/monitoring/mosquitto.acl, which LocalBroker
    runs with) lets a login write `fedgpu/nodes/<its login>/<node>/tasks` and nothing else: not
    another login's node topics, not the old `fedgpu/nodes/<node>/tasks`, no deeper or shorter
    topic, no run topic. What a watcher receives is what the broker let through."""
    sub = Subscriber(broker)
    site = paho_client(broker.login("node"), "test-site")
    site.connect("127.0.0.1", broker.port)
    site.loop_start()
    refused = [
        "fedgpu/nodes/site-b/7/tasks",
        "fedgpu/nodes/7/tasks",
        "fedgpu/nodes/node/7/tasks/more",
        "fedgpu/nodes/node/7",
        "fedgpu/nodes/node",
        "fedgpu/runs/r1/state",
    ]
    try:
        for topic in [*refused, "fedgpu/nodes/node/7/tasks"]:  # one client's messages reach the broker in order
            site.publish(topic, json.dumps({"v": VERSION, "topic": topic}), qos=1).wait_for_publish(timeout=30)
        sub.wait_for(lambda: sub.of("/nodes/node/7/tasks"), timeout=30)
    finally:
        site.loop_stop()
        site.disconnect()
        sub.close()
    assert [t for t, _, _ in sub.messages] == ["fedgpu/nodes/node/7/tasks"]


def test_the_channel_publishes_standard_json(broker):
    """A diverged loss (NaN) leaves as null: Python's json would write a bare NaN, which strict
    consumers (a browser's JSON.parse, the live page's feed) refuse, losing the whole message."""
    sub = Subscriber(broker)
    channel = Channel(broker.login("server"), "test-srv")
    try:
        channel.publish("fedgpu/runs/r1/rounds", payload(run="r1", event="ended", row={"loss": float("nan")}))
        sub.wait_for(lambda: sub.of("runs/r1/rounds"), timeout=30)
    finally:
        channel.close(5.0)
        sub.close()
    assert sub.of("runs/r1/rounds")[0]["row"] == {"loss": None}
