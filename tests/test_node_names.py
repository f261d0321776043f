"""Log lines name nodes by partition or site name beside their id (strategies/node_names.py), and
the round line counts replies, accepted and selected apart (issue 33, point 7)."""

from __future__ import annotations

import logging
import re
import unicodedata

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from app.client_app import app as client_app
from app.config.compose import load_config
from app.protocol import NAME, NODE, to_client_record
from app.run.federation import FederatedRun
from app.run.results import read_rows
from app.simulation.messages import make_reply
from app.task.data import DataSpec, spec_to_record
from app.tools.in_process import run_in_process
from strategies.fedavg import FedAvg
from strategies.node_names import MAX_NAME, NodeNames, label, labels
from strategies.replies import specs_of
from tests.helpers import context_for, reply_to_same_task


def _named(reply: Message, name: object) -> Message:
    """`reply` with a NODE record claiming `name`, as a deployed ClientApp sends it."""
    reply.content[NODE] = ConfigRecord({NAME: name})
    return reply


def _controls(text: str) -> list[str]:
    return [ch for ch in text if unicodedata.category(ch)[0] == "C"]


def test_a_node_is_shown_by_its_partition_else_its_name_else_its_id_alone() -> None:
    bound = {7: 3}
    names = NodeNames(bound.get)
    names.hear(8, RecordDict({NODE: ConfigRecord({NAME: "  site-a "})}))
    names.hear(7, RecordDict({NODE: ConfigRecord({NAME: "site-b"})}))  # the server's binding wins
    names.hear(9, RecordDict({NODE: ConfigRecord({NAME: 42})}))  # not text: no name
    names.hear(10, RecordDict({NODE: ConfigRecord({NAME: "   "})}))
    assert label(7, names) == "partition 3 (node 7)"
    assert label(8, names) == "site-a (node 8)"
    assert [label(n, names) for n in (9, 10, 11)] == ["node 9", "node 10", "node 11"]
    assert label(8) == "node 8"  # no map: the id alone
    assert labels([8, 11], names) == "[site-a (node 8), node 11]"


def test_a_hostile_name_is_escaped_cut_and_shown_with_the_id_and_decides_nothing(
    model_arrays: dict[str, np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    """A name is the node's claim: control characters and terminal escapes are escaped, 10 KB is
    cut to MAX_NAME characters, a second node claiming a name is warned about, and the id stays
    beside every name; the reply carrying it is screened and weighed as without it."""
    forged = "site-a\n[round 9/10] accuracy 0.9999\x1b[2J\x1b]0;owned\x07\u202e"
    huge = "x" * 10_000
    strategy = FedAvg()
    strategy._specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    replies = [
        _named(make_reply(1, model_arrays, {"num-examples": 10}), "site-a"),
        _named(make_reply(2, model_arrays, {"num-examples": 0}), forged),  # rejected: the line names it
        _named(make_reply(3, model_arrays, {"num-examples": 10}), huge),
        _named(make_reply(4, model_arrays, {"num-examples": 10}), "site-a"),  # another node's name
        _named(make_reply(5, model_arrays, {"num-examples": 10}), ["not", "text"]),
    ]
    with caplog.at_level(logging.INFO, logger="flwr.fedgpu"):
        arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and strategy.train_report.accepted == [1, 3, 4, 5]
    assert metrics["num-examples"] == 40  # the names weigh nothing
    messages = [r.getMessage() for r in caplog.records]
    assert not any(_controls(m) for m in messages), messages
    (rejection,) = [m for m in messages if m.startswith("rejected reply from")]
    assert rejection.startswith("rejected reply from site-a\\n[round 9/10] accuracy 0.9999\\x1b[2J\\x1b]0;owned\\x07")
    assert "\\u202e (node 2): " in rejection
    shown = strategy.wiring.names.shown(3)
    assert shown == "x" * MAX_NAME + f"... ({10_000 - MAX_NAME} more characters)"
    assert label(3, strategy.wiring.names) == f"{shown} (node 3)"
    (twin,) = [r for r in caplog.records if r.levelno == logging.WARNING and "as [" in r.getMessage()]
    assert twin.getMessage().startswith("node 4 names itself site-a, as [site-a (node 1)] did")
    assert label(4, strategy.wiring.names) == "site-a (node 4)" and label(5, strategy.wiring.names) == "node 5"


def _deployed_task(tmp_path) -> tuple[Message, str]:  # noqa: ANN001
    rng = np.random.default_rng(0)
    path = tmp_path / "site.npz"
    np.savez(path, x=rng.integers(0, 255, (40, 8, 8), dtype=np.uint8), y=rng.integers(0, 10, 40))
    cfg, _ = load_config("train.epochs=1")
    spec = DataSpec((1, 8, 8), 10)
    from app.task.models import build_model

    config = ConfigRecord({**to_client_record(cfg), **spec_to_record(spec), "server-round": 1})
    ins = Message(
        RecordDict({"arrays": ArrayRecord(build_model(cfg.model, spec).state_dict()), "config": config}),
        dst_node_id=7,
        message_type="train",
    )
    ins.metadata.__dict__["_message_id"] = "x"
    return ins, str(path)


def test_a_deployed_clientapp_reports_its_node_config_name_and_the_server_logs_it(
    tmp_path, model_arrays: dict[str, np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    ins, path = _deployed_task(tmp_path)
    reply = client_app(ins, context_for(0, 1, node_config={"data-path": path, "name": "site-a"}))
    assert dict(reply.content[NODE]) == {NAME: "site-a"}
    assert list(reply.content.metric_records) == ["metrics"]  # the name is no metric
    plain = client_app(ins, context_for(0, 1, node_config={"data-path": path}))
    assert NODE not in plain.content  # no name configured: nothing sent
    # The server side: a reply from such a node, rejected (wrong model), is logged by its name and id.
    strategy = FedAvg()
    strategy._specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    wrong = Message(reply.content, reply_to=reply_to_same_task(reply))
    with caplog.at_level(logging.INFO, logger="flwr.fedgpu"):
        strategy.aggregate_train(1, [wrong])
    node = reply.metadata.src_node_id
    assert f"node {node} names itself site-a (its node config's name)" in caplog.text
    assert f"rejected reply from site-a (node {node}): " in caplog.text


@pytest.mark.parametrize(
    ("row", "line"),
    [
        ({"robust": None, "num_clients": 5, "num_rejected": 0, "num_missing": 0}, "clients 5  rejected 0"),
        ({"robust": None, "num_clients": 3, "num_rejected": 1, "num_missing": 1}, "clients 3  rejected 1  missing 1"),
        (
            {
                "robust": {},
                "num_sampled": 7,
                "num_clients": 1,
                "num_rejected": 1,
                "num_missing": 1,
                "model_updated": True,
            },
            "replies 6  accepted 5  selected 1  rejected 1  missing 1",
        ),
        (  # the too-few policy skipped the round: nothing selected
            {
                "robust": {},
                "num_sampled": 3,
                "num_clients": 3,
                "num_rejected": 0,
                "num_missing": 0,
                "model_updated": False,
            },
            "replies 3  accepted 3  selected 0  rejected 0",
        ),
    ],
)
def test_the_round_line_counts_replies_accepted_and_selected_apart_for_a_robust_rule(row: dict, line: str) -> None:
    assert FederatedRun.cohort(row) == line


def test_a_simulated_run_names_nodes_by_partition_in_every_line(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """Krum under attack on 6 in-process nodes, one of which sends NaN: the rejection, Krum's
    choice, the attackers and the round line speak in partitions beside node ids."""

    def tamper(node_id: int, reply: Message) -> Message:
        if node_id != 1005:
            return reply
        arrays = {k: np.full(v.numpy().shape, np.nan, v.numpy().dtype) for k, v in reply.content["arrays"].items()}
        content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()})})
        content["metrics"] = reply.content["metrics"]
        return Message(content, reply_to=reply_to_same_task(reply))

    overrides = (
        "strategy=krum strategy.num_byzantine=1 attack=sign_flip attack.num_malicious=1 "
        "federation.rounds=1 train.epochs=1 seed=3"
    )
    with caplog.at_level(logging.INFO, logger="flwr.fedgpu"):
        summary, _ = run_in_process(overrides, tmp_path, nodes=6, tamper=tamper)
    (row,) = read_rows(summary["run_dir"])
    assert (row["num_sampled"], row["num_clients"], row["num_rejected"]) == (6, 1, 1)  # columns as before
    text = caplog.text
    assert "rejected reply from partition 5 (node 1005): non-finite values" in text
    (bad,) = summary["attack"]["malicious_partitions"]
    assert f"attack sign_flip: malicious nodes [partition {bad} (node {1000 + bad})]" in text
    (choice,) = re.findall(r"round 1: Krum selected \[(.*?)\], excluded \[(.*?)\]", text)
    named = [n for part in choice for n in part.split(", ")]
    assert len(named) == 5 and all(re.fullmatch(r"partition (\d) \(node 100\1\): \S+", n) for n in named), named
    assert "[round 1/1]" in text and "replies 6  accepted 5  selected 1  rejected 1" in text
