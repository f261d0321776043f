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
