"""How much each node's update improved the model in one round, from the updates already
received, without retraining: leave-one-out and Monte-Carlo Shapley values over the round's
aggregation (`ledger.contribution=loo|shapley`).

A coalition's value v(S) is the server's validation metric of the model aggregated from the
updates of S alone (v of the empty set: the model before the round). Leave-one-out gives node i
v(N) - v(N without i): cheap (n + 1 evaluations), but two nodes with the same data each look
worthless, since either can stand in for the other. The Shapley value averages i's marginal
value v(P + i) - v(P) over the orders in which nodes could have joined; it is estimated from
random permutations with truncation, as GTG-Shapley does (Liu et al. 2022, "GTG-Shapley:
Efficient and Accurate Participant Contribution Evaluation in Federated Learning"): once a
prefix is within `tolerance` of v(N), the rest of that permutation adds nothing. Without
truncation the scores sum exactly to v(N) - v(empty), whatever the number of permutations,
because each permutation's marginals telescope.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence

Value = Callable[[frozenset[int]], float]


class CachedValue:
    """v(S), each coalition evaluated once (the permutations revisit prefixes)."""

    def __init__(self, value: Value) -> None:
        self._value, self._cache = value, {}

    def __call__(self, coalition: frozenset[int]) -> float:
        if coalition not in self._cache:
            self._cache[coalition] = float(self._value(coalition))
        return self._cache[coalition]

    @property
    def evaluations(self) -> int:
        return len(self._cache)


def leave_one_out(value: Value, players: Sequence[int]) -> dict[int, float]:
    """v(N) - v(N without i) for every player i."""
    everyone = frozenset(players)
    total = value(everyone)
    return {i: total - value(everyone - {i}) for i in players}


def shapley(
    value: Value, players: Sequence[int], permutations: int, rng: random.Random, tolerance: float = 0.0
) -> dict[int, float]:
    """Shapley values from `permutations` random orders (truncated at `tolerance`); exact, from
    every order, when there are no more orders than that."""
    if permutations < 1:
        raise ValueError(f"permutations={permutations} must be >= 1")
    everyone = frozenset(players)
    total = value(everyone)
    scores = dict.fromkeys(players, 0.0)
    if math.factorial(len(players)) <= permutations:  # few players: every order once, the exact value
        orders = [list(o) for o in itertools.permutations(players)]
    else:
        orders = [rng.sample(list(players), len(players)) for _ in range(permutations)]
    for order in orders:
        prefix: frozenset[int] = frozenset()
        before = value(prefix)
        for i in order:
            if tolerance > 0 and abs(total - before) <= tolerance:
                break  # truncated: the remaining players add nothing in this order
            prefix = prefix | {i}
            after = value(prefix)
            scores[i] += after - before
            before = after
    return {i: s / len(orders) for i, s in scores.items()}
