"""Live Prometheus metrics (app/run/monitoring.py): what a scrape of /metrics returns equals the
rows and replies fed in, node labels stay bounded, gaps in a row keep the last values, the port
is freed on close, and the Grafana dashboard queries only metrics that exist."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.run.monitoring import Monitor

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "docker" / "monitoring"
NODES = (4011958123, 77, 9_223_372_036_854_775_001)  # node ids are uint64; labels are their decimal form
MIB = 2**20

ROUND_1 = {
    "round": 1,
    "accuracy": 0.5,
    "f1": 0.4,
    "loss": 1.25,
    "wall_time_s": 14.0,
    "round_time_s": 12.5,
    "num_sampled": 3,
    "num_clients": 3,
    "num_rejected": 1,
    "num_missing": 0,
    "bytes_down_total": 3_000_000,
    "bytes_up_total": 2_900_000,
    "train": {"train-loss": 1.5, "samples-per-s": 1000.0},
    "rejected": [{"node_id": 77, "reason": "bad-norm"}],  # a reply-provided string: never a label
}
ROUND_2 = {
    "round": 2,
    "accuracy": 0.75,
    "f1": 0.625,
    "loss": 0.5,
    "round_time_s": 45.0,
    "num_sampled": 3,
    "num_clients": 2,
    "num_rejected": 2,
    "num_missing": 1,
    "num_failed": 2,
    "num_discarded_stale": 1,
    "bytes_down_total": 3_000_000,
    "bytes_up_total": 1_900_000,
    "epsilon": 1.5,
    "train": {"train-loss": 0.75, "samples-per-s": 1200.0},
}


def _gpu(util: float, mem_mib: float, temp: float, power: float, sps: float) -> dict:
    return {
        "num-examples": 500,
        "gpu-telemetry": 1.0,
        "gpu-device-util-mean-pct": util,
        "gpu-device-util-max-pct": 100.0,
        "gpu-device-mem-used-max-mb": mem_mib,
        "gpu-device-temp-max-c": temp,
        "gpu-device-power-mean-w": power,
        "samples-per-s": sps,
        "wall-time-s": 3.5,
        "peak-memory-list": [1.0, 2.0],  # MetricRecord also holds lists: ignored
    }


REPLIES_1 = [
    (NODES[0], _gpu(55.0, 2048.0, 66.0, 210.5, 950.0)),
    (NODES[1], _gpu(80.0, 1536.5, 71.0, 300.0, 1100.0)),
    (NODES[2], {"num-examples": 400, "gpu-telemetry": 0.0, "samples-per-s": 700.0, "wall-time-s": 4.0}),  # a CPU node
]
REPLIES_2 = [  # NODES[2] does not reply in round 2
    (NODES[0], _gpu(60.0, 4096.0, 68.0, 220.0, 1000.0)),
    (NODES[1], _gpu(90.0, 1024.0, 75.0, 310.0, 1300.0)),
]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """(sample name, labels) -> value of a Prometheus text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse(response.read().decode())


def snapshot(monitor: Monitor) -> Samples:
    return parse(generate_latest(monitor.registry).decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def label_values(samples: Samples, name: str, label: str) -> set[str]:
    return {dict(labels)[label] for n, labels in samples if n == name}


@pytest.fixture
def monitor() -> Iterator[Monitor]:
    m = Monitor(["accuracy", "f1"])
    yield m
    m.close()


def test_scrape_equals_the_rows_and_replies(monitor: Monitor) -> None:
    port = monitor.start(0)
    assert port > 0
    t0 = time.time()
    monitor.observe(ROUND_1, REPLIES_1)
    t1 = time.time()
    first = scrape(port)
    assert value(first, "fedgpu_round") == 1
    assert not any(name == "fedgpu_privacy_epsilon" for name, _ in first), "no epsilon before a private row"
    monitor.observe(ROUND_2, REPLIES_2)
    t2 = time.time()
    s = scrape(port)

    # The latest round's values.
    assert value(s, "fedgpu_round") == 2
    assert value(s, "fedgpu_eval_metric", metric="accuracy") == 0.75
    assert value(s, "fedgpu_eval_metric", metric="f1") == 0.625
    assert label_values(s, "fedgpu_eval_metric", "metric") == {"accuracy", "f1"}
    assert value(s, "fedgpu_loss") == 0.5
    assert value(s, "fedgpu_last_round_duration_seconds") == 45.0
    assert value(s, "fedgpu_nodes_sampled") == 3
    assert value(s, "fedgpu_nodes_aggregated") == 2
    assert value(s, "fedgpu_privacy_epsilon") == 1.5
    assert value(s, "fedgpu_train_samples_per_second") == 1200.0
    assert value(s, "fedgpu_train_loss") == 0.75

    # Counters: summed over both rounds.
    assert value(s, "fedgpu_replies_rejected_total") == 3
    assert value(s, "fedgpu_replies_missing_total") == 1
    assert value(s, "fedgpu_replies_failed_total") == 2
    assert value(s, "fedgpu_replies_stale_total") == 1
    assert value(s, "fedgpu_downlink_bytes_total") == 6_000_000
    assert value(s, "fedgpu_uplink_bytes_total") == 4_800_000

    # The duration histogram: 12.5 s and 45 s.
    assert value(s, "fedgpu_round_duration_seconds_count") == 2
    assert value(s, "fedgpu_round_duration_seconds_sum") == 57.5
    buckets = {
        float(dict(labels)["le"]): v for (n, labels), v in s.items() if n == "fedgpu_round_duration_seconds_bucket"
    }
    assert (buckets[10.0], buckets[30.0], buckets[60.0], buckets[float("inf")]) == (0, 1, 2, 2)

    # Per node, in base units: ratio, bytes (the telemetry's "mb" is MiB), celsius, watts.
    a, b, c = (str(n) for n in NODES)
    assert label_values(s, "fedgpu_node_last_seen_timestamp_seconds", "node") == {a, b, c}
    assert value(s, "fedgpu_node_gpu_utilization_ratio", node=a) == pytest.approx(0.60)
    assert value(s, "fedgpu_node_gpu_utilization_ratio", node=b) == pytest.approx(0.90)
    assert value(s, "fedgpu_node_gpu_memory_used_bytes", node=a) == 4096 * MIB
    assert value(s, "fedgpu_node_gpu_memory_used_bytes", node=b) == 1024 * MIB
    assert value(s, "fedgpu_node_gpu_temperature_celsius", node=b) == 75.0
    assert value(s, "fedgpu_node_gpu_power_watts", node=a) == 220.0
    assert value(s, "fedgpu_node_samples_per_second", node=b) == 1300.0
    assert value(s, "fedgpu_node_train_duration_seconds", node=a) == 3.5
    # The CPU node reported no GPU values (no series, not zeros) and keeps its round-1 values.
    assert label_values(s, "fedgpu_node_gpu_utilization_ratio", "node") == {a, b}
    assert value(s, "fedgpu_node_samples_per_second", node=c) == 700.0
    assert value(s, "fedgpu_node_train_duration_seconds", node=c) == 4.0
    # Last seen: the time of the observe() that carried the node's latest reply.
    assert t0 <= value(s, "fedgpu_node_last_seen_timestamp_seconds", node=c) <= t1
    assert t1 <= value(s, "fedgpu_node_last_seen_timestamp_seconds", node=a) <= t2

    # Labels: only the configured metric names, node ids and histogram buckets.
    labels = {(k, v) for _, ls in s for k, v in ls}
    assert {k for k, _ in labels} == {"metric", "node", "le"}
    assert not any("bad-norm" in v for _, v in labels)


def test_node_labels_are_bounded() -> None:
    monitor = Monitor(["accuracy"], max_node_labels=2)
    replies = [(node, _gpu(50.0 + node, 1000.0, 60.0, 100.0, 10.0 * node)) for node in (11, 12, 13, 14)]
    monitor.observe({"round": 1}, replies)
    monitor.observe({"round": 2}, list(reversed(replies)))  # 11 and 12 keep their labels
    monitor.contribution(14, 0.25)  # folded too
    monitor.contribution(11, 0.5)
    s = snapshot(monitor)
    for name in (
        "fedgpu_node_last_seen_timestamp_seconds",
        "fedgpu_node_samples_per_second",
        "fedgpu_node_gpu_utilization_ratio",
        "fedgpu_node_gpu_memory_used_bytes",
        "fedgpu_node_gpu_temperature_celsius",
        "fedgpu_node_gpu_power_watts",
        "fedgpu_node_train_duration_seconds",
    ):
        assert label_values(s, name, "node") == {"11", "12", "other"}, name
    assert value(s, "fedgpu_node_samples_per_second", node="11") == 110.0
    assert value(s, "fedgpu_node_samples_per_second", node="other") == 130.0  # the latest folded reply's (node 13)
    assert label_values(s, "fedgpu_node_contribution", "node") == {"11", "other"}
    assert value(s, "fedgpu_node_contribution", node="11") == 0.5
    assert value(s, "fedgpu_node_contribution", node="other") == 0.25


def test_contribution_shares_the_node_bound() -> None:
    monitor = Monitor(["accuracy"], max_node_labels=1)
    monitor.contribution(5, 1.0)
    monitor.contribution(5, 2.5)  # cumulative: the ledger sets the running total
    monitor.observe({"round": 1}, [(6, {"samples-per-s": 3.0})])
    s = snapshot(monitor)
    assert value(s, "fedgpu_node_contribution", node="5") == 2.5
    assert label_values(s, "fedgpu_node_samples_per_second", "node") == {"other"}


def test_missing_and_none_values_keep_the_last_ones() -> None:
    monitor = Monitor(["accuracy"])
    monitor.observe({}, [])  # an empty row: nothing to update, no crash
    monitor.observe(ROUND_1, REPLIES_1)
    gap = {
        "round": 2,
        "accuracy": None,  # not evaluated this round
        "loss": None,
        "num_sampled": None,
        "num_rejected": None,
        "bytes_up_total": "n/a",  # not a number
        "train": None,
        "epsilon": None,
    }
    monitor.observe(gap, [(NODES[0], {"samples-per-s": None, "gpu-device-util-mean-pct": True, "num-examples": 3})])
    s = snapshot(monitor)
    assert value(s, "fedgpu_round") == 2
    assert value(s, "fedgpu_eval_metric", metric="accuracy") == 0.5
    assert value(s, "fedgpu_loss") == 1.25
    assert value(s, "fedgpu_last_round_duration_seconds") == 12.5
    assert value(s, "fedgpu_nodes_sampled") == 3
    assert value(s, "fedgpu_replies_rejected_total") == 1
    assert value(s, "fedgpu_uplink_bytes_total") == 2_900_000
    assert value(s, "fedgpu_train_samples_per_second") == 1000.0
    assert value(s, "fedgpu_round_duration_seconds_count") == 1
    assert value(s, "fedgpu_node_samples_per_second", node=str(NODES[0])) == 950.0
    assert value(s, "fedgpu_node_gpu_utilization_ratio", node=str(NODES[0])) == pytest.approx(0.55)
    names = {name for name, _ in s}
    assert "fedgpu_privacy_epsilon" not in names  # never set: absent, not 0
    # never in a row (a synchronous round; a private run's rows leave the counts out): absent, not 0
    assert "fedgpu_replies_failed_total" not in names


def test_close_frees_the_port() -> None:
    first = Monitor(["accuracy"])
    first.close()  # never started: nothing to do
    port = first.start(0)
    with pytest.raises(RuntimeError):
        first.start(0)
    first.observe({"round": 7}, [])
    assert value(scrape(port), "fedgpu_round") == 7
    first.close()
    first.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    second = Monitor(["accuracy"])
    try:
        assert second.start(port) == port
        second.observe({"round": 1}, [])
        assert value(scrape(port), "fedgpu_round") == 1
    finally:
        second.close()


def test_monitors_have_their_own_registries() -> None:
    one, two = Monitor(["accuracy"]), Monitor(["accuracy"])  # the same names twice: no clash
    one.observe({"round": 3, "num_rejected": 2}, [])
    two.observe({"round": 5}, [])
    assert value(snapshot(one), "fedgpu_round") == 3
    assert value(snapshot(two), "fedgpu_round") == 5
    assert "fedgpu_replies_rejected_total" not in {name for name, _ in snapshot(two)}
    assert not any(family.name.startswith("fedgpu_") for family in REGISTRY.collect())


def _dashboard_names() -> set[str]:
    exprs: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            exprs.extend(v for k, v in node.items() if k == "expr")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads((MONITORING / "grafana-dashboard.json").read_text()))
    return {name for expr in exprs for name in re.findall(r"fedgpu_[a-z_]+", expr)}


def test_dashboard_queries_existing_metrics_and_shows_them_all() -> None:
    monitor = Monitor(["accuracy"])
    monitor.observe(ROUND_2, REPLIES_1)
    monitor.contribution(NODES[0], 1.0)
    families = list(monitor.registry.collect())
    samples = {s.name for f in families for s in f.samples}
    histograms = {f.name for f in families if f.type == "histogram"}
    suffixed = {f"{h}{suffix}" for h in histograms for suffix in ("_bucket", "_sum", "_count")}
    queried = _dashboard_names()
    assert len(queried) >= 20, queried
    assert not queried - (samples | histograms | suffixed), "the dashboard queries metrics the monitor lacks"
    shown = {f.name for f in families if f.name in queried or any(x.name in queried for x in f.samples)}
    assert shown == {f.name for f in families}, "metrics without a panel"


def test_provisioning_points_at_the_serverapp_and_prometheus() -> None:
    scrape_config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"]
    assert [(c["job_name"], c["static_configs"][0]["targets"]) for c in scrape_config] == [
        ("fedgpu", ["serverapp:9400"])
    ]
    (source,) = yaml.safe_load((MONITORING / "grafana-datasource.yml").read_text())["datasources"]
    assert (source["type"], source["url"]) == ("prometheus", "http://prometheus:9090")
    panels = json.loads((MONITORING / "grafana-dashboard.json").read_text())["panels"]
    uids = {p["datasource"]["uid"] for p in panels if p["type"] != "row"}
    assert uids == {source["uid"]}


def test_a_running_federation_serves_its_rows(tmp_path: Path) -> None:
    """Scraped from inside round 2 (a node's reply hook), the endpoint holds round 1's row."""
    import socket

    from flwr.app import Message

    from app.client_app import app as client_app
    from app.run.results import read_rows
    from app.simulation.local_grid import InProcessGrid
    from app.tools.in_process import run_in_process

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scraped: list[Samples] = []

    def scrape_in_round_two(node_id: int, reply: Message) -> Message:
        calls.append(node_id)
        if len(calls) == 4:  # the first reply of round 2 (3 nodes a round)
            scraped.append(scrape(port))
        return reply

    calls: list[int] = []
    grid = InProcessGrid(client_app, 3, tamper=scrape_in_round_two)
    overrides = f"federation.rounds=2 train.epochs=1 monitoring.prometheus_port={port}"
    summary, _ = run_in_process(overrides, tmp_path, grid=grid)
    first = read_rows(summary["run_dir"])[0]
    (samples,) = scraped
    assert value(samples, "fedgpu_round") == 1
    assert value(samples, "fedgpu_eval_metric", metric="accuracy") == pytest.approx(first["accuracy"])
    assert value(samples, "fedgpu_uplink_bytes_total") == first["bytes_up_total"]
    assert value(samples, "fedgpu_nodes_aggregated") == first["num_clients"] == 3
    assert label_values(samples, "fedgpu_node_samples_per_second", "node") == {"1000", "1001", "1002"}
    with pytest.raises(urllib.error.URLError):  # the run closed its endpoint
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read().decode())


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A real Prometheus server (Debian's `prometheus` package; .ci/run installs it) on
    loopback, scraping a fedgpu endpoint every second: yields (its port, the target port)."""
    import shutil
    import subprocess

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no `prometheus` binary on PATH (CI installs Debian's package: .ci/run)")
    target, port = _free_port(), _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: fedgpu, static_configs: [{{targets: ['127.0.0.1:{target}']}}]}}]\n"
    )
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).close()
                break
            except (urllib.error.URLError, ConnectionError):
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"prometheus did not start: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
                time.sleep(0.2)
        yield port, target
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_a_real_prometheus_scrapes_a_running_federation(tmp_path: Path, prometheus: tuple[int, int]) -> None:
    """Paused inside round 2 (a node's reply hook) until a real Prometheus server has scraped
    round 1's row, its query API returns the accuracy series with that row's value."""
    from flwr.app import Message

    from app.client_app import app as client_app
    from app.run.results import read_rows
    from app.simulation.local_grid import InProcessGrid
    from app.tools.in_process import run_in_process

    port, target = prometheus
    query = f"http://127.0.0.1:{port}/api/v1/query?query=" + urllib.parse.quote('fedgpu_eval_metric{metric="accuracy"}')
    seen: list[dict] = []

    def wait_for_prometheus_in_round_two(node_id: int, reply: Message) -> Message:
        calls.append(node_id)
        if len(calls) == 4:  # the first reply of round 2 (3 nodes a round)
            deadline = time.monotonic() + 120  # Prometheus scrapes every second
            while not (result := _get_json(query)["data"]["result"]) and time.monotonic() < deadline:
                time.sleep(0.5)
            seen.extend(result)
        return reply

    calls: list[int] = []
    grid = InProcessGrid(client_app, 3, tamper=wait_for_prometheus_in_round_two)
    overrides = f"federation.rounds=2 train.epochs=1 monitoring.prometheus_port={target}"
    summary, _ = run_in_process(overrides, tmp_path / "runs", grid=grid)
    first = read_rows(summary["run_dir"])[0]
    (series,) = seen
    assert series["metric"]["job"] == "fedgpu" and series["metric"]["instance"] == f"127.0.0.1:{target}"
    assert float(series["value"][1]) == pytest.approx(first["accuracy"])
    targets = _get_json(f"http://127.0.0.1:{port}/api/v1/targets")["data"]["activeTargets"]
    assert [t["scrapeUrl"] for t in targets] == [f"http://127.0.0.1:{target}/metrics"]
