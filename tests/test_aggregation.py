"""FedAvg maths: closed form, Flower's own aggregate_arrayrecords, zero-copy views."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from app.simulation.messages import make_reply
from strategies.fedavg import FedAvg
from strategies.replies import specs_of
from strategies.settings import ReplyLimits, Sampling
from strategies.tensor_ops import array_view, flatten, record_to_tensors, unflatten, weighted_mean


def _clients(rng: np.random.Generator, like: dict[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    return [{k: rng.normal(size=v.shape).astype(v.dtype) for k, v in like.items()} for _ in range(n)]


def test_weighted_mean_equals_closed_form(rng, model_arrays):
    clients = _clients(rng, model_arrays, 5)
    weights = [3.0, 10.0, 1.0, 7.0, 2.0]
    got = weighted_mean([{k: torch.from_numpy(v) for k, v in c.items()} for c in clients], weights, torch.device("cpu"))
    for key in model_arrays:
        expected = sum(w * c[key].astype(np.float64) for w, c in zip(weights, clients, strict=True)) / sum(weights)
        np.testing.assert_allclose(got[key].numpy(), expected, rtol=1e-6, atol=1e-6)
        assert got[key].dtype == torch.float32


def test_fedavg_matches_flower_aggregate_arrayrecords(rng, model_arrays):
    clients = _clients(rng, model_arrays, 6)
    counts = [12, 50, 7, 33, 1, 90]
    replies = [
        make_reply(i + 1, c, {"num-examples": n, "train-loss": float(i)})
        for i, (c, n) in enumerate(zip(clients, counts, strict=True))
    ]
    strategy = FedAvg()
    strategy._specs = specs_of(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    ours, metrics = strategy.aggregate_train(1, replies)
    flower = aggregate_arrayrecords([r.content for r in replies], "num-examples")
    for key in model_arrays:
        np.testing.assert_allclose(ours[key].numpy(), flower[key].numpy(), rtol=1e-6, atol=1e-6)
    assert metrics["num-examples"] == sum(counts)
    assert metrics["train-loss"] == pytest.approx(sum(i * n for i, n in enumerate(counts)) / sum(counts))


def test_integer_buffers_keep_dtype_and_round():
    a = {"bn.num_batches_tracked": torch.tensor(10, dtype=torch.int64), "w": torch.zeros(2)}
    b = {"bn.num_batches_tracked": torch.tensor(21, dtype=torch.int64), "w": torch.ones(2)}
    out = weighted_mean([a, b], [1.0, 1.0], torch.device("cpu"))
    assert out["bn.num_batches_tracked"].dtype == torch.int64
    assert int(out["bn.num_batches_tracked"]) == 16  # round(15.5) to even
    torch.testing.assert_close(out["w"], torch.full((2,), 0.5))


def test_half_precision_accumulates_in_float32():
    big = [{"w": torch.full((4,), 60000.0, dtype=torch.float16)} for _ in range(3)]
    out = weighted_mean(big, [1.0, 1.0, 1.0], torch.device("cpu"))
    assert out["w"].dtype == torch.float16 and torch.isfinite(out["w"]).all()


def test_array_view_is_zero_copy_and_exact(model_arrays):
    arr = Array(model_arrays["conv.weight"])
    view = array_view(arr)
    np.testing.assert_array_equal(view.numpy(), model_arrays["conv.weight"])
    # The tensor reads the message's own bytes: no copy was made.
    base = np.frombuffer(arr.data, dtype=np.uint8)
    assert base.ctypes.data <= view.data_ptr() < base.ctypes.data + base.size


def test_array_view_rejects_lying_payload(model_arrays):
    honest = Array(model_arrays["conv.bias"])
    liar = Array(dtype="float32", shape=(8,), stype=honest.stype, data=honest.data)
    with pytest.raises(ValueError, match="declares"):
        array_view(liar)
    truncated = Array(dtype="float32", shape=(4,), stype=honest.stype, data=honest.data[:-4])
    with pytest.raises(ValueError, match="bytes"):
        array_view(truncated)


def test_flatten_unflatten_roundtrip(model_arrays):
    tensors = record_to_tensors(ArrayRecord({k: Array(v) for k, v in model_arrays.items()}))
    tensors["steps"] = torch.tensor(3)
    vec = flatten(tensors)
    assert vec.numel() == sum(v.size for v in model_arrays.values())
    back = unflatten(vec, tensors)
    for key, value in tensors.items():
        torch.testing.assert_close(back[key], value)
    with pytest.raises(ValueError, match="needs"):
        unflatten(vec[:-1], tensors)


def test_messages_carry_ttl_round_and_config():
    from app.simulation.local_grid import InProcessGrid

    grid = InProcessGrid(lambda m, c: m, num_nodes=3)
    strategy = FedAvg(
        sampling=Sampling(min_train_nodes=3, min_available_nodes=3), limits=ReplyLimits(message_ttl_s=123.0)
    )
    msgs = list(
        strategy.configure_train(4, ArrayRecord({"w": Array(np.zeros(2, np.float32))}), ConfigRecord({"a": 1}), grid)
    )
    assert len(msgs) == 3 and {m.metadata.dst_node_id for m in msgs} == set(grid.get_node_ids())
    assert all(m.metadata.ttl == 123.0 and m.metadata.group_id == "4" for m in msgs)
    assert msgs[0].content["config"]["server-round"] == 4


def test_cohorts_come_from_the_strategys_seeded_sampler_not_the_global_random():
    """Flower's heartbeat and retry threads draw from the global `random` when the host's timing
    says so: two runs with the same seed must sample the same cohorts whatever else drew from it."""
    import random

    from app.simulation.local_grid import InProcessGrid

    grid = InProcessGrid(lambda m, c: m, num_nodes=10)
    cohorts = []
    for extra_draws in (0, 3):
        strategy = FedAvg(sampling=Sampling(min_train_nodes=1, min_available_nodes=1))
        strategy.sampler.seed(7)
        picks = []
        for _ in range(5):
            for _ in range(extra_draws):
                random.random()
            picks.append(strategy.select_nodes(grid, 0.3, 1, "train"))
        cohorts.append(picks)
    assert cohorts[0] == cohorts[1]
    assert len({tuple(p) for p in cohorts[0]}) > 1  # the sampler does draw: cohorts change round to round
