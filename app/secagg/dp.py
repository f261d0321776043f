"""Distributed DP under secure aggregation (privacy=distributed / distributed_adaptive): the
server's plan of each node's Skellam noise, its accounting of what the sum really carried, and
adaptive clipping from the securely summed count of unclipped updates (Andrew et al. 2021).

The server never sees an update, so it cannot clip or noise one: each node clips its update to
L2 <= C, rounds it to the ring's grid and adds Skellam noise of variance mu / n (n: the nodes
that get a training task). Skellam sums are Skellam, so with every node in, the sum carries
exactly the configured mechanism, of variance mu = (z C / step)^2 in ring units (std z C in
the model's units, as central DP's Gaussian). A node that drops takes its noise with it: the
accountant charges the variance the survivors added, mu x survivors / n, never the plan
(app/privacy/skellam.py for the RDP bound and its conditions).

What the epsilon assumes: adjacency replaces one node's update by zero while its noise share
stays in the sum (the cohort is public: the server picked it; one update per node per release:
SecAgg+ sums each survivor once); no amplification by sampling
(the server picks the cohort and knows it); every node draws its noise honestly from its own
CSPRNG (a node that adds less noise weakens everyone's guarantee: the colluding-clients
bound of SecAgg+ does not extend to noise); the divisor is the number of tasks sent, public.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from app.privacy.skellam import Release, charged_variance, epsilon, noise_variance, per_client_variance, sensitivity
from app.secagg.ring import Ring
from strategies.budget import PrivacyBudgetExhausted


@dataclass
class DistributedDP:
    """The plan, the accountant and the adaptive clip of distributed DP."""

    noise_multiplier: float  # z: the sum's noise std over C
    clip_norm: float  # C, float units
    delta: float
    ring: Ring
    dim: int  # the update's coordinates
    max_epsilon: float = 0.0
    adaptive: bool = False
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    count_noise: float = 0.0  # std of the noise on the unclipped count; 0 = planned cohort / 20
    releases: list[Release] = field(default_factory=list)
    last_noised_unclipped_fraction: float | None = None

    @property
    def mechanism(self) -> str:
        return "skellam (distributed), " + ("adaptive clipping" if self.adaptive else "fixed clipping")

    def count_std(self, planned: int) -> float:
        return self.count_noise or planned / 20

    def plan(self, planned: int) -> tuple[float, float]:
        """Each node's Skellam variance (ring units) for the update and for the unclipped count."""
        scale = 1.0 / self.ring.step
        update = per_client_variance(noise_variance(self.noise_multiplier, self.clip_norm, scale), planned)
        count = per_client_variance((self.count_std(planned) * scale) ** 2, planned) if self.adaptive else 0.0
        return update, count

    def room_problem(self, planned: int) -> str | None:
        """Whether the planned sum plus its noise fits the ring (checked before a round)."""
        update, count = self.plan(planned)
        return self.ring.room(planned, math.sqrt(planned * max(update, count)))

    def charged(self, planned: int, survivors: int) -> list[Release]:
        """The releases a round with `survivors` of `planned` noisy inputs makes."""
        scale = 1.0 / self.ring.step
        update, count = self.plan(planned)
        l1, l2 = sensitivity(self.clip_norm, scale, self.dim)
        out = [Release(charged_variance(update, survivors), l1, l2)]
        if self.adaptive:
            unit = float(round(scale))  # one node's bit, rounded to the grid
            out.append(Release(charged_variance(count, survivors), unit, unit))
        return out

    def epsilon(self, extra: list[Release] | None = None) -> float:
        history = self.releases + (extra or [])
        return epsilon(history, self.delta)[0] if history else 0.0

    def check_budget(self, planned: int, fewest: int) -> None:
        """Raise PrivacyBudgetExhausted when a round with only `fewest` (t) of `planned` survivors would
        exceed max_epsilon: the budget must hold whatever drops."""
        if self.max_epsilon and (after := self.epsilon(self.charged(planned, fewest))) > self.max_epsilon:
            raise PrivacyBudgetExhausted(
                f"privacy budget: release {len(self.releases) + 1} would take epsilon from {self.epsilon():.3f} "
                f"to {after:.3f} > privacy.max_epsilon={self.max_epsilon} (delta={self.delta})"
            )

    def account(self, planned: int, survivors: int, unclipped_sum: float | None) -> None:
        """Charge a round's release; adapt the clip from its noised count."""
        self.releases.extend(self.charged(planned, survivors))
        if self.adaptive and unclipped_sum is not None:
            fraction = unclipped_sum / planned
            self.last_noised_unclipped_fraction = fraction
            self.clip_norm *= math.exp(-self.clip_lr * (fraction - self.target_quantile))

    def summary(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon(),
            "delta": self.delta,
            "mechanism": self.mechanism,
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.clip_norm,
            "releases": len(self.releases),
            "sampling": "none (the server knows the cohort)",
            "accountant": "skellam RDP (app/privacy/skellam.py)",
        }

    def state_dict(self) -> dict[str, Any]:
        return {"releases": [[r.mu, r.l1, r.l2] for r in self.releases], "clip_norm": self.clip_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.releases = [Release(*map(float, r)) for r in state["releases"]]
        self.clip_norm = float(state["clip_norm"])
