"""Every malformed reply kind is rejected with its node id; the rest still aggregate."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

import strategies.replies as replies_module
from app.simulation.messages import make_reply
from strategies import tensor_ops
from strategies.fedavg import FedAvg
from strategies.replies import MAX_WEIGHT, InvalidReply, screen_replies, specs_of, weighted_metrics
from strategies.settings import ReplyLimits


def _bad_replies(good: dict[str, np.ndarray]) -> dict[str, object]:
    """node id -> a malformed reply (and the words its rejection must contain)."""
    nan = {**good, "fc.weight": np.full_like(good["fc.weight"], np.nan)}
    inf = {**good, "conv.bias": np.array([1.0, np.inf, 0.0, 0.0], dtype=np.float32)}
    shape = {**good, "fc.weight": np.zeros((10, 5), np.float32)}
    dtype = {**good, "conv.bias": good["conv.bias"].astype(np.float64)}
    missing = {k: v for k, v in good.items() if k != "conv.bias"}
    extra = {**good, "backdoor": np.zeros(3, np.float32)}
    two_records = make_reply(20, good, {"num-examples": 5})
    two_records.content["more"] = ArrayRecord({"x": Array(np.zeros(1, np.float32))})
    return {
        "error reply": (make_reply(10, None, None, error="CUDA out of memory"), "error reply"),
        "NaN": (make_reply(11, nan, {"num-examples": 5}), "non-finite"),
        "Inf": (make_reply(12, inf, {"num-examples": 5}), "non-finite"),
        "shape": (make_reply(13, shape, {"num-examples": 5}), "fc.weight"),
        "dtype": (make_reply(14, dtype, {"num-examples": 5}), "float64"),
        "missing key": (make_reply(15, missing, {"num-examples": 5}), "missing ['conv.bias']"),
        "extra key": (make_reply(16, extra, {"num-examples": 5}), "unexpected ['backdoor']"),
        "no count": (make_reply(17, good, {"train-loss": 0.1}), "missing 'num-examples'"),
        "zero count": (make_reply(18, good, {"num-examples": 0}), "> 0"),
        "negative count": (make_reply(19, good, {"num-examples": -4}), "> 0"),
        "nan count": (make_reply(21, good, {"num-examples": float("nan")}), "finite"),
        "list count": (make_reply(22, good, {"num-examples": [1, 2]}), "must be a number"),
        "no metrics": (make_reply(23, good, None), "MetricRecord"),
        "two array records": (two_records, "ArrayRecord"),
    }


def test_each_malformed_reply_is_rejected_and_the_rest_aggregate(rng, model_arrays):
    honest = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in model_arrays.items()} for _ in range(2)]
    good_replies = [make_reply(1, honest[0], {"num-examples": 10}), make_reply(2, honest[1], {"num-examples": 30})]
    bad = _bad_replies(model_arrays)
    strategy = FedAvg()
    strategy._specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    replies = [good_replies[0], *(r for r, _ in bad.values()), good_replies[1]]
    arrays, _ = strategy.aggregate_train(1, replies)

    report = strategy.train_report
    assert report.accepted == [1, 2]
    reasons = {r.node_id: r.reason for r in report.rejected}
    for kind, (reply, words) in bad.items():
        node = reply.metadata.src_node_id
        assert node in reasons, f"{kind} reply was not rejected"
        assert words in reasons[node], f"{kind}: {reasons[node]!r} lacks {words!r}"
    for key in model_arrays:
        expected = (10 * honest[0][key] + 30 * honest[1][key]) / 40
        np.testing.assert_allclose(arrays[key].numpy(), expected, rtol=1e-6, atol=1e-6)


def test_round_without_valid_reply_returns_nothing(model_arrays):
    strategy = FedAvg()
    strategy._specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    bad = [r for r, _ in _bad_replies(model_arrays).values()]
    assert strategy.aggregate_train(3, bad) == (None, None)
    assert strategy.train_report.accepted == [] and len(strategy.train_report.rejected) == len(bad)


def test_evaluation_replies_are_screened_for_counts():
    good = make_reply(1, None, {"num-examples": 10, "eval-accuracy": 0.5})
    other = make_reply(2, None, {"num-examples": 30, "eval-accuracy": 0.9})
    empty = make_reply(3, None, {"num-examples": 0, "eval-accuracy": float("nan")})
    strategy = FedAvg()
    metrics = strategy.aggregate_evaluate(1, [good, other, empty])
    assert metrics["eval-accuracy"] == pytest.approx(0.8)
    assert [r.node_id for r in strategy.evaluate_report.rejected] == [3]


def test_weighted_metrics_tolerates_different_keys():
    replies = screen_replies(
        [
            make_reply(1, None, {"num-examples": 10, "loss": 1.0, "gpu-device-util-mean-pct": 80.0}),
            make_reply(2, None, {"num-examples": 30, "loss": 3.0}),
        ],
        None,
    ).valid
    metrics = weighted_metrics(replies)
    assert metrics["loss"] == pytest.approx(2.5)
    assert metrics["gpu-device-util-mean-pct"] == pytest.approx(80.0)  # only node 1 reports it
    assert metrics["num-examples"] == 40


def test_content_record_without_metricrecord_key_is_rejected(model_arrays):
    msg = make_reply(5, model_arrays, None)
    msg.content["metrics"] = MetricRecord({"num-examples": 3})
    msg.content["metrics2"] = MetricRecord({"num-examples": 3})
    screened = screen_replies([msg], specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()})))
    assert not screened.valid and "exactly one MetricRecord" in screened.rejected[0].reason


def test_a_superlink_error_for_a_vanished_node_is_charged_to_that_node():
    """Flower's SuperLink answers a task for a node that stopped heartbeating with an error
    from its own node id (1); the rejection must name the node the task was for."""
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

    ins = Message(RecordDict(), dst_node_id=7, message_type="train")
    ins.metadata.__dict__["_message_id"] = "task-7"
    reply = create_message_error_unavailable_res_message(ins.metadata, "node_unavail")
    assert reply.metadata.src_node_id == 1  # the SuperLink's
    (named,) = screen_replies([reply], None, sent={"task-7": 7}).rejected
    assert named.node_id == 7 and "Node Unavailable" in named.reason
    (unnamed,) = screen_replies([reply], None).rejected
    assert unnamed.node_id == 1


# --- claimed example counts --------------------------------------------------------------
def _liar_round(rng, model_arrays, claim: float, weight_cap=None):
    """9 honest nodes with 100 examples and node 99 claiming `claim` while sending -50."""
    honest = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in model_arrays.items()} for _ in range(9)]
    liar = {k: np.full_like(v, -50.0) for k, v in model_arrays.items()}
    replies = [make_reply(i + 1, m, {"num-examples": 100}) for i, m in enumerate(honest)]
    replies.append(make_reply(99, liar, {"num-examples": claim}))
    strategy = FedAvg(limits=ReplyLimits(weight_cap=weight_cap))
    strategy._specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    arrays, metrics = strategy.aggregate_train(1, replies)
    return strategy, honest, liar, arrays, metrics


def test_an_inflated_count_is_capped_and_no_longer_decides_fedavg(rng, model_arrays):
    """Reproduces issue 12: one node claiming 1e300 examples used to *be* the new model."""
    seen = []

    def partition_size(node: int, metrics: MetricRecord, kind: str) -> float:
        seen.append((node, kind))
        return 100.0  # what the server knows each node's partition holds

    strategy, honest, liar, arrays, metrics = _liar_round(rng, model_arrays, 1e300, partition_size)
    for key in model_arrays:
        expected = (sum(h[key] for h in honest) * 100 + liar[key] * 100) / 1000
        np.testing.assert_allclose(arrays[key].numpy(), expected, rtol=1e-5, atol=1e-5)
        assert np.abs(arrays[key].numpy() + 50).min() > 40  # nowhere near the liar's -50
    assert strategy.train_report.capped == [{"node_id": 99, "claimed": 1e300, "weight": 100.0}]
    assert metrics["num-examples"] == 1000
    assert sorted(seen) == [(n, "train") for n in [*range(1, 10), 99]]


def test_weights_stay_finite_without_a_configured_cap(rng, model_arrays):
    """Claims that overflow a float sum (2 x 1e308 = inf) once zeroed the model; every
    weight is now at most MAX_WEIGHT, so the sum is finite and the mean is the mean."""
    models = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in model_arrays.items()} for _ in range(3)]
    replies = [make_reply(i, m, {"num-examples": 1e308}) for i, m in enumerate(models)]
    strategy = FedAvg()
    strategy._specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["num-examples"] == 3 * MAX_WEIGHT
    for key in model_arrays:
        np.testing.assert_allclose(arrays[key].numpy(), sum(m[key] for m in models) / 3, rtol=1e-5, atol=1e-6)


def test_evaluation_counts_are_capped_too():
    def cap(node: int, metrics: MetricRecord, kind: str) -> float:
        assert kind == "evaluate"
        return 10.0

    good = make_reply(1, None, {"num-examples": 10, "eval-accuracy": 0.9})
    liar = make_reply(2, None, {"num-examples": 1e12, "eval-accuracy": 0.0})
    metrics = FedAvg(limits=ReplyLimits(weight_cap=cap)).aggregate_evaluate(1, [good, liar])
    assert metrics["eval-accuracy"] == pytest.approx(0.45) and metrics["num-examples"] == 20


def test_a_cap_of_zero_rejects_the_claim_and_a_cap_may_refuse_the_reply(model_arrays):
    def cap(node: int, metrics: MetricRecord, kind: str) -> float:
        if node == 2:
            raise InvalidReply("partition-id=1 is already held by node 1")
        return 0.0

    screened = screen_replies(
        [make_reply(1, None, {"num-examples": 5}), make_reply(2, None, {"num-examples": 5})], None, weight_cap=cap
    )
    assert not screened.valid
    assert [(r.node_id, r.reason) for r in screened.rejected] == [
        (1, "claims 5 examples, but its data holds none the server knows of"),
        (2, "partition-id=1 is already held by node 1"),
    ]


# --- size ------------------------------------------------------------------------------------
def test_a_reply_larger_than_the_global_model_is_refused_before_it_is_parsed(monkeypatch, model_arrays):
    viewed = []
    real_view = tensor_ops.array_view
    monkeypatch.setattr(replies_module, "array_view", lambda a: viewed.append(a) or real_view(a))
    specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    padded = ArrayRecord({k: Array(v) for k, v in model_arrays.items()})
    big = padded["fc.weight"]
    # Same declared shape and dtype, a payload padded to several times the whole model.
    padded["fc.weight"] = Array(dtype=big.dtype, shape=big.shape, stype=big.stype, data=big.data + bytes(1 << 16))
    msg = make_reply(42, None, {"num-examples": 5})
    msg.content["arrays"] = padded
    (rejected,) = screen_replies([msg], specs).rejected
    assert rejected.node_id == 42 and "more than the global model's" in rejected.reason
    assert viewed == []  # refused on its byte count, before any payload was parsed
    exact = make_reply(43, model_arrays, {"num-examples": 5})
    assert screen_replies([exact], specs).valid and len(viewed) == len(model_arrays)
