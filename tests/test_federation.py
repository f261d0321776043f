"""The ServerApp's round loop end to end with an in-process grid (fast, deterministic)."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from app.client_app import app as client_app
from app.config.compose import load_config
from app.protocol import to_client_record
from app.run.results import read_rows
from app.simulation.local_grid import InProcessGrid
from app.task.data import DataSpec, spec_to_record
from app.tools.in_process import run_in_process
from tests.helpers import context_for, reply_to_same_task

FAST = "federation.rounds={rounds} train.epochs=2 seed=3"


def test_small_federation_learns_and_writes_all_results(tmp_path):
    summary = run_in_process(FAST.format(rounds=3) + " name=demo", tmp_path)[0]
    run_dir = tmp_path / "demo"
    assert summary["run_dir"] == str(run_dir)
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3
    assert summary["final_accuracy"] > 0.5  # chance is 0.1
    assert summary["best_accuracy"] >= summary["final_accuracy"]
    rows = read_rows(summary["run_dir"])
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert {"round", "accuracy", "loss", "wall_time_s", "num_clients", "num_rejected"} <= row.keys()
        assert row["num_clients"] == 3 and row["num_rejected"] == 0
        assert row["train"]["num-examples"] > 0 and row["train"]["gpu-telemetry"] == 0.0
    assert rows[0]["wall_time_s"] < rows[-1]["wall_time_s"]
    for row in rows:  # 3 tasks and 3 replies of one model's size each round
        assert row["bytes_down_total"] == 3 * row["bytes_down"] and row["bytes_up_total"] == 3 * row["bytes_up"]
    assert summary["bytes_up_total"] == sum(r["bytes_up_total"] for r in rows) > 0
    assert summary["bytes_down_total"] == sum(r["bytes_down_total"] for r in rows) > 0
    for name in ("config.yaml", "summary.json", "curves.png", "model_final.pt", "checkpoint.pt"):
        assert (run_dir / name).is_file(), name
    assert "rounds: 3" in (run_dir / "config.yaml").read_text()
    final = torch.load(run_dir / "model_final.pt", weights_only=True)
    assert "net.0.weight" in final


def test_resume_gives_the_same_rounds_and_model_as_an_uninterrupted_run(tmp_path):
    # a constant lr: the stop is made by running 2 of 4 rounds, and the default cosine is laid
    # over the planned rounds (a crashed run resumed with its own command keeps them)
    fast = FAST + " train.lr_schedule=constant"
    whole = run_in_process(fast.format(rounds=4) + " name=whole", tmp_path / "a")[0]
    first = run_in_process(fast.format(rounds=2) + " name=part", tmp_path / "b")[0]
    checkpoint = tmp_path / "b" / "part" / "checkpoint.pt"
    resumed = run_in_process(fast.format(rounds=4) + f" name=part resume={checkpoint}", tmp_path / "b")[0]
    assert first["rounds_completed"] == 2
    assert resumed["rounds_completed"] == whole["rounds_completed"] == 4
    assert [r["round"] for r in read_rows(resumed["run_dir"])] == [1, 2, 3, 4]
    a = torch.load(tmp_path / "a" / "whole" / "model_final.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "part" / "model_final.pt", weights_only=True)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6)
    assert resumed["final_accuracy"] == pytest.approx(whole["final_accuracy"])


def test_resume_auto_starts_a_named_run_then_continues_it(tmp_path):
    """The same command twice: first a new run (also when a crash left an empty run
    directory behind), then, after a crash, a continuation from its checkpoint."""
    (tmp_path / "auto").mkdir()  # died before its first checkpoint
    first = run_in_process(FAST.format(rounds=2) + " name=auto resume=auto", tmp_path)[0]
    assert first["rounds_completed"] == 2 and [r["round"] for r in read_rows(first["run_dir"])] == [1, 2]
    resumed = run_in_process(FAST.format(rounds=3) + " name=auto resume=auto", tmp_path)[0]
    assert resumed["run_dir"] == first["run_dir"] and [r["round"] for r in read_rows(resumed["run_dir"])] == [1, 2, 3]


def test_a_node_that_vanishes_mid_round_is_named_in_the_rejections(tmp_path):
    """Its task comes back as the SuperLink's NODE_UNAVAILABLE error (sent from the SuperLink's
    own node id); the round goes on with the others and the row names the vanished node."""
    grid_box: list[InProcessGrid] = []

    def tamper(node_id: int, reply: Message) -> Message:
        calls[node_id] = calls.get(node_id, 0) + 1
        if node_id == 1002 and calls[node_id] == 2:  # its round-2 training, right before its reply
            grid_box[0].kill(node_id)
        return reply

    calls: dict[int, int] = {}
    grid = InProcessGrid(client_app, 3, tamper=tamper)
    grid_box.append(grid)
    summary, _ = run_in_process(FAST.format(rounds=3), tmp_path, grid=grid)
    rows = read_rows(summary["run_dir"])
    assert summary["status"] == "completed" and [r["num_clients"] for r in rows] == [3, 2, 2]
    (rejected,) = rows[1]["rejected"]
    assert rejected["node_id"] == 1002 and "Node Unavailable" in rejected["reason"], rejected
    assert rows[2]["num_sampled"] == 2  # gone from the node list afterwards


def test_resume_past_the_last_round_is_refused(tmp_path):
    from app.config.schema import ConfigError

    run_in_process(FAST.format(rounds=1) + " name=r", tmp_path)
    with pytest.raises(ConfigError, match="already reached federation.rounds=1"):
        run_in_process(FAST.format(rounds=1) + f" resume={tmp_path / 'r' / 'checkpoint.pt'}", tmp_path)


def test_malicious_and_broken_nodes_are_rejected_and_logged(tmp_path):
    def tamper(node_id: int, reply: Message) -> Message:
        if node_id == 1000:  # NaN weights
            arrays = reply.content["arrays"]
            poisoned = {
                k: np.full(a.shape, np.nan, dtype=a.dtype) for k, a in ((k, v.numpy()) for k, v in arrays.items())
            }
            return Message(
                RecordDict(
                    {
                        "arrays": ArrayRecord({k: Array(v) for k, v in poisoned.items()}),
                        "metrics": reply.content["metrics"],
                    }
                ),
                reply_to=reply_to_same_task(reply),
            )
        if node_id == 1001:  # claims no examples
            metrics = MetricRecord({**reply.content["metrics"], "num-examples": 0})
            return Message(
                RecordDict({"arrays": reply.content["arrays"], "metrics": metrics}), reply_to=reply_to_same_task(reply)
            )
        return reply

    summary = run_in_process(FAST.format(rounds=2), tmp_path, nodes=4, tamper=tamper)[0]
    for row in read_rows(summary["run_dir"]):
        assert row["num_clients"] == 2 and row["num_rejected"] == 2
        reasons = {r["node_id"]: r["reason"] for r in row["rejected"]}
        assert "non-finite" in reasons[1000] and "num-examples" in reasons[1001]
    assert summary["final_accuracy"] > 0.3


def test_round_without_valid_replies_keeps_the_model(tmp_path):
    # No reply ever comes (tamper -> None): as in deployment, each round ends at its timeout.
    overrides = FAST.format(rounds=2) + " federation.round_timeout_s=1"
    summary = run_in_process(overrides, tmp_path, nodes=2, tamper=lambda node, reply: None)[0]
    rows = read_rows(summary["run_dir"])
    assert all(r["num_clients"] == 0 and r["num_missing"] == 2 and not r["model_updated"] for r in rows)
    assert rows[0]["accuracy"] == rows[1]["accuracy"]  # the initial model, unchanged


def test_central_evaluation_every_n_rounds_and_always_the_last(tmp_path):
    summary = run_in_process(FAST.format(rounds=3) + " federation.eval_every=2", tmp_path)[0]
    rows = read_rows(summary["run_dir"])
    assert [r["accuracy"] is not None for r in rows] == [False, True, True]
    assert rows[0]["loss"] is None and rows[0]["num_clients"] == 3  # trained, not evaluated
    assert summary["final_accuracy"] == rows[-1]["accuracy"]


def test_federated_evaluation_on_client_validation_splits(tmp_path):
    summary = run_in_process(FAST.format(rounds=2) + " federation.fraction_evaluate=1.0", tmp_path)[0]
    rows = read_rows(summary["run_dir"])
    assert all(0.0 <= r["federated_eval"]["eval-accuracy"] <= 1.0 for r in rows)
    assert rows[-1]["federated_eval"]["num-examples"] > 0


def test_supernode_trains_on_its_own_data_path(tmp_path):
    """Deployment: a node's data-path replaces partition-id / num-partitions."""
    rng = np.random.default_rng(0)
    path = tmp_path / "site.npz"
    np.savez(path, x=rng.integers(0, 255, (50, 8, 8), dtype=np.uint8), y=rng.integers(0, 10, 50))
    cfg, _ = load_config("train.epochs=1")
    spec = DataSpec((1, 8, 8), 10)
    from app.task.models import build_model

    arrays = ArrayRecord(build_model(cfg.model, spec).state_dict())
    ins = Message(
        RecordDict(
            {
                "arrays": arrays,
                "config": ConfigRecord({**to_client_record(cfg), **spec_to_record(spec), "server-round": 1}),
            }
        ),
        dst_node_id=7,
        message_type="train",
    )
    ins.metadata.__dict__["_message_id"] = "x"
    reply = client_app(ins, context_for(0, 1, node_config={"data-path": str(path)}))
    assert reply.content["metrics"]["num-examples"] == 45  # 10% kept for validation
    bad = np.savez(tmp_path / "wrong.npz", x=np.zeros((10, 28, 28), np.uint8), y=np.zeros(10)) or tmp_path / "wrong.npz"
    with pytest.raises(Exception, match=r"examples are shaped \(1, 28, 28\), the global model expects \(1, 8, 8\)"):
        client_app(ins, context_for(0, 1, node_config={"data-path": str(bad)}))


def test_too_few_nodes_fails_clearly_before_any_results(tmp_path):
    from app.config.schema import ConfigError

    # A simulation's size is known: refused once the count settles, not after node_wait_timeout_s.
    with pytest.raises(ConfigError, match=r"min_available_nodes=3, but this simulation has 2 SuperNode\(s\)"):
        run_in_process("federation.min_available_nodes=3 federation.node_wait_timeout_s=120", tmp_path, nodes=2)
    with pytest.raises(ConfigError, match="partition.min_partition_size=1000"):
        run_in_process("partition=dirichlet partition.min_partition_size=1000", tmp_path, nodes=3)
    assert list(tmp_path.iterdir()) == []


class _DeployedGrid:
    """A deployment's grid, as far as the wait for nodes sees it: one node connected."""

    def get_node_ids(self) -> list[int]:
        return [7]


def test_a_deployment_waits_for_nodes_saying_how_long_and_which_key(caplog: pytest.LogCaptureFixture) -> None:
    from app.config.schema import ConfigError
    from app.run.assemble import wait_for_nodes as _wait_for_nodes

    with caplog.at_level(logging.INFO), pytest.raises(ConfigError, match=r"only 1 node\(s\) connected after 1 s"):
        _wait_for_nodes(_DeployedGrid(), 2, timeout_s=1.0, simulated=False)
    first = next(r.getMessage() for r in caplog.records if "waiting" in r.getMessage())
    assert re.fullmatch(
        r"waiting up to 1 s more \(federation.node_wait_timeout_s\) for nodes: 1 connected, "
        r"2 needed \(federation.min_available_nodes\)",
        first,
    ), first


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            "strategy=krum",
            "strategy.num_byzantine=2 needs n >= 2f+3 = 7 valid replies (n=5), but a round samples at most 5",
        ),
        (
            "strategy=multikrum strategy.num_byzantine=1 strategy.num_selected=5",
            "strategy.num_selected=5 must be <= n - f = 4",
        ),
        ("strategy=trimmed_mean strategy.trim_ratio=0.1 strategy.num_byzantine=1", "trims 0 per side"),
        ("federation.fraction_train=0.5 strategy=median strategy.num_byzantine=2", "n >= 2f+1 = 5"),
        ("attack=sign_flip attack.num_malicious=6", "attack.num_malicious=6 is invalid: only 5 nodes"),
    ],
)
def test_impossible_cohorts_are_refused_before_training(tmp_path, overrides, words):
    from app.config.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        run_in_process(overrides, tmp_path, nodes=5)
    assert words in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_krum_keeps_training_under_attack_and_logs_its_choices(tmp_path):
    summary = run_in_process(
        "strategy=krum strategy.num_byzantine=1 attack=sign_flip attack.num_malicious=1 federation.rounds=6 seed=3",
        tmp_path,
        nodes=5,
    )[0]
    bad = summary["attack"]["malicious_partitions"]
    assert len(bad) == 1
    for row in read_rows(summary["run_dir"]):
        robust = row["robust"]
        assert len(robust["selected"]) == 1 and len(robust["excluded"]) == 4
        assert set(robust["scores"]) == {str(n) for n in row["node_partitions"]}
        malicious_node = next(n for n, p in row["node_partitions"].items() if p in bad)
        assert int(malicious_node) not in robust["selected"]
    assert summary["final_accuracy"] > 0.6  # FedAvg under this attack ends near chance (0.1)


class _TrickleGrid:
    """Replies to one pushed message per pull, in reverse order; `silent` ids never reply."""

    def __init__(self, silent: int = 0) -> None:
        self.silent, self.pulls, self.waiting = silent, 0, []

    def push_messages(self, messages):  # noqa: ANN001, ANN202
        ids = [f"m{i}" for i, _ in enumerate(messages)]
        self.waiting = ids[self.silent :]
        return ids

    def pull_messages(self, ids):  # noqa: ANN001, ANN202
        self.pulls += 1
        assert set(self.waiting) <= set(ids), "an unanswered id was dropped from the pull"
        if not self.waiting:
            return []
        reply = Message(RecordDict(), dst_node_id=1, message_type="train")
        reply.metadata.__dict__["_reply_to_message_id"] = self.waiting.pop()
        return [reply]


def test_send_and_receive_collects_every_reply_and_stops_at_the_timeout():
    from app.run.federation import send_and_receive

    grid = _TrickleGrid()
    replies = send_and_receive(grid, [object()] * 4, timeout=None)
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0", "m1", "m2", "m3"]  # as sent, not as arrived
    assert grid.pulls == 4  # no pull after the last reply

    grid = _TrickleGrid(silent=1)  # m0 never answers: the deadline ends the wait with the rest
    replies = send_and_receive(grid, [object()] * 3, timeout=0.5)
    assert [r.metadata.reply_to_message_id for r in replies] == ["m1", "m2"]
    assert send_and_receive(_TrickleGrid(), [], timeout=None) == []
