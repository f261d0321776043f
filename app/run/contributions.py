"""Contribution scores of one synchronous round (`ledger.contribution`): each node's leave-one-out
or Shapley value for the server's validation metric, from the round's valid replies
(app/ledger/contribution.py has the maths).

A coalition's model is the weighted mean of its members' models (their capped weights), what
FedAvg would have made of them; the empty coalition is the model before the round. The scores
thus measure what a node's update was worth to a plain mean, also under a robust rule (which
may have left it out: the ledger records that separately).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from app.config.schema import LedgerConfig
from app.ledger.contribution import CachedValue, leave_one_out, shapley
from strategies.replies import ValidReply
from strategies.tensor_ops import TensorDict, weighted_mean


class RoundScores:
    """Scores per round, and their running totals per node."""

    def __init__(self, cfg: LedgerConfig, metric_of: Callable[[TensorDict], float], seed: int) -> None:
        self.cfg, self.metric_of = cfg, metric_of
        self.rng = random.Random(seed)
        self.totals: dict[int, float] = {}
        self.evaluations = 0

    def score(self, previous: TensorDict, valid: list[ValidReply]) -> dict[int, float]:
        """node id -> this round's score (empty without a valid reply)."""
        if not valid:
            return {}
        by_node = {r.node_id: r for r in valid}

        def value(coalition: frozenset[int]) -> float:
            if not coalition:
                return self.metric_of(previous)
            members = [by_node[i] for i in sorted(coalition)]
            model = weighted_mean([r.arrays for r in members], [r.weight for r in members], torch.device("cpu"))
            return self.metric_of(model)

        cached = CachedValue(value)
        players = list(by_node)
        if self.cfg.contribution == "loo":
            scores = leave_one_out(cached, players)
        else:
            scores = shapley(cached, players, self.cfg.shapley_permutations, self.rng, self.cfg.shapley_tolerance)
        self.evaluations += cached.evaluations
        for node, s in scores.items():
            self.totals[node] = self.totals.get(node, 0.0) + s
        return scores
