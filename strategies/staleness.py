"""Staleness weights of asynchronous updates (FedBuff and friends).

An update trained from model version v arrives when the server is at version V; its
staleness is τ = V − v. Older updates point the model somewhere it no longer is, so
they count less. The three functions of Xie et al. 2019 ("Asynchronous Federated
Optimization", https://arxiv.org/abs/1903.03934), as FedBuff uses them (Nguyen et al.
2022, "Federated Learning with Buffered Asynchronous Aggregation",
https://arxiv.org/abs/2106.06639, which weights by 1/sqrt(1 + τ)):

- constant:   s(τ) = 1
- polynomial: s(τ) = (1 + τ)^(−a)
- hinge:      s(τ) = 1 if τ <= b, else 1 / (a·(τ − b) + 1)
"""

from __future__ import annotations

from collections.abc import Callable

STALENESS_FUNCTIONS = ("constant", "polynomial", "hinge")

StalenessFn = Callable[[int], float]


def staleness_fn(name: str, a: float = 0.5, b: float = 4.0) -> StalenessFn:
    """The weight function `name` with parameters a (and b for hinge)."""
    if name not in STALENESS_FUNCTIONS:
        raise ValueError(f"staleness function {name!r} is unknown; allowed: {', '.join(STALENESS_FUNCTIONS)}")
    if name == "polynomial" and a < 0:
        raise ValueError(f"polynomial staleness needs a >= 0 (a={a}); a < 0 would favour stale updates")
    if name == "hinge" and (a < 0 or b < 0):
        raise ValueError(f"hinge staleness needs a >= 0 and b >= 0 (a={a}, b={b})")

    def weight(tau: int) -> float:
        if tau < 0:
            raise ValueError(f"staleness {tau} < 0: an update cannot come from a future model version")
        if name == "polynomial":
            return (1.0 + tau) ** (-a)
        if name == "hinge":
            return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)
        return 1.0

    return weight
