"""Bulyan against Flower's own Bulyan (a synchronous round) and a NumPy closed form
(FedBuff's buffer, one base per update)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp.strategy import Bulyan as FlowerBulyan
from flwr.serverapp.strategy.multikrum import select_multikrum

from app.simulation.local_grid import InProcessGrid
from app.simulation.messages import make_reply
from strategies.bulyan import BulyanRule, mean_closest_to_median
from strategies.replies import Screened, ValidReply
from strategies.robust import RobustStrategy

CPU = torch.device("cpu")
FLOAT_KEYS = ("conv.weight", "fc.weight")


def _strategy(rule: BulyanRule) -> RobustStrategy:
    """The synchronous strategy around `rule`, with default settings (a cohort of every node)."""
    return RobustStrategy(rule=rule)


def _round(rng, n: int, outliers: dict[int, float]):
    """A global model and n replies trained from it (`outliers`: client index -> update scale).
    The integer counter is the same everywhere: Flower's distances count it, ours do not."""
    global_model = {
        "conv.weight": rng.normal(size=(6, 3, 3, 3)).astype(np.float32),
        "fc.weight": rng.normal(size=(10, 6)).astype(np.float32),
        "bn.num_batches_tracked": np.array(5, dtype=np.int64),
    }
    models = [
        {
            k: v + outliers.get(i, 0.1) * rng.normal(size=v.shape).astype(np.float32) if k in FLOAT_KEYS else v.copy()
            for k, v in global_model.items()
        }
        for i in range(n)
    ]
    replies = [make_reply(100 + i, m, {"num-examples": 20}) for i, m in enumerate(models)]
    return global_model, models, replies


def _aggregate(rule: BulyanRule, global_model, replies):
    """One synchronous round of `rule`: (the new arrays, the strategy's round report)."""
    strategy = _strategy(rule)
    grid = InProcessGrid(lambda m, c: m, num_nodes=len(replies))
    strategy.configure_train(1, ArrayRecord({k: Array(v) for k, v in global_model.items()}), ConfigRecord(), grid)
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays, strategy.train_report


def bulyan_reference(updates: list[dict[str, np.ndarray]], f: int) -> tuple[dict[str, np.ndarray], list[int]]:
    """Bulyan of the updates in float64 NumPy, written from the paper / Flower's steps:
    (the aggregated update, the indices Multi-Krum selects)."""
    n = len(updates)
    flat = np.stack([np.concatenate([u[k].ravel() for k in FLOAT_KEYS]).astype(np.float64) for u in updates])
    dist = ((flat[:, None, :] - flat[None, :, :]) ** 2).sum(-1)
    scores = [np.sort(np.delete(dist[i], i))[: n - f - 2].sum() for i in range(n)]
    theta, beta = n - 2 * f, n - 4 * f
    chosen = sorted(np.argsort(scores, kind="stable")[:theta].tolist())
    out = {}
    for key in updates[0]:
        stack = np.stack([updates[i][key].astype(np.float64) for i in chosen])
        closest = np.argsort(np.abs(stack - np.median(stack, axis=0)), axis=0, kind="stable")[:beta]
        out[key] = np.take_along_axis(stack, closest, axis=0).mean(axis=0)
    return out, chosen


# Flower's Bulyan takes ~1.2 s a call (ours 0.01 s): the second seed runs with the slow tests.
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("f", "n"), [(2, 11), (1, 8)])  # theta = 7 (odd median), 6 (even median)
def test_bulyan_matches_flower(seed, f, n):
    rng = np.random.default_rng(seed)
    global_model, _, replies = _round(rng, n, outliers={2: 5.0, n - 1: 3.0, 4: 0.5})
    ours, report = _aggregate(BulyanRule(num_byzantine=f), global_model, replies)
    contents = [r.content for r in replies]
    flower_selected = select_multikrum(contents, num_malicious_nodes=f, num_nodes_to_select=n - 2 * f)
    assert sorted(report.accepted) == sorted(100 + contents.index(c) for c in flower_selected)
    assert 102 in report.excluded and 100 + n - 1 in report.excluded
    assert set(report.scores) == {100 + i for i in range(n)}
    flower, _ = FlowerBulyan(num_malicious_nodes=f).aggregate_train(1, replies)
    for key in FLOAT_KEYS:
        np.testing.assert_allclose(ours[key].numpy(), flower[key].numpy(), rtol=1e-5, atol=1e-6)
    assert ours["bn.num_batches_tracked"].numpy().dtype == np.int64
    assert int(ours["bn.num_batches_tracked"].numpy()) == 5


def test_buffer_with_a_base_per_update_equals_the_closed_form():
    """FedBuff's buffer: each update trained from its own version; the rule adds Bulyan of
    the updates (equal weights, whatever the staleness or the claimed count) to `current`."""
    rng = np.random.default_rng(4)
    f, n = 1, 8
    versions = [
        {k: rng.normal(size=s).astype(np.float32) for k, s in (("conv.weight", (6, 3, 3, 3)), ("fc.weight", (10, 6)))}
        for _ in range(3)
    ]
    for v, version in enumerate(versions):
        version["bn.num_batches_tracked"] = np.array(10 * v, dtype=np.int64)
    current = versions[-1]
    bases = [versions[i % 3] for i in range(n)]
    updates = [
        {
            k: (5.0 if i == 3 else 0.1) * rng.normal(size=v.shape).astype(np.float32)
            if k in FLOAT_KEYS
            else np.array(2**i, dtype=np.int64)  # no ties around the median
            for k, v in current.items()
        }
        for i in range(n)
    ]
    models = [{k: np.asarray(b[k] + u[k]) for k in u} for b, u in zip(bases, updates, strict=True)]
    valid = [
        ValidReply(
            10 + i,
            weight=1e308 if i == 0 else 10.0,
            metrics=MetricRecord({"num-examples": 10}),
            arrays={k: torch.from_numpy(v) for k, v in m.items()},
            base={k: torch.from_numpy(v) for k, v in b.items()},
            scale=0.5 if i % 2 else 1.0,
        )
        for i, (m, b) in enumerate(zip(models, bases, strict=True))
    ]
    torch_current = {k: torch.from_numpy(v) for k, v in current.items()}
    new, report = BulyanRule(num_byzantine=f).aggregate(
        3, torch_current, Screened(valid=valid), [r.base for r in valid]
    )
    expected, chosen = bulyan_reference(updates, f)
    assert sorted(set(range(10, 10 + n)) - set(report.excluded)) == [10 + i for i in chosen]
    assert 13 in report.excluded
    for key in FLOAT_KEYS:
        np.testing.assert_allclose(new[key].numpy(), current[key] + expected[key], rtol=1e-5, atol=1e-5)
    assert new["bn.num_batches_tracked"].dtype == torch.int64
    assert int(new["bn.num_batches_tracked"]) == int(np.round(20 + expected["bn.num_batches_tracked"]))


def test_coordinatewise_stage_in_several_blocks_equals_numpy():
    rng = np.random.default_rng(5)
    values = rng.normal(size=(7, 50, 50)).astype(np.float32)  # 2500 values: 3 blocks of <= 1024
    base = {"w": torch.from_numpy(rng.normal(size=(50, 50)).astype(np.float32))}
    models = [{"w": base["w"] + torch.from_numpy(v)} for v in values]
    out = mean_closest_to_median(models, [base] * 7, beta=3, device=CPU, block_bytes=1)
    updates = np.stack([(m["w"] - base["w"]).numpy() for m in models])
    closest = np.argsort(np.abs(updates - np.median(updates, axis=0)), axis=0)[:3]
    np.testing.assert_allclose(out["w"].numpy(), np.take_along_axis(updates, closest, axis=0).mean(0), rtol=1e-6)


def test_too_few_names_the_numbers():
    for f in (0, 1, 2):
        rule = BulyanRule(num_byzantine=f)
        assert rule.too_few(4 * f + 2) == (
            f"strategy.num_byzantine={f} needs n >= 4f+3 = {4 * f + 3} valid replies for Bulyan (n={4 * f + 2})"
        )
        assert rule.too_few(4 * f + 3) is None
    assert "n >= 4f+3 = 11" in _strategy(BulyanRule(num_byzantine=2)).cohort_problem(10)
    assert _strategy(BulyanRule(num_byzantine=2)).cohort_problem(11) is None


def test_too_few_replies_skip_the_round_as_flower_does():
    rng = np.random.default_rng(6)
    global_model, _, replies = _round(rng, 6, outliers={})
    arrays, report = _aggregate(BulyanRule(num_byzantine=1), global_model, replies)
    assert arrays is None and report.policy == "skip"
    assert FlowerBulyan(num_malicious_nodes=1).aggregate_train(1, replies) == (None, None)


def test_nan_update_is_rejected_and_named():
    rng = np.random.default_rng(7)
    global_model, models, replies = _round(rng, 8, outliers={})
    models[3]["fc.weight"][0, 0] = np.nan
    replies[3] = make_reply(103, models[3], {"num-examples": 20})
    arrays, report = _aggregate(BulyanRule(num_byzantine=1), global_model, replies)  # 7 finite: enough
    assert arrays is not None and all(np.isfinite(arrays[k].numpy()).all() for k in FLOAT_KEYS)
    assert [r.node_id for r in report.rejected] == [103]
    assert "non-finite" in report.rejected[0].reason
    assert 103 not in report.scores and 103 not in report.accepted and len(report.accepted) == 5  # theta = 7 - 2


# --- through the config, as a user runs it ---------------------------------------------------


def test_strategy_bulyan_runs_synchronously_and_keeps_n_minus_2f(tmp_path):
    """`strategy=bulyan` through the real ServerApp round loop and ClientApp (in process): the
    rule is found by its registry name, every round keeps n - 2f replies by Krum score."""
    from app.run.results import read_rows
    from app.tools.in_process import run_in_process

    summary, _ = run_in_process("strategy=bulyan strategy.num_byzantine=1 federation.rounds=2", tmp_path, nodes=7)
    rows = read_rows(Path(summary["run_dir"]))
    assert [r["round"] for r in rows] == [1, 2] and summary["strategy"] == "bulyan"
    for row in rows:
        assert len(row["robust"]["selected"]) == 7 - 2 and len(row["robust"]["excluded"]) == 2
    assert rows[-1]["accuracy"] > 0.5


def test_too_few_nodes_for_bulyan_are_refused_before_anything_is_written(tmp_path):
    from app.config.schema import ConfigError
    from app.tools.in_process import run_in_process

    with pytest.raises(ConfigError, match=r"num_byzantine=2 needs n >= 4f\+3 = 11 valid replies for Bulyan \(n=10\)"):
        run_in_process("strategy=bulyan strategy.num_byzantine=2 federation.rounds=1", tmp_path, nodes=10)
    assert list(tmp_path.iterdir()) == []


def test_fedbuff_buffer_aggregator_bulyan_sizes_its_buffer_to_the_rule():
    from app.config.compose import load_config
    from app.run.factory import StrategyParts, build_strategy
    from strategies.fedbuff import FedBuff
    from strategies.settings import ReplyLimits, TaskWiring

    cfg, _ = load_config("strategy=fedbuff strategy.buffer_aggregator=bulyan strategy.num_byzantine=1")
    strategy = build_strategy(cfg, StrategyParts(torch.device("cpu"), None, ReplyLimits(), TaskWiring()))
    assert isinstance(strategy, FedBuff) and isinstance(strategy.buffer_rule, BulyanRule)
    assert strategy.size_buffer(8) == 7  # half of 8 is 4, below Bulyan's 4f + 3 = 7


def test_equal_distances_to_the_median_go_to_the_lower_reply_index_on_every_device():
    """Updates 3, -1, 1, -3: median 0, distances 3, 1, 1, 3; the third closest of four ties between
    reply 0 (3) and reply 3 (-3). The lower index wins, whatever the device's sort does with ties
    (CUDA's topk and the CPU's chose differently on an H200)."""
    base = {"w": torch.zeros(1)}
    models = [{"w": torch.tensor([v])} for v in (3.0, -1.0, 1.0, -3.0)]
    out = mean_closest_to_median(models, [base] * 4, 3, torch.device("cpu"))
    assert out["w"].item() == pytest.approx((3.0 - 1.0 + 1.0) / 3)
    flipped = mean_closest_to_median(models[::-1], [base] * 4, 3, torch.device("cpu"))
    assert flipped["w"].item() == pytest.approx((-3.0 + 1.0 - 1.0) / 3)  # now -3 has the lower index


def test_ties_everywhere_are_broken_by_reply_index_as_a_stable_numpy_sort_does():
    """Small integers make most coordinates tie somewhere: the result must be NumPy's with a
    stable argsort (the lower reply index first), not whatever the sort kernel prefers."""
    rng = np.random.default_rng(0)
    values = rng.integers(-3, 4, size=(8, 1000)).astype(np.float32)
    base = {"w": torch.zeros(1000)}
    models = [{"w": torch.from_numpy(v)} for v in values]
    out = mean_closest_to_median(models, [base] * 8, 5, torch.device("cpu"))["w"].numpy()
    median = np.median(values, axis=0)
    order = np.argsort(np.abs(values - median), axis=0, kind="stable")[:5]
    expected = np.take_along_axis(values, order, axis=0).mean(axis=0)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)
