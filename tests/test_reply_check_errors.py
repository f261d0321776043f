"""Whatever a check raises while checking one reply (the run's work-record check, the weight cap with
its partition and local-DP checks, a compressed reply's decoder, the metrics) rejects that reply, with
the exception's type and message as the reason and its traceback in the log; the other replies
aggregate and nothing escapes into the run (issue 48, finding 2)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord

from app.simulation.messages import make_reply
from strategies.fedavg import FedAvg
from strategies.replies import InvalidReply, screen_reply, specs_of
from strategies.settings import ReplyLimits

BAD = 7  # the node whose reply each checker chokes on


def _check(msg: Message, node: int) -> None:
    if node == BAD:
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")


def _weight_cap(node: int, metrics: MetricRecord, kind: str) -> float:
    return {1: 100.0, 2: 100.0}[node]  # a KeyError for a node it did not foresee


def _unpack(record: ArrayRecord, base: dict) -> dict:
    if "payload" in record:  # a compressed payload its decoder cannot take
        raise IndexError("index 4096 is out of bounds for axis 0 with size 12")
    return {k: torch.from_numpy(record[k].numpy()) for k in record.keys()}


def _replies(model_arrays: dict[str, np.ndarray], where: str) -> list[Message]:
    honest = [make_reply(n, model_arrays, {"num-examples": 10}) for n in (1, 2)]
    bad = make_reply(BAD, model_arrays, {"num-examples": 10})
    if where == "unpack":
        bad.content["arrays"] = ArrayRecord({"payload": Array(np.zeros(3, np.float32))})
    return [honest[0], bad, honest[1]]


LIMITS = {
    "check": (ReplyLimits(check=_check), "RecursionError: maximum recursion depth"),
    "weight_cap": (ReplyLimits(weight_cap=_weight_cap), "KeyError: 7"),
    "unpack": (ReplyLimits(unpack=_unpack), "IndexError: index 4096"),
}


@pytest.mark.parametrize("where", sorted(LIMITS))
def test_an_exception_in_a_check_rejects_that_reply_only(model_arrays, caplog, where):
    limits, reason = LIMITS[where]
    strategy = FedAvg(limits=limits)
    strategy._specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    with caplog.at_level(logging.WARNING, logger="flwr.fedgpu"):
        arrays, _ = strategy.aggregate_train(1, _replies(model_arrays, where))
    report = strategy.train_report
    assert arrays is not None and report.accepted == [1, 2]
    ((node, why),) = [(r.node_id, r.reason) for r in report.rejected]
    assert node == BAD and why.startswith(f"checking it raised {reason}"), why
    traced = [r for r in caplog.records if r.exc_info and f"node {BAD}" in r.getMessage()]
    assert traced and type(traced[0].exc_info[1]).__name__ == reason.split(":")[0]


def test_screen_reply_itself_turns_any_exception_into_invalid_reply(model_arrays):
    """FedBuff screens each reply with `screen_reply` and catches InvalidReply: what it gets."""
    specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    bad = _replies(model_arrays, "check")[1]
    with pytest.raises(InvalidReply, match="checking it raised RecursionError"):
        screen_reply(bad, specs, node=BAD, check=_check)


def test_a_reply_check_still_names_its_own_reason():
    """An InvalidReply a check raises is the reason as it stands, not wrapped."""

    def refuse(msg: Message, node: int) -> None:
        raise InvalidReply("work record: missing")

    with pytest.raises(InvalidReply) as err:
        screen_reply(make_reply(3, None, {"num-examples": 1}), None, check=refuse)
    assert str(err.value) == "work record: missing"
