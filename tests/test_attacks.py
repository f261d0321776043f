"""Each attack changes exactly the malicious nodes' replies, in the documented way."""

from __future__ import annotations

import pytest
import torch
from conftest import context_for
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

import app.client_app as client_module
from app.attacks import flip_labels, malicious_partitions
from app.client_app import app as client_app
from app.config import load_config, to_client_record
from app.data import DataSpec, spec_to_record
from app.models import build_model

NODES = 5
SPEC = DataSpec(1, 8, 8, 10)


def _replies(overrides: str) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The global model and every node's reply state for one training round."""
    cfg, _ = load_config(f"train.epochs=1 seed=11 {overrides}")
    torch.manual_seed(0)
    global_state = build_model(cfg.model, SPEC).state_dict()
    config = ConfigRecord({**to_client_record(cfg), **spec_to_record(SPEC), "server-round": 1})
    states = []
    for pid in range(NODES):
        ins = Message(
            RecordDict({"arrays": ArrayRecord(global_state), "config": config}),
            dst_node_id=pid + 1,
            message_type="train",
        )
        ins.metadata.__dict__["_message_id"] = f"m{pid}"
        reply = client_app(ins, context_for(pid, NODES))
        assert reply.content["metrics"]["partition-id"] == pid
        states.append(reply.content["arrays"].to_torch_state_dict())
    return global_state, states


@pytest.fixture(scope="module")
def honest():
    return _replies("attack=none")


def test_malicious_nodes_are_a_seeded_draw():
    assert malicious_partitions(11, 10, 3) == malicious_partitions(11, 10, 3)
    assert malicious_partitions(11, 10, 3) != malicious_partitions(12, 10, 3)
    assert len(set(malicious_partitions(11, 10, 3))) == 3
    with pytest.raises(ValueError, match="exceeds the 4 nodes"):
        malicious_partitions(0, 4, 5)


@pytest.mark.parametrize("attack", ["sign_flip", "scale", "gaussian", "label_flip"])
def test_attack_changes_exactly_the_malicious_replies(honest, attack):
    global_state, clean = honest
    scale = 3.0
    _, attacked = _replies(f"attack={attack} attack.num_malicious=2 attack.scale={scale}")
    bad = malicious_partitions(11, NODES, 2)
    for pid in range(NODES):
        for key, g in global_state.items():
            h, a = clean[pid][key], attacked[pid][key]
            if pid not in bad or not g.is_floating_point():
                assert torch.equal(h, a), f"{attack}: honest node {pid} changed in {key}"
            elif attack == "sign_flip":
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

    def spy(model, data, cfg, precision, seed):
        seen[len(seen)] = data.y.clone()
        return real_train(model, data, cfg, precision, seed)

    monkeypatch.setattr(client_module, "train", spy)
    _replies("attack=none")
    honest_labels = dict(seen)
    seen.clear()
    _replies("attack=label_flip attack.num_malicious=2")
    bad = malicious_partitions(11, NODES, 2)
    for pid in range(NODES):
        expected = flip_labels(honest_labels[pid], 10) if pid in bad else honest_labels[pid]
        assert torch.equal(seen[pid], expected)
