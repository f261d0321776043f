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
    """A coalition's model is previous + lr * the sum of its members' parts of the released step
    (share w / W of all the buffer's weight, not renormalised), each update taken from the model
    it trained from; an update longer than the median is credited up to the median and its excess
    counts only when it did harm; scores are summed per node."""
    from app.config.schema import LedgerConfig
    from app.run.contributions import RoundScores
    from strategies.replies import ValidReply

    previous = {"w": torch.tensor([0.0, 0.0])}
    old = {"w": torch.tensor([1.0, -1.0])}  # a stale update's base
    target = torch.tensor([1.0, 2.0])
    buffer = [
        ValidReply(7, 1.0, None, {"w": torch.tensor([1.0, 2.0])}, base=previous),  # the update (1, 2), norm √5
        ValidReply(8, 3.0, None, {"w": torch.tensor([1.0, -3.0])}, base=old),  # the update (0, -2), norm 2
        ValidReply(7, 2.0, None, {"w": torch.tensor([2.0, 2.0])}),  # no base: from `previous`, (2, 2), norm √8
    ]
    lr = 0.5
    shares = [lr * r.weight / 6.0 for r in buffer]
    bounded = torch.tensor([2.0, 2.0]) * (5**0.5 / 8**0.5)  # clipped to the median norm, √5
    parts = {  # (entry, part) -> its contribution to the step
        (0, "private"): shares[0] * torch.tensor([1.0, 2.0]),
        (1, "private"): shares[1] * torch.tensor([0.0, -2.0]),
        (2, "private"): shares[2] * bounded,
        (2, "unearned"): shares[2] * (torch.tensor([2.0, 2.0]) - bounded),
    }

    def v(members) -> float:  # the closed form
        w = previous["w"] + sum((parts[m] for m in members), torch.zeros(2))
        return -float((w - target).pow(2).sum())

    everyone = set(parts)
    loo = {p: v(everyone) - v(everyone - {p}) for p in parts}
    metric_of = lambda state: -float((state["w"] - target).pow(2).sum())  # noqa: E731
    scores = RoundScores(LedgerConfig(contribution="loo"), metric_of, seed=0).score_buffer(previous, buffer, lr)
    assert scores[7] == pytest.approx(loo[(0, "private")] + loo[(2, "private")] + min(0.0, loo[(2, "unearned")]))
    assert scores[8] == pytest.approx(loo[(1, "private")])
    exact = RoundScores(LedgerConfig(contribution="shapley", shapley_permutations=24), metric_of, seed=0)
    shapley_scores = exact.score_buffer(previous, buffer, lr)  # 4 players, 4! orders: exact
    assert exact.totals == shapley_scores
    # the grand coalition is the step FedBuff released (no server momentum)
    released = previous["w"] + lr * sum(r.weight * (r.arrays["w"] - (r.base or previous)["w"]) for r in buffer) / 6.0
    assert v(everyone) == pytest.approx(metric_of({"w": released}))


def _quadratic(target: torch.Tensor):  # noqa: ANN202
    return lambda state: -float((state["w"] - target).pow(2).sum())


def test_a_replay_of_the_public_step_is_a_null_player_and_honest_updates_earn():
    """Free-riders (Lin et al. 2019; Fraboni et al. 2021) that send the global model plus any
    multiple of the last global step (0: a copy of the global model) and claim a weight far above
    the honest nodes' score at most 0 under LOO and Shapley; honest nodes, whose updates carry
    information the last step did not, score above every one of them."""
    from app.config.schema import LedgerConfig
    from app.run.contributions import RoundScores
    from strategies.replies import ValidReply

    g = torch.Generator().manual_seed(3)
    target = torch.randn(16, generator=g)
    before, now = torch.zeros(16), 0.3 * target + 0.05 * torch.randn(16, generator=g)  # the last step: public
    honest = {i: 0.4 * (target - now) + 0.05 * torch.randn(16, generator=g) for i in range(4)}
    riders = {10: 1.0, 11: 5.0, 12: 0.0, 13: -1.0}  # node -> multiple of the last step it replays
    for method in ("loo", "shapley"):
        scores = RoundScores(LedgerConfig(contribution=method, shapley_permutations=30), _quadratic(target), seed=1)
        scores.score({"w": before}, [])  # the round before: the server saw the model `before`
        replies = [ValidReply(i, 100.0, None, {"w": now + u}) for i, u in honest.items()]
        replies += [ValidReply(i, 1e5, None, {"w": now + s * (now - before)}) for i, s in riders.items()]
        got = scores.score({"w": now}, replies)
        assert all(got[i] <= 0.0 for i in riders), (method, got)
        assert min(got[i] for i in honest) > max(got[i] for i in riders), (method, got)
        assert got[10] == got[11] == got[12] == 0.0, got  # a replay that helped: exactly nothing
        assert got[13] < 0.0, got  # undoing the last step did harm: on its account


def test_a_scaled_update_earns_no_more_than_its_median_sized_self():
    """Norm bounding: an honest update sent five times over is credited as the median-norm update
    (its excess counts only against it), so scaling earns nothing."""
    from app.config.schema import LedgerConfig
    from app.run.contributions import RoundScores, bound_norms, orthonormal, split_public
    from strategies.replies import ValidReply

    updates = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 1.0]), torch.tensor([6.0, 8.0])]
    assert [float(u.norm()) for u in bound_norms(updates)] == pytest.approx([5.0, 1.0, 5.0])
    (q,) = orthonormal([torch.tensor([2.0, 0.0]), torch.tensor([4.0, 0.0])])  # one direction
    public, private = split_public(torch.tensor([3.0, 0.0]) * 7, [q])
    assert torch.equal(private, torch.zeros(2)) and public.tolist() == pytest.approx([21.0, 0.0])

    target = torch.tensor([10.0, 10.0, 10.0, 10.0])
    start = {"w": torch.zeros(4)}
    u = torch.tensor([1.0, 1.0, 0.0, 0.0])
    plain = [ValidReply(i, 1.0, None, {"w": u.clone() + 0.01 * i}) for i in range(3)]
    boosted = [*plain[:2], ValidReply(2, 1.0, None, {"w": 5 * (u + 0.02)})]
    for method in ("loo", "shapley"):
        cfg = LedgerConfig(contribution=method, shapley_permutations=24)
        fair = RoundScores(cfg, _quadratic(target), seed=0).score(start, plain)
        gamed = RoundScores(cfg, _quadratic(target), seed=0).score(start, boosted)
        assert gamed[2] <= fair[2] + 1e-6, (method, fair, gamed)


def test_under_a_robust_rule_a_claim_buys_no_share_and_an_excluded_update_scores_nothing():
    """Robust rules ignore claimed counts: two equal updates score alike whatever they claim, an
    update the rule excluded is a null player, and a skipped step scores nobody (the shares are
    the rule's, not the claims')."""
    from app.config.schema import LedgerConfig
    from app.run.contributions import RoundScores, step_shares
    from strategies.replies import ValidReply

    target = torch.tensor([1.0, 1.0, 0.0])
    start = {"w": torch.zeros(3)}
    u = torch.tensor([0.5, 0.5, 0.0])
    replies = [
        ValidReply(1, 10.0, None, {"w": u.clone()}),
        ValidReply(2, 1e5, None, {"w": u.clone()}),  # the same update, claiming ten thousand times more
        ValidReply(3, 10.0, None, {"w": u + torch.tensor([0.0, 0.0, 0.1])}),
        ValidReply(4, 10.0, None, {"w": -4 * u}),  # excluded by the rule
    ]
    krum = {"selected": [1, 2, 3], "excluded": [4], "scores": {}, "policy": None}
    assert step_shares(dict(enumerate(replies)), krum) == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3, 3: 0.0})
    for method in ("loo", "shapley"):
        cfg = LedgerConfig(contribution=method, shapley_permutations=24, shapley_tolerance=0.0)  # exact
        got = RoundScores(cfg, _quadratic(target), seed=0).score(start, replies, krum)
        assert got[1] == pytest.approx(got[2]) and got[1] > 0, (method, got)
        assert got[4] == 0.0, got
        mean = RoundScores(cfg, _quadratic(target), seed=0).score(start, replies)  # a mean: claims weigh
        assert mean[2] > mean[1], (method, mean)
        skipped = RoundScores(cfg, _quadratic(target), seed=0).score(start, replies, {**krum, "policy": "skip"})
        assert not any(skipped.values()), skipped
