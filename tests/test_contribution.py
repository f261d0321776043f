"""Contribution scores (app/ledger/contribution.py) on constructed rounds with closed-form values."""

from __future__ import annotations

import random

import pytest
import torch

from app.ledger.contribution import CachedValue, leave_one_out, shapley


def _round(updates: dict[int, torch.Tensor], target: torch.Tensor) -> CachedValue:
    """v(S) = -|mean of S's updates - target|^2 (the empty set: no update, the old model at 0)."""

    def value(coalition: frozenset[int]) -> float:
        mean = torch.stack([updates[i] for i in sorted(coalition)]).mean(0) if coalition else torch.zeros_like(target)
        return -float((mean - target).pow(2).sum())

    return CachedValue(value)


def _attacked(n_honest: int = 5) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    target = torch.ones(8)
    updates = {i: target + 0.1 * torch.randn(8, generator=g) for i in range(n_honest)}
    updates[99] = -torch.stack(list(updates.values())).mean(0)  # the exact negative of the others' mean
    return updates, target


@pytest.mark.parametrize("method", ["loo", "shapley"])
def test_the_node_sending_the_negative_of_the_others_mean_ranks_last(method):
    updates, target = _attacked()
    value = _round(updates, target)
    players = list(updates)
    if method == "loo":
        scores = leave_one_out(value, players)
    else:
        scores = shapley(value, players, permutations=200, rng=random.Random(1))
    assert min(scores, key=scores.get) == 99, scores
    assert scores[99] < 0 < min(s for i, s in scores.items() if i != 99), scores


def test_identical_updates_get_identical_scores():
    updates = {i: torch.full((4,), 0.5) for i in range(4)}
    value = _round(updates, torch.ones(4))
    exact = shapley(value, list(updates), permutations=24, rng=random.Random(0))  # 4! orders: exact
    assert len(set(exact.values())) == 1 and exact[0] == pytest.approx(
        (value(frozenset(updates)) - value(frozenset())) / 4
    )
    assert set(leave_one_out(value, list(updates)).values()) == {0.0}


def test_shapley_scores_sum_to_the_rounds_improvement():
    updates, target = _attacked(n_honest=6)  # 7 players: 5040 orders, 50 sampled
    value = _round(updates, target)
    scores = shapley(value, list(updates), permutations=50, rng=random.Random(2))
    improvement = value(frozenset(updates)) - value(frozenset())
    assert sum(scores.values()) == pytest.approx(improvement, rel=1e-9)  # the marginals telescope
    truncated = shapley(value, list(updates), permutations=50, rng=random.Random(2), tolerance=0.05)
    assert sum(truncated.values()) == pytest.approx(improvement, abs=0.05 * 2)


def test_values_are_evaluated_once_per_coalition():
    calls = []
    value = CachedValue(lambda s: calls.append(s) or len(s))
    leave_one_out(value, [1, 2, 3])
    shapley(value, [1, 2, 3], permutations=6, rng=random.Random(0))
    assert len(calls) == len(set(calls)) == value.evaluations == 8  # the 2^3 subsets, each once


def test_a_fedbuff_buffer_is_scored_from_each_updates_own_base_with_the_server_lr():
    """Coalition models are previous + lr * weighted mean of (model - its base), summed per node."""
    from app.config.schema import LedgerConfig
    from app.run.contributions import RoundScores
    from strategies.replies import ValidReply

    previous = {"w": torch.tensor([0.0, 0.0])}
    old = {"w": torch.tensor([1.0, -1.0])}  # a stale update's base
    target = torch.tensor([1.0, 2.0])
    buffer = [
        ValidReply(7, 1.0, None, {"w": torch.tensor([1.0, 2.0])}, base=previous),  # the update (1, 2)
        ValidReply(8, 3.0, None, {"w": torch.tensor([1.0, -3.0])}, base=old),  # the update (0, -2)
        ValidReply(7, 2.0, None, {"w": torch.tensor([2.0, 2.0])}),  # no base: from `previous`, (2, 2)
    ]
    lr = 0.5

    def v(members: list[int]) -> float:  # the closed form
        if not members:
            return -float((previous["w"] - target).pow(2).sum())
        updates = [buffer[i].arrays["w"] - (buffer[i].base or previous)["w"] for i in members]
        weights = [buffer[i].weight for i in members]
        mean = sum(w * u for w, u in zip(weights, updates, strict=True)) / sum(weights)
        return -float((previous["w"] + lr * mean - target).pow(2).sum())

    metric_of = lambda state: -float((state["w"] - target).pow(2).sum())  # noqa: E731
    loo = RoundScores(LedgerConfig(contribution="loo"), metric_of, seed=0).score_buffer(previous, buffer, lr)
    assert loo[7] == pytest.approx((v([0, 1, 2]) - v([1, 2])) + (v([0, 1, 2]) - v([0, 1])))
    assert loo[8] == pytest.approx(v([0, 1, 2]) - v([0, 2]))
    exact = RoundScores(LedgerConfig(contribution="shapley", shapley_permutations=6), metric_of, seed=0)
    scores = exact.score_buffer(previous, buffer, lr)  # 3! orders: exact
    assert sum(scores.values()) == pytest.approx(v([0, 1, 2]) - v([]))
    assert exact.totals == scores
