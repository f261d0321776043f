"""Contribution scores of one synchronous round or FedBuff version (`ledger.contribution`): each
node's leave-one-out or Shapley value for the server's validation metric, from the updates the
step had (app/ledger/contribution.py has the maths).

A coalition's model is what a plain mean of its members' updates would have made: in a round,
the weighted mean of their models (their capped weights), as FedAvg; in a FedBuff version, the
model before the version plus `server_lr` times the weighted mean of their buffered updates
(capped counts times the staleness factor), each taken from the model it trained from, without
server momentum. The empty coalition is the model before the step. The scores thus measure what
a node's update was worth to a plain mean, also under a robust rule (which may have left it out:
the ledger records that separately).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from app.config.schema import LedgerConfig
from app.ledger.contribution import CachedValue, leave_one_out, shapley
from strategies.fedbuff import server_step
from strategies.replies import ValidReply
from strategies.robust_ops import weighted_update_mean
from strategies.tensor_ops import TensorDict, weighted_mean

CPU = torch.device("cpu")


class RoundScores:
    """Scores per step, and their running totals per node."""

    def __init__(self, cfg: LedgerConfig, metric_of: Callable[[TensorDict], float], seed: int) -> None:
        self.cfg, self.metric_of = cfg, metric_of
        self.rng = random.Random(seed)
        self.totals: dict[int, float] = {}
        self.evaluations = 0

    def score(self, previous: TensorDict, valid: list[ValidReply]) -> dict[int, float]:
        """node id -> this round's score (empty without a valid reply)."""
        by_node = {r.node_id: r for r in valid}

        def model(members: Sequence[int]) -> TensorDict:
            replies = [by_node[i] for i in members]
            return weighted_mean([r.arrays for r in replies], [r.weight for r in replies], CPU)

        return self._by_node(self._score(previous, list(by_node), model), by_node)

    def score_buffer(self, previous: TensorDict, buffer: list[ValidReply], server_lr: float) -> dict[int, float]:
        """node id -> this FedBuff version's score, summed over the node's updates in the buffer
        (a fast node may have two there)."""
        entries = dict(enumerate(buffer))

        def model(members: Sequence[int]) -> TensorDict:
            replies = [entries[i] for i in members]
            bases = [r.base if r.base is not None else previous for r in replies]
            update = weighted_update_mean([r.arrays for r in replies], bases, [r.weight for r in replies], CPU)
            return server_step(previous, update, server_lr, 0.0, None)[0]

        return self._by_node(self._score(previous, list(entries), model), entries)

    def _score(
        self, previous: TensorDict, players: list[int], model: Callable[[Sequence[int]], TensorDict]
    ) -> dict[int, float]:
        """player -> score, where a coalition is worth metric_of(model(its sorted members))."""
        if not players:
            return {}

        def value(coalition: frozenset[int]) -> float:
            return self.metric_of(model(sorted(coalition)) if coalition else previous)

        cached = CachedValue(value)
        if self.cfg.contribution == "loo":
            scores = leave_one_out(cached, players)
        else:
            scores = shapley(cached, players, self.cfg.shapley_permutations, self.rng, self.cfg.shapley_tolerance)
        self.evaluations += cached.evaluations
        return scores

    def _by_node(self, scores: dict[int, float], replies: dict[int, ValidReply]) -> dict[int, float]:
        """Player scores summed per node, and added to the running totals."""
        out: dict[int, float] = {}
        for player, s in scores.items():
            node = replies[player].node_id
            out[node] = out.get(node, 0.0) + s
        for node, s in out.items():
            self.totals[node] = self.totals.get(node, 0.0) + s
        return out
