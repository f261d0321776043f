"""Each attack changes exactly the malicious nodes' replies, in the documented way; the
server's cap on claimed example counts is exact and holds against inflate_weight."""

from __future__ import annotations

import math
import re

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

import app.client_app as client_module
import app.run.assemble as run_module
from app.client_app import app as client_app
from app.config.compose import load_config
from app.config.schema import ConfigError
from app.protocol import to_client_record
from app.run.factory import example_cap
from app.run.results import read_rows
from app.simulation.attacks import flip_labels, malicious_partitions
from app.task.data import DataSpec, load_splits, spec_to_record
from app.task.models import build_model
from app.tools.in_process import run_in_process
from strategies.partitions import PartitionBinding
from tests.helpers import context_for

NODES = 5
SPEC = DataSpec((1, 8, 8), 10)


Replies = tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], list[float]]


def _replies(overrides: str) -> Replies:
    """The global model, and every node's reply state and num-examples for one training round."""
    cfg, _ = load_config(f"train.epochs=1 seed=11 {overrides}")
    torch.manual_seed(0)
    global_state = build_model(cfg.model, SPEC).state_dict()
    config = ConfigRecord({**to_client_record(cfg), **spec_to_record(SPEC), "server-round": 1})
    states, counts = [], []
    for pid in range(NODES):
        ins = Message(
            RecordDict({"arrays": ArrayRecord(global_state), "config": config}),
            dst_node_id=pid + 1,
            message_type="train",
        )
        ins.metadata.__dict__["_message_id"] = f"m{pid}"
        reply = client_app(ins, context_for(pid, NODES))
        assert reply.content["metrics"]["partition-id"] == pid
        counts.append(reply.content["metrics"]["num-examples"])
        states.append(reply.content["arrays"].to_torch_state_dict())
    return global_state, states, counts


@pytest.fixture(scope="module")
def honest():
    return _replies("attack=none")


def test_malicious_nodes_are_a_seeded_draw():
    assert malicious_partitions(11, 10, 3) == malicious_partitions(11, 10, 3)
    assert malicious_partitions(11, 10, 3) != malicious_partitions(12, 10, 3)
    assert len(set(malicious_partitions(11, 10, 3))) == 3
    with pytest.raises(ValueError, match="exceeds the 4 nodes"):
        malicious_partitions(0, 4, 5)


@pytest.mark.parametrize("attack", ["sign_flip", "scale", "gaussian", "label_flip", "inflate_weight"])
def test_attack_changes_exactly_the_malicious_replies(honest, attack):
    global_state, clean, clean_counts = honest
    scale = 3.0
    claim = " attack.claimed_examples=1e300" if attack == "inflate_weight" else ""
    _, attacked, counts = _replies(f"attack={attack} attack.num_malicious=2 attack.scale={scale}{claim}")
    bad = malicious_partitions(11, NODES, 2)
    for pid in range(NODES):
        assert counts[pid] == (1e300 if pid in bad and attack == "inflate_weight" else clean_counts[pid])
    for pid in range(NODES):
        for key, g in global_state.items():
            h, a = clean[pid][key], attacked[pid][key]
            if pid not in bad or not g.is_floating_point():
                assert torch.equal(h, a), f"{attack}: honest node {pid} changed in {key}"
            elif attack in ("sign_flip", "inflate_weight"):
                torch.testing.assert_close(a, g - scale * (h - g))
            elif attack == "scale":
                torch.testing.assert_close(a, g + scale * (h - g))
            elif attack == "gaussian" and g.numel() > 1000:
                noise = a - g
                assert abs(float(noise.std()) - scale) < 0.1 * scale and abs(float(noise.mean())) < 0.1 * scale
            elif attack == "label_flip":
                assert not torch.equal(h, a)


def test_label_flip_trains_on_flipped_labels(monkeypatch):
    seen: dict[int, torch.Tensor] = {}
    real_train = client_module.train

    def spy(model, data, cfg, precision, seed, scaler_state=None, task=None, **kwargs):
        seen[len(seen)] = data.y.clone()
        return real_train(model, data, cfg, precision, seed, scaler_state, task, **kwargs)

    monkeypatch.setattr(client_module, "train", spy)
    _replies("attack=none")
    honest_labels = dict(seen)
    seen.clear()
    _replies("attack=label_flip attack.num_malicious=2")
    bad = malicious_partitions(11, NODES, 2)
    for pid in range(NODES):
        expected = flip_labels(honest_labels[pid], 10) if pid in bad else honest_labels[pid]
        assert torch.equal(seen[pid], expected)


# --- the server's cap on claimed counts -----------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            "federation.max_examples_per_node=0",
            "federation.max_examples_per_node=0 is invalid: must be an integer >= 1",
        ),
        ("federation.max_examples_per_node=inf", "federation.max_examples_per_node: Value 'inf'"),
        (
            "attack=inflate_weight attack.claimed_examples=inf",
            "attack.claimed_examples=inf is invalid: must be a finite",
        ),
        ("attack=inflate_weight attack.claimed_examples=0", "attack.claimed_examples=0.0 is invalid"),
    ],
)
def test_bad_cap_and_claim_settings_name_their_key(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(overrides)


def test_the_cap_defaults_to_max_examples_per_node_for_nodes_without_a_partition():
    cfg, _ = load_config("federation.max_examples_per_node=300")
    cap = example_cap(cfg, load_splits(cfg.dataset, cfg.seed)[0].labels, PartitionBinding(NODES))
    assert cap(7, MetricRecord({"num-examples": 10**6}), MessageType.TRAIN) == 300  # a deployed node
    assert cap(8, MetricRecord({"partition-id": 0}), MessageType.TRAIN) < 300  # a simulated one: its partition


@pytest.mark.parametrize("partition", ["partition=iid", "partition=dirichlet dataset.val_fraction=0.3"])
def test_the_cap_is_exactly_the_count_an_honest_clientapp_reports(partition):
    """In simulation the server caps a node's num-examples at its partition's training
    (validation) part: computed on the server, it must equal what the ClientApp reports."""
    cfg, _ = load_config(f"train.epochs=1 seed=5 {partition}")
    spec = DataSpec((1, 8, 8), 10)
    cap = example_cap(cfg, load_splits(cfg.dataset, cfg.seed)[0].labels, PartitionBinding(NODES))
    config = ConfigRecord({**to_client_record(cfg), **spec_to_record(spec), "server-round": 1})
    global_state = build_model(cfg.model, spec).state_dict()
    for kind in (MessageType.TRAIN, MessageType.EVALUATE):
        for pid in range(NODES):
            ins = Message(RecordDict({"arrays": ArrayRecord(global_state), "config": config}), pid + 1, kind)
            ins.metadata.__dict__["_message_id"] = f"{kind}{pid}"
            metrics = client_app(ins, context_for(pid, NODES)).content["metrics"]
            assert cap(1000 + pid, metrics, kind) == metrics["num-examples"] > 0


def _attacked_run(tmp_path, overrides: str, rounds: int) -> tuple[list[float], list[dict]]:
    summary, _ = run_in_process(
        # the earlier recipe (3 epochs at lr 0.05): 12 rounds of it are enough here, in 3/5 of the time
        f"{overrides} attack.num_malicious=1 federation.rounds={rounds} seed=7 train.epochs=3 train.lr=0.05",
        tmp_path,
        nodes=NODES,
    )
    rows = read_rows(summary["run_dir"])
    return [r["accuracy"] for r in rows], rows


def test_inflated_counts_leave_capped_fedavg_and_multikrum_near_the_clean_run(tmp_path, monkeypatch):
    """1 of 5 nodes sends global − 0.1·Δ and claims 1e9 examples. Capped at its partition
    size, FedAvg and Multi-Krum end within 2 points of the clean run (mean of the last 3
    rounds: one round swings by a point or two); uncapped, FedAvg never learns."""
    rounds = 12
    clean, _ = _attacked_run(tmp_path / "clean", "attack=none", rounds)
    capped, rows = _attacked_run(tmp_path / "fedavg", "attack=inflate_weight", rounds)
    multikrum, _ = _attacked_run(
        tmp_path / "multikrum",
        "strategy=multikrum strategy.num_byzantine=1 strategy.num_selected=3 attack=inflate_weight",
        rounds,
    )
    (bad,) = malicious_partitions(7, NODES, 1)
    used = {"node_id": 1000 + bad, "claimed": 1e9, "weight": pytest.approx(250, abs=10)}  # its partition's size
    assert all(r["capped_weights"] == [used] for r in rows)
    tail = lambda curve: sum(curve[-3:]) / 3  # noqa: E731
    assert tail(capped) >= tail(clean) - 0.02 and tail(multikrum) >= tail(clean) - 0.02
    monkeypatch.setattr(run_module, "example_cap", lambda *args: lambda node, metrics, kind: math.inf)
    uncapped, _ = _attacked_run(tmp_path / "uncapped", "attack=inflate_weight", 4)
    assert max(uncapped) < 0.3 < clean[3]
