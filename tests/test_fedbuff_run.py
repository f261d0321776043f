"""FedBuff end to end with the real ClientApp on concurrent in-process nodes:
stragglers, the staleness bound, vanished and crashing nodes, stopping rules, resume."""

from __future__ import annotations

import json
import math
import threading

import pytest
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from app.client_app import app as client_app
from app.config.compose import load_config
from app.config.schema import ConfigError
from app.run.results import read_rows
from app.simulation.local_grid import InProcessGrid
from app.tools.in_process import run_in_process
from strategies.fedbuff import FedBuff
from strategies.staleness import staleness_fn

FAST = "strategy=fedbuff train.epochs=1 seed=5 "


@pytest.mark.parametrize("max_staleness", [3, 1000])
def test_a_slow_nodes_stale_updates_are_discarded_or_down_weighted_as_configured(tmp_path, max_staleness):
    """Partition 0 is slow: each of its replies arrives only after the three fast nodes have
    moved the model on by 12 more versions (buffer K = 1). The delay is counted in fast
    replies rather than slept (a real sleep races the fast nodes, which could finish all 40
    versions first), so the order is the same on any machine."""
    fast_replies, done = [0], threading.Condition()

    def tamper(node: int, reply):  # runs in the node's worker thread
        with done:
            if node != 1000:
                fast_replies[0] += 1
                done.notify_all()
                return reply
            target = fast_replies[0] + 12
            while fast_replies[0] < target:
                if not done.wait(timeout=5.0):  # no fast reply for 5 s: the run is over
                    break
            return reply

    summary, grid = run_in_process(
        FAST + f"strategy.buffer_size=1 strategy.max_staleness={max_staleness} federation.eval_every=20 "
        "federation.rounds=40",
        tmp_path,
        nodes=4,
        workers=4,
        tamper=tamper,
    )
    rows = read_rows(summary["run_dir"])
    assert summary["status"] == "completed" and [r["version"] for r in rows] == list(range(1, 41))
    assert grid.max_in_flight == 1  # never two tasks at one node
    applied = [u for r in rows for u in r["applied"]]
    for u in applied:  # weight = examples x (1 + tau)^-1/2, and never past the bound
        assert u["staleness"] <= max_staleness
        assert u["weight"] == pytest.approx(u["num_examples"] / math.sqrt(1 + u["staleness"]))
    slow = [u for u in applied if u["node_id"] == 1000]
    if max_staleness == 3:
        assert summary["fedbuff"]["discarded_stale"] >= 1 and not slow
        assert sum(r["num_discarded_stale"] for r in rows) == summary["fedbuff"]["discarded_stale"]
    else:
        assert summary["fedbuff"]["discarded_stale"] == 0
        assert slow and min(u["staleness"] for u in slow) > 3  # applied, and down-weighted


def test_a_node_that_vanishes_mid_run_does_not_stall_it(tmp_path):
    replies: dict[int, int] = {}
    grid_box: list[InProcessGrid] = []

    def tamper(node, reply):
        replies[node] = replies.get(node, 0) + 1
        if node == 1002 and replies[node] == 2:
            grid_box[0].kill(1002)  # gone right after training: this reply never arrives
        return reply

    grid = InProcessGrid(client_app, 4, tamper=tamper, workers=4)
    grid_box.append(grid)
    summary, _ = run_in_process(FAST + "strategy.buffer_size=2 federation.rounds=10", tmp_path, grid=grid)
    rows = read_rows(summary["run_dir"])
    assert summary["status"] == "completed" and summary["rounds_completed"] == 10
    failed = [f for r in rows for f in r["failed"]]
    assert any(f["node_id"] == 1002 and "Node Unavailable" in f["reason"] for f in failed)
    assert sum(m.metadata.dst_node_id == 1002 for m in grid.pushed) == 2  # no work sent after it left
    assert all(u["node_id"] != 1002 for r in rows[-3:] for u in r["applied"])


def test_crashing_tasks_are_counted_and_the_run_goes_on(tmp_path):
    summary, _ = run_in_process(
        FAST + "strategy.buffer_size=2 federation.rounds=8 stragglers=lognormal stragglers.dropout=0.3",
        tmp_path,
        nodes=4,
        workers=4,
    )
    rows = read_rows(summary["run_dir"])
    assert summary["status"] == "completed" and summary["rounds_completed"] == 8
    failed = [f for r in rows for f in r["failed"]]
    assert failed and all("dropped out" in f["reason"] and "fleet.completion_p" in f["reason"] for f in failed)


def test_fedbuff_resumes_from_its_version(tmp_path):
    first, _ = run_in_process(FAST + "federation.rounds=3 name=r", tmp_path, nodes=4, workers=0)
    resumed, _ = run_in_process(
        FAST + f"federation.rounds=5 name=r resume={tmp_path / 'r' / 'checkpoint.pt'}", tmp_path, nodes=4, workers=0
    )
    assert first["fedbuff"]["versions"] == 3
    assert resumed["fedbuff"]["versions"] == 5 and resumed["rounds_completed"] == 5
    assert [r["version"] for r in read_rows(resumed["run_dir"])] == [1, 2, 3, 4, 5]
    assert resumed["fedbuff"]["tasks_sent"] > first["fedbuff"]["tasks_sent"]


@pytest.mark.parametrize("strategy", ["fedavg", "fedbuff"])
def test_runs_stop_at_the_target_accuracy_or_the_wall_clock_budget(tmp_path, strategy):
    target, _ = run_in_process(
        f"strategy={strategy} federation.rounds=40 federation.target_accuracy=0.5 seed=5",
        tmp_path / "t",
        nodes=4,
        workers=4,
    )
    assert target["stop_reason"] == "target accuracy 0.5 reached"
    assert target["final_accuracy"] >= 0.5 and target["rounds_completed"] < 40
    budget, _ = run_in_process(
        f"strategy={strategy} federation.rounds=1000 federation.max_wall_time_s=2 seed=5",
        tmp_path / "b",
        nodes=4,
        workers=4,
    )
    assert budget["stop_reason"] == "wall-clock budget 2 s spent" and budget["rounds_completed"] < 1000
    assert budget["final_accuracy"] is not None


def test_a_fedbuff_budget_spent_before_the_first_version_still_reports_the_initial_model(tmp_path):
    """The budget is gone before the loop starts (set-up alone takes longer than 1 ms),
    whatever the machine's speed: nothing is applied, and the initial model is evaluated."""
    summary, _ = run_in_process(
        "strategy=fedbuff federation.rounds=10 federation.max_wall_time_s=0.001 seed=5", tmp_path, nodes=4, workers=4
    )
    assert summary["status"] == "completed" and summary["stop_reason"] == "wall-clock budget 0 s spent"
    assert summary["rounds_completed"] == 0 and summary["fedbuff"]["versions"] == 0
    assert 0.0 <= summary["final_accuracy"] <= 0.3  # an untrained 10-class model
    assert not (tmp_path / summary["run_dir"] / "metrics.jsonl").read_text()


def test_flower_style_start_runs_the_asynchronous_loop():
    """FedBuff.start keeps Flower's Strategy.start contract: N server updates, evaluate_fn each."""
    from app.protocol import to_client_record
    from app.task.data import data_spec, load_splits, spec_to_record
    from app.task.models import build_model

    cfg, _ = load_config("train.epochs=1")
    spec = data_spec(*load_splits(cfg.dataset, cfg.seed))
    grid = InProcessGrid(client_app, 3, workers=3)
    seen: list[int] = []
    try:
        result = FedBuff(buffer_size=2, staleness=staleness_fn("constant")).start(
            grid,
            ArrayRecord(build_model(cfg.model, spec).state_dict()),
            num_rounds=3,
            train_config=ConfigRecord({**to_client_record(cfg), **spec_to_record(spec)}),
            evaluate_fn=lambda v, arrays: seen.append(v) or MetricRecord({"v": v}),
        )
    finally:
        grid.close()
    assert seen == [1, 2, 3] and sorted(result.train_metrics_clientapp) == [1, 2, 3]
    assert result.train_metrics_clientapp[3]["num-examples"] > 0


@pytest.mark.parametrize(
    "overrides, match",
    [
        ("strategy=fedbuff federation.fraction_evaluate=0.5", "evaluates centrally"),
        ("strategy=fedbuff strategy.buffer_size=-1", "strategy.buffer_size"),
        ("strategy=fedbuff strategy.staleness_fn=linear", "strategy.staleness_fn"),
        ("strategy=fedbuff strategy.server_momentum=1.0", "strategy.server_momentum"),
        ("strategy=fedbuff strategy.buffer_aggregator=mode", "strategy.buffer_aggregator"),
        ("stragglers=fixed stragglers.factors=[0.5]", "stragglers.factors"),
        ("stragglers=lognormal stragglers.dropout=1.0", "stragglers.dropout"),
        ("federation.target_accuracy=1.5", "federation.target_accuracy"),
    ],
)
def test_bad_async_settings_are_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ("strategy.buffer_aggregator=krum strategy.num_byzantine=1 strategy.buffer_size=4", "too small for the robust"),
        ("strategy.buffer_aggregator=median strategy.buffer_size=5", "one update per node"),
    ],
)
def test_impossible_robust_buffers_are_refused_before_training(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        run_in_process(FAST + overrides, tmp_path, nodes=4, workers=0)


def test_robust_buffer_keeps_a_sign_flipping_node_out_of_an_asynchronous_run(tmp_path):
    """Multi-Krum over the buffer (f = 1, K = 5 of 6 nodes, one slot per node) with one
    node sending global - 10 x its update: the attacker is never selected and the
    model learns."""
    summary, _ = run_in_process(
        FAST + "strategy.buffer_aggregator=multikrum strategy.num_byzantine=1 strategy.num_selected=3 "
        "strategy.buffer_size=5 federation.rounds=12 attack=sign_flip attack.num_malicious=1",
        tmp_path,
        nodes=6,
        workers=6,
    )
    (attacker,) = summary["attack"]["malicious_partitions"]
    rows = read_rows(summary["run_dir"])
    assert summary["status"] == "completed" and len(rows) == 12
    bad = 1000 + attacker
    selected = {n for r in rows for n in r["robust"]["selected"]}
    assert bad not in selected and len(selected) >= 3
    assert any(bad in r["robust"]["excluded"] for r in rows)  # its updates arrived, and were left out
    assert all(u["node_id"] != bad for r in rows for u in r["applied"])
    assert summary["best_accuracy"] > 0.5  # learns (chance: 0.1); arrival order varies, so not the last version


def test_compare_runs_overlays_evaluated_rows_against_wall_time(tmp_path):
    from app.tools.compare_runs import main, read_curve

    for name, rows in {
        "sync": [{"round": 1, "accuracy": 0.5, "wall_time_s": 2.0}, {"round": 2, "accuracy": 0.8, "wall_time_s": 4.0}],
        "async": [
            {"round": 1, "version": 1, "accuracy": None, "wall_time_s": 0.5},
            {"round": 2, "version": 2, "accuracy": 0.7, "wall_time_s": 1.0},
        ],
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_curve(tmp_path / "async") == ([1.0], [2], [0.7])  # the unevaluated version is skipped
    out = tmp_path / "cmp.png"
    main([str(tmp_path / "sync"), str(tmp_path / "async"), "-o", str(out), "--target", "0.75"])
    assert out.stat().st_size > 10_000
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_curve(tmp_path / "nothing")
