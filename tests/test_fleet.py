"""Fleet profiles on the virtual clock (app/simulation/fleet.py, virtual_clock.py): hand-computed
timelines for FedBuff and for synchronous rounds with a timeout, availability traces, drop-outs,
determinism whatever the number of workers, and refusals."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from app.client_app import app as client_app
from app.config.compose import load_config
from app.config.schema import ConfigError, FleetConfig, StragglersConfig
from app.ledger.chain import model_digest
from app.run.factory import partition_sizes
from app.run.results import read_rows
from app.simulation.fleet import fleet_of, fleet_profiles, short_form
from app.simulation.local_grid import InProcessGrid
from app.task.data import load_splits
from app.tools.in_process import run_in_process

# Digits split in three: 479 examples a partition, the same training part for each, so with the
# reference device at that many examples per second a task takes 1 s times the node's slowdown.
# Links so fast that transfers take under a microsecond.
LINKS = "fleet.downlink_mbps=[1e9] fleet.uplink_mbps=[1e9] fleet.latency_ms=[0]"


def _train_size() -> int:
    cfg, _ = load_config("")
    train, _ = load_splits(cfg.dataset, cfg.seed)
    sizes = {partition_sizes(cfg, train.labels, 3)(p)[0] for p in range(3)}
    (size,) = sizes  # equal partitions: the timelines below depend on it
    return size


def _fleet(factors: str, extra: str = "") -> str:
    return (
        f"fleet=lognormal fleet.speed=fixed fleet.factors={factors} fleet.reference_samples_per_s={_train_size()} "
        f"{LINKS} train.epochs=1 seed=3 {extra}"
    )


def test_fedbuff_follows_the_hand_computed_timeline(tmp_path: Path) -> None:
    """Nodes take 1, 2.7 and 6.5 s a task, buffer K = 1. All start at t=0 on version 0:
    t=1 A(v0) -> v1; A restarts on v1.   t=2 A(v1) -> v2; A on v2.
    t=2.7 B(v0) -> v3, staleness 2; B restarts on v3.   t=3 A(v2) -> v4, staleness 1; A on v4.
    t=4 A(v4) -> v5; A on v5.   t=5 A(v5) -> v6; A on v6.   t=5.4 B(v3) -> v7, staleness 3.
    t=6 A(v6) -> v8, staleness 1.   C (6.5 s) never arrives before the end."""
    summary, grid = run_in_process(
        _fleet("[1.0,2.7,6.5]", "strategy=fedbuff strategy.buffer_size=1 federation.rounds=8 federation.eval_every=8"),
        tmp_path,
        nodes=3,
        workers=3,
    )
    rows = read_rows(summary["run_dir"])
    applied = [(r["version"], u["node_id"] - 1000, u["staleness"]) for r in rows for u in r["applied"]]
    assert applied == [(1, 0, 0), (2, 0, 0), (3, 1, 2), (4, 0, 1), (5, 0, 0), (6, 0, 0), (7, 1, 3), (8, 0, 1)]
    times = [r["sim_time_s"] for r in rows]
    assert times == pytest.approx([1, 2, 2.7, 3, 4, 5, 5.4, 6], abs=1e-4)
    assert grid.max_in_flight == 1  # never two tasks at one node


def test_sync_rounds_end_at_the_slowest_reply_or_at_the_simulated_timeout(tmp_path: Path) -> None:
    """Nodes take 1, 2.7 and 6.5 s. Timeout 7 s: each round ends when C's reply lands, 6.5 s in.
    Timeout 5 s: C misses round 1, which ends at t=5; C is still busy until 6.5, so its round-2
    task ends at 13, past round 2's timeout at 10: missing again."""
    slow, _ = run_in_process(_fleet("[1.0,2.7,6.5]", "federation.rounds=2 federation.round_timeout_s=7"), tmp_path)
    rows = read_rows(slow["run_dir"])
    assert [r["sim_time_s"] for r in rows] == pytest.approx([6.5, 13.0], abs=1e-4)
    assert [r["num_clients"] for r in rows] == [3, 3]

    cut, _ = run_in_process(_fleet("[1.0,2.7,6.5]", "federation.rounds=2 federation.round_timeout_s=5"), tmp_path)
    rows = read_rows(cut["run_dir"])
    assert [r["sim_time_s"] for r in rows] == pytest.approx([5.0, 10.0], abs=1e-4)
    assert [(r["num_clients"], r["num_missing"]) for r in rows] == [(2, 1), (2, 1)]


def test_a_node_offline_in_the_trace_gets_no_work_and_fails_the_task_it_was_on(tmp_path: Path) -> None:
    """B (3 s a task) goes offline at t=2 until t=10: its round-1 task fails at t=2, which ends
    round 1; rounds starting before t=10 go to A and C (1 s each); then B is back."""
    trace = tmp_path / "trace.csv"
    trace.write_text("partition,offline_from_s,offline_until_s\n1,2,10\n")
    summary, grid = run_in_process(
        _fleet("[1.0,3.0,1.0]", f"federation.rounds=11 fleet.availability=trace fleet.trace={trace}"), tmp_path
    )
    rows = read_rows(summary["run_dir"])
    assert rows[0]["sim_time_s"] == pytest.approx(2.0, abs=1e-4)
    (failure,) = rows[0]["rejected"]
    assert failure["node_id"] == 1001 and "went offline at t=2.0" in failure["reason"]
    starts = [0.0] + [r["sim_time_s"] for r in rows[:-1]]
    for start, row in zip(starts, rows, strict=True):
        assert row["num_sampled"] == (3 if start < 2 or start >= 10 else 2), (start, row)
    # Rounds 2-9 take 1 s each, from t=2 to t=10; rounds 10 and 11 wait for B, 3 s each.
    assert [r["sim_time_s"] for r in rows[-3:]] == pytest.approx([10.0, 13.0, 16.0], abs=1e-4)
    # B's ClientApp trained in rounds 10 and 11 only: its round-1 task was never run, as it left first.
    assert sum(m.metadata.dst_node_id == 1001 and m.metadata.message_type == "train" for m in grid.pushed) == 2


@pytest.mark.parametrize("strategy", ["fedavg", "fedbuff strategy.buffer_size=3"])
def test_the_same_seed_gives_the_same_run_whatever_the_number_of_workers(tmp_path: Path, strategy: str) -> None:
    """Lognormal speeds, drop-outs, slow links: one worker or four give the same versions,
    staleness values, failures and final model."""
    overrides = (
        f"strategy={strategy} fleet=devices fleet.availability=bernoulli fleet.completion_p=0.8 "
        "federation.rounds=6 train.epochs=1 seed=11"
    )
    runs = []
    for workers in (1, 4):
        summary, _ = run_in_process(overrides + f" name=w{workers}", tmp_path, nodes=6, workers=workers)
        rows = read_rows(summary["run_dir"])
        keep = ("sim_time_s", "accuracy", "applied", "staleness", "num_clients", "rejected", "failed")
        import torch

        digest = model_digest(torch.load(summary["final_model"], weights_only=True))
        runs.append(([{k: r.get(k) for k in keep} for r in rows], digest))
    assert runs[0] == runs[1]
    assert any(r["failed"] or r["rejected"] for r in runs[0][0])  # some drop-outs happened


# Four threads parse at once while a garbage-collector callback hands the GIL over mid-parse,
# as numpy's header reads and torch's imports do in node threads. On CPython 3.11 this raises
# "AST constructor recursion depth mismatch" within a second unless the grid serialises parsing.
_PARSE_RACE = textwrap.dedent(
    """
    import ast, gc, sys, threading, time
    if sys.argv[1] == "grid":
        from app.client_app import app
        from app.simulation.local_grid import InProcessGrid
        InProcessGrid(app, 2, workers=2).close()
    source = "[" * 30 + "1" + "]" * 30 + "+" + "+".join(f"f(x{i})" for i in range(200))
    errors = []
    gc.callbacks.append(lambda phase, info: time.sleep(0))
    gc.set_threshold(50, 1, 1)
    def parse():
        for _ in range(60):
            try:
                ast.parse(source)
            except SystemError as err:
                errors.append(err)
                return
    threads = [threading.Thread(target=parse) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(len(errors), errors[:1])
    """
)


def test_concurrent_node_threads_parse_one_at_a_time() -> None:
    """The CI failure behind this: node 1002's training raised that SystemError in one run of
    four workers and not in the one-worker run, so the two runs differed."""
    out = subprocess.run(
        [sys.executable, "-c", _PARSE_RACE, "grid"], capture_output=True, text=True, timeout=600, check=True
    ).stdout
    assert out.startswith("0 "), out


def test_stragglers_are_the_short_form_of_a_fleet() -> None:
    assert fleet_of(FleetConfig(), StragglersConfig()) is None  # real time
    fixed = fleet_of(FleetConfig(), StragglersConfig(name="fixed", factors=[5.0, 2.0], dropout=0.25))
    assert fixed is not None and (fixed.speed, fixed.availability, fixed.completion_p) == ("fixed", "bernoulli", 0.75)
    speeds = [p.samples_per_s for p in fleet_profiles(fixed, 4, seed=1)]
    assert speeds == [400.0, 1000.0, 2000.0, 2000.0]  # the reference 2000 examples/s over the slowdowns
    logn = short_form(StragglersConfig(name="lognormal", sigma=1.0))
    a, b = fleet_profiles(logn, 50, seed=1), fleet_profiles(logn, 50, seed=2)
    slowdowns = np.array([2000.0 / p.samples_per_s for p in a])
    assert a == fleet_profiles(logn, 50, seed=1) and a != b
    assert slowdowns.min() == pytest.approx(1.0) and 0.7 < np.log(slowdowns).std() < 1.3


def test_device_classes_and_links_come_from_the_profile() -> None:
    cfg = FleetConfig(name="x", speed="devices", devices=["rtx4090", "t4", "mine"], device_speeds={"mine": 0.5})
    cfg.downlink_mbps, cfg.uplink_mbps, cfg.latency_ms = [80.0, 8.0], [8.0], [10.0, 20.0, 30.0]
    profiles = fleet_profiles(cfg, 4, seed=0)
    assert [p.samples_per_s for p in profiles] == [2000.0, 400.0, 1000.0, 2000.0]
    assert [p.downlink_bps for p in profiles] == [10e6, 1e6, 10e6, 1e6]  # Mbit/s -> bytes/s, cycled
    assert [p.latency_s for p in profiles] == pytest.approx([0.01, 0.02, 0.03, 0.01])
    with pytest.raises(ConfigError, match="unknown device class"):
        fleet_profiles(FleetConfig(name="x", speed="devices", devices=["abacus"]), 2, seed=0)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ("fleet=lognormal stragglers=fixed", "short form of a fleet profile"),
        ("fleet=lognormal fleet.speed=warp", "fleet.speed"),
        ("fleet=lognormal fleet.completion_p=0", "fleet.completion_p"),
        ("fleet=lognormal fleet.uplink_mbps=[]", "fleet.uplink_mbps"),
        ("fleet=lognormal fleet.availability=trace", "needs a CSV file"),
        ("fleet=devices fleet.devices=[]", "fleet.devices"),
    ],
)
def test_impossible_fleets_are_refused(overrides: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(overrides)


def test_a_bad_trace_or_a_deployed_node_stops_the_run_before_training(tmp_path: Path) -> None:
    bad = tmp_path / "trace.csv"
    bad.write_text("partition,from,until\n0,1,2\n")
    with pytest.raises(ConfigError, match="line 2: expected the columns partition,offline_from_s"):
        run_in_process(f"fleet=lognormal fleet.availability=trace fleet.trace={bad}", tmp_path)
    grid = InProcessGrid(client_app, 3)
    grid.contexts[1002].node_config = {"data-path": str(tmp_path / "site.npz")}  # a deployed node
    with pytest.raises(ConfigError, match="node 1002 is not a simulated node"):
        run_in_process("stragglers=lognormal", tmp_path, grid=grid)
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_links_can_come_from_a_distribution() -> None:
    cfg = FleetConfig(name="x", link_sigma=1.0)
    cfg.uplink_mbps, cfg.downlink_mbps, cfg.latency_ms = [8.0], [80.0], [10.0]
    a = fleet_profiles(cfg, 200, seed=0)
    assert a == fleet_profiles(cfg, 200, seed=0) != fleet_profiles(cfg, 200, seed=1)
    factors = np.array([p.uplink_bps / 1e6 for p in a])  # 8 Mbit/s = 1e6 bytes/s, times exp(z)
    assert 0.8 < np.log(factors).std() < 1.2 and abs(np.log(factors).mean()) < 0.2
    for p in a:  # one factor per partition: both directions scaled alike, the latency inversely
        assert p.downlink_bps / p.uplink_bps == pytest.approx(10.0)
        assert p.latency_s * p.uplink_bps / 1e6 == pytest.approx(0.01)


def test_a_resumed_fleet_run_continues_its_clock(tmp_path: Path) -> None:
    overrides = _fleet("[1.0,2.7,6.5]", "name=r")
    first, _ = run_in_process(overrides + " federation.rounds=2", tmp_path)
    resumed, _ = run_in_process(overrides + f" federation.rounds=3 resume={tmp_path / 'r' / 'checkpoint.pt'}", tmp_path)
    rows = read_rows(resumed["run_dir"])
    assert [r["sim_time_s"] for r in rows] == pytest.approx([6.5, 13.0, 19.5], abs=1e-4)
