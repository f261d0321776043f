"""Krum, Multi-Krum, median and trimmed mean against Flower and NumPy closed forms."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import MultiKrum as FlowerMultiKrum
from flwr.serverapp.strategy.multikrum import select_multikrum

from app.simulation.local_grid import InProcessGrid
from app.simulation.messages import make_reply
from strategies.coordinatewise import MedianRule, TrimmedMeanRule
from strategies.krum import KrumRule, MultiKrumRule
from strategies.robust import RobustStrategy
from strategies.robust_ops import coordinatewise, krum_scores, squared_distances, update_gram
from strategies.settings import ReplyLimits
from strategies.tensor_ops import record_to_tensors

CPU = torch.device("cpu")


def _setup(rng, n: int, outliers: dict[int, float], counts=None, counters_differ: bool = True):
    """A global model and n replies; `outliers` maps client index -> update scale.

    Integer buffers (BatchNorm's num_batches_tracked) are counters, not weights: our
    distances leave them out, Flower's include them. `counters_differ=False` keeps
    them equal so both see the same geometry.
    """
    global_model = {
        "conv.weight": rng.normal(size=(6, 3, 3, 3)).astype(np.float32),
        "fc.weight": rng.normal(size=(10, 6)).astype(np.float32),
        "bn.num_batches_tracked": np.array(5, dtype=np.int64),
    }
    models = []
    for i in range(n):
        scale = outliers.get(i, 0.1)
        models.append(
            {
                k: (v + scale * rng.normal(size=v.shape).astype(np.float32))
                if v.dtype == np.float32
                else np.asarray(v + i * counters_differ)
                for k, v in global_model.items()
            }
        )
    counts = counts or [int(c) for c in rng.integers(5, 50, n)]
    replies = [make_reply(100 + i, m, {"num-examples": c}) for i, (m, c) in enumerate(zip(models, counts, strict=True))]
    return global_model, models, replies, counts


def _configure(strategy, global_model, n: int):
    grid = InProcessGrid(lambda m, c: m, num_nodes=n)
    record = ArrayRecord({k: Array(v) for k, v in global_model.items()})
    strategy.sampling = replace(strategy.sampling, min_available_nodes=n, min_train_nodes=n)  # a test's cohort
    strategy.configure_train(1, record, ConfigRecord(), grid)
    return record


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("m", [1, 4])
def test_krum_selects_what_flower_selects(seed, m):
    """Equal counts: Flower's Multi-Krum weights its average by them, ours never does."""
    rng = np.random.default_rng(seed)
    n = 11
    global_model, _, replies, _ = _setup(rng, n, outliers={2: 5.0, 7: 3.0}, counts=[20] * n, counters_differ=False)
    strategy = (
        RobustStrategy(rule=KrumRule(num_byzantine=2))
        if m == 1
        else RobustStrategy(rule=MultiKrumRule(num_byzantine=2, num_selected=m))
    )
    _configure(strategy, global_model, n)
    ours, _ = strategy.aggregate_train(1, replies)
    flower_selected = select_multikrum([r.content for r in replies], num_malicious_nodes=2, num_nodes_to_select=m)
    flower_nodes = sorted(replies[[r.content for r in replies].index(c)].metadata.src_node_id for c in flower_selected)
    assert sorted(strategy.train_report.accepted) == flower_nodes
    assert 102 not in strategy.train_report.accepted and 107 not in strategy.train_report.accepted
    assert set(strategy.train_report.scores) == {100 + i for i in range(n)}
    flower_arrays, _ = FlowerMultiKrum(num_malicious_nodes=2, num_nodes_to_select=m).aggregate_train(1, replies)
    for key in ("conv.weight", "fc.weight"):
        np.testing.assert_allclose(ours[key].numpy(), flower_arrays[key].numpy(), rtol=1e-5, atol=1e-6)


def test_gram_and_distances_equal_the_closed_form_with_per_client_bases():
    rng = np.random.default_rng(3)
    models = [{"a": torch.from_numpy(rng.normal(size=(5, 7)).astype(np.float32))} for _ in range(4)]
    bases = [{"a": torch.from_numpy(rng.normal(size=(5, 7)).astype(np.float32))} for _ in range(4)]
    gram = update_gram(models, bases, CPU, block_bytes=4 * 4 * 8)  # forces several blocks
    flat = np.stack([(m["a"] - b["a"]).numpy().astype(np.float64).ravel() for m, b in zip(models, bases, strict=True)])
    np.testing.assert_allclose(gram.numpy(), flat @ flat.T, rtol=1e-5)
    dist = squared_distances(gram).numpy()
    expected = ((flat[:, None, :] - flat[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(dist, expected, rtol=1e-5, atol=1e-6)
    scores = krum_scores(squared_distances(gram), num_byzantine=0)  # n - f - 2 = 2 nearest
    expected_scores = [np.sort(np.delete(expected[i], i))[:2].sum() for i in range(4)]
    np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=1e-5)


@pytest.mark.parametrize("n", [7, 8])
def test_median_and_trimmed_mean_equal_numpy(n):
    rng = np.random.default_rng(n)
    global_model, models, replies, _ = _setup(rng, n, outliers={0: 50.0})
    for strategy, trim in (
        (RobustStrategy(rule=MedianRule()), None),
        (RobustStrategy(rule=TrimmedMeanRule(trim_ratio=0.2)), int(0.2 * n)),
    ):
        _configure(strategy, global_model, n)
        ours, _ = strategy.aggregate_train(1, replies)
        for key in ("conv.weight", "fc.weight"):
            updates = np.stack([m[key] - global_model[key] for m in models])
            if trim is None:
                agg = np.median(updates, axis=0)
            else:
                agg = np.sort(updates, axis=0)[trim : n - trim].mean(axis=0)
            np.testing.assert_allclose(ours[key].numpy(), global_model[key] + agg, rtol=1e-5, atol=1e-6)
        counters = np.array([m["bn.num_batches_tracked"] for m in models], dtype=np.float64)
        expected = np.median(counters) if trim is None else np.sort(counters)[trim : n - trim].mean()
        assert int(ours["bn.num_batches_tracked"].numpy()) == int(np.round(expected))


def test_coordinatewise_refuses_to_trim_everything():
    models = [{"a": torch.zeros(3)} for _ in range(4)]
    with pytest.raises(ValueError, match="leaves nothing"):
        coordinatewise(models, models, trim=2, device=CPU)


def test_nan_update_is_rejected_through_the_gram_diagonal():
    rng = np.random.default_rng(5)
    global_model, models, replies, _ = _setup(rng, 8, outliers={})
    models[3]["fc.weight"][0, 0] = np.nan
    replies[3] = make_reply(103, models[3], {"num-examples": 10})
    strategy = RobustStrategy(rule=KrumRule(num_byzantine=1))
    _configure(strategy, global_model, 8)
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None and np.isfinite(arrays["fc.weight"].numpy()).all()
    assert [r.node_id for r in strategy.train_report.rejected] == [103]
    assert 103 not in strategy.train_report.scores


@pytest.mark.parametrize(
    ("policy", "num_valid", "outcome"),
    [("skip", 5, "skip"), ("fallback", 5, "fallback-median"), ("fallback", 4, "skip"), ("fallback", 2, "skip")],
)
def test_too_few_valid_replies_apply_the_policy(policy, num_valid, outcome):
    """Krum with f = 2 needs 7 replies. The fallback median needs 2f + 1 = 5: a median of
    2 replies is their mean, which one attacker moves anywhere, so below 5 it skips too."""
    rng = np.random.default_rng(6)
    global_model, models, replies, _ = _setup(rng, 7, outliers={})
    gone = 7 - num_valid
    broken = [make_reply(100 + i, None, None, error="node vanished") for i in range(gone)]
    strategy = RobustStrategy(rule=KrumRule(num_byzantine=2, on_too_few=policy))
    _configure(strategy, global_model, 7)
    arrays, _ = strategy.aggregate_train(1, broken + replies[gone:])
    assert strategy.train_report.policy == outcome
    if outcome == "skip":
        assert arrays is None
        return
    for key in ("conv.weight", "fc.weight"):
        expected = np.median(np.stack([m[key] for m in models[gone:]]), axis=0)
        np.testing.assert_allclose(arrays[key].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_cohort_problems_are_reported_before_training():
    assert "n >= 2f+3 = 7" in RobustStrategy(rule=KrumRule(num_byzantine=2)).cohort_problem(6)
    assert RobustStrategy(rule=KrumRule(num_byzantine=2)).cohort_problem(7) is None
    assert "num_selected=6 must be <= n - f = 5" in RobustStrategy(
        rule=MultiKrumRule(num_byzantine=2, num_selected=6)
    ).cohort_problem(7)
    assert "n >= 2f+1 = 5" in RobustStrategy(rule=MedianRule(num_byzantine=2)).cohort_problem(4)
    assert "fewer than strategy.num_byzantine=2" in RobustStrategy(
        rule=TrimmedMeanRule(trim_ratio=0.1, num_byzantine=2)
    ).cohort_problem(10)
    assert RobustStrategy(rule=TrimmedMeanRule(trim_ratio=0.2, num_byzantine=2)).cohort_problem(10) is None


def test_views_of_the_global_model_are_the_bases():
    rng = np.random.default_rng(7)
    global_model, _, _, _ = _setup(rng, 3, outliers={})
    strategy = RobustStrategy(rule=MedianRule())
    record = _configure(strategy, global_model, 3)
    assert all(torch.equal(strategy._global[k], record_to_tensors(record)[k]) for k in global_model)


# --- claimed example counts ---------------------------------------------------------------
def test_selected_attackers_claiming_huge_counts_do_not_decide_the_multikrum_mean():
    """Reproduces issue 12: two selected attackers claiming 1e308 examples each overflowed
    the weight sum to inf and zeroed the model; their claims now weigh nothing."""
    rng = np.random.default_rng(8)
    n = 9
    global_model, models, replies, _ = _setup(rng, n, outliers={}, counts=[30] * n, counters_differ=False)
    honest_mean = {k: np.mean([m[k] for m in models], axis=0) for k in global_model}
    for i in (0, 1):  # honest-looking: the mean of everyone's models is the closest to all of them
        models[i] = {k: np.asarray(honest_mean[k], dtype=v.dtype) for k, v in global_model.items()}
        replies[i] = make_reply(100 + i, models[i], {"num-examples": 1e308})
    strategy = RobustStrategy(rule=MultiKrumRule(num_byzantine=2, num_selected=4))
    _configure(strategy, global_model, n)
    arrays, _ = strategy.aggregate_train(1, replies)
    selected = strategy.train_report.accepted
    assert {100, 101} <= set(selected)
    for key in ("conv.weight", "fc.weight"):
        expected = np.mean([models[node - 100][key] for node in selected], axis=0)
        np.testing.assert_allclose(arrays[key].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_robust_fedbuff_buffer_weighs_by_staleness_not_by_claims():
    """The Multi-Krum buffer averages its picks by s(τ) alone; the mean buffer by the
    capped count times s(τ), and its `applied` rows show the claim next to the weight."""
    from strategies.fedbuff import FedBuff, InFlight
    from strategies.staleness import staleness_fn

    rng = np.random.default_rng(9)
    v0 = {"w": rng.normal(size=(4, 3)).astype(np.float32)}
    v1 = {"w": v0["w"] + 0.01}
    models = [{"w": v1["w"] + rng.normal(scale=1e-3, size=(4, 3)).astype(np.float32)} for _ in range(5)]
    claims = [1e308, 1e308, 10, 10, 10]
    versions = [0, 1, 1, 1, 1]  # node 0 trained on version 0: staleness 1, s = 2^-0.5

    def run(rule, cap):
        s = FedBuff(
            buffer_size=5,
            max_staleness=2,
            staleness=staleness_fn("polynomial", 0.5),
            server_lr=1.0,
            buffer_rule=rule,
            limits=ReplyLimits(weight_cap=cap),
        )
        for v, model in ((0, v0), (1, v1)):
            s.set_model(ArrayRecord({k: Array(x) for k, x in model.items()}), v)
        replies = []
        for i, (model, claim, version) in enumerate(zip(models, claims, versions, strict=True)):
            s.in_flight[f"m{i}"] = InFlight(10 + i, version, deadline=float("inf"))
            reply = make_reply(10 + i, model, {"num-examples": claim})
            reply.metadata.__dict__["_reply_to_message_id"] = f"m{i}"
            replies.append(reply)
        new, _ = s.aggregate_train(1, replies)
        return s, new

    bases = [v0 if v == 0 else v1 for v in versions]
    updates = [m["w"] - b["w"] for m, b in zip(models, bases, strict=True)]
    scales = [2**-0.5, 1, 1, 1, 1]

    s, new = run(MultiKrumRule(num_byzantine=0, num_selected=5), cap=None)  # selects all 5
    expected = v1["w"] + sum(sc * u for sc, u in zip(scales, updates, strict=True)) / sum(scales)
    np.testing.assert_allclose(new["w"].numpy(), expected, rtol=1e-5, atol=1e-6)

    s, new = run(None, cap=lambda node, metrics, kind: 20.0)
    weights = [min(c, 20.0) * sc for c, sc in zip(claims, scales, strict=True)]
    expected = v1["w"] + sum(w * u for w, u in zip(weights, updates, strict=True)) / sum(weights)
    np.testing.assert_allclose(new["w"].numpy(), expected, rtol=1e-5, atol=1e-6)
    assert [u["num_examples"] for u in s.report.applied] == claims
    assert [u["weight"] for u in s.report.applied] == pytest.approx(weights)  # flat: pytest 9.1+ refuses nested approx
