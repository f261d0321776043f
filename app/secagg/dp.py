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

Adaptive clipping trusts no node's bit: masks are additive, so one node can put any value in the
count's coordinate. The decoded count is clamped to what the survivors can have sent, [0, s]
widened by 8 standard deviations of the count's noise and each bit's rounding (`count_bounds`):
one node then moves the clip no further than all of them agreeing could. The clip stays within
[`clip_floor`, secagg.clipping_range]: the floor is where the grid's rounding, not the clip,
starts to bound a node's vector (C / step = sqrt(dim) / 2: the sensitivity there is twice the
clip's, the epsilon of a round about 4 times the configured one), or the configured clip if
lower; the ceiling is the largest coordinate the ring carries, and the ring must hold the noise
of a clip there (`room_problem`). A checkpoint's clip is put back within the same bounds.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from app.privacy.skellam import Release, charged_variance, epsilon, noise_variance, per_client_variance, sensitivity
from app.secagg.ring import NOISE_STDS_OF_ROOM, Ring
from strategies.budget import PrivacyBudgetExhausted

log = logging.getLogger("flwr.fedgpu." + __name__)


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
    clip_floor: float = field(init=False)  # the adaptive clip's lower bound (the module's docstring)

    def __post_init__(self) -> None:
        self.clip_floor = min(self.clip_norm, self.ring.step * math.sqrt(self.dim) / 2)

    @property
    def clip_ceiling(self) -> float:
        """The adaptive clip's upper bound: the largest coordinate the ring carries."""
        return self.ring.clipping_range

    def bounded(self, clip: float) -> float:
        return min(max(clip, self.clip_floor), self.clip_ceiling)

    @property
    def mechanism(self) -> str:
        return "skellam (distributed), " + ("adaptive clipping" if self.adaptive else "fixed clipping")

    def count_std(self, planned: int) -> float:
        return self.count_noise or planned / 20

    def plan(self, planned: int, clip: float | None = None) -> tuple[float, float]:
        """Each node's Skellam variance (ring units) for the update (at `clip`, default the current
        clip) and for the unclipped count."""
        scale = 1.0 / self.ring.step
        update = per_client_variance(noise_variance(self.noise_multiplier, clip or self.clip_norm, scale), planned)
        count = per_client_variance((self.count_std(planned) * scale) ** 2, planned) if self.adaptive else 0.0
        return update, count

    def room_problem(self, planned: int) -> str | None:
        """Whether the planned sum plus its noise fits the ring (checked before a round); an adaptive
        clip may grow to its ceiling, and its noise with it."""
        update, count = self.plan(planned, self.clip_ceiling if self.adaptive else None)
        return self.ring.room(planned, math.sqrt(planned * max(update, count)))

    def count_bounds(self, planned: int, survivors: int) -> tuple[float, float]:
        """What `survivors` honest bits, each with its noise share, can sum to: [0, survivors] widened
        by NOISE_STDS_OF_ROOM standard deviations of their noise and each bit's rounding."""
        margin = NOISE_STDS_OF_ROOM * self.count_std(planned) * math.sqrt(survivors / planned)
        margin += survivors * self.ring.step
        return -margin, survivors + margin

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

    def account(self, planned: int, survivors: int, unclipped_sum: float | None) -> str | None:
        """Charge a round's release; adapt the clip from its noised count, clamped to `count_bounds`.
        Returns why the count was clamped (a node sent more than its bit), or None."""
        self.releases.extend(self.charged(planned, survivors))
        if not self.adaptive or unclipped_sum is None:
            return None
        lo, hi = self.count_bounds(planned, survivors)
        count = min(max(unclipped_sum, lo), hi)
        fraction = count / planned
        self.last_noised_unclipped_fraction = fraction
        self.clip_norm = self.bounded(self.clip_norm * math.exp(-self.clip_lr * (fraction - self.target_quantile)))
        if count == unclipped_sum:
            return None
        return (
            f"the securely summed count of unclipped updates is {unclipped_sum:.6g}, outside [{lo:.3g}, {hi:.3g}] "
            f"(what {survivors} survivors can send with their noise): a node sent more than its bit; counted as "
            f"{count:.3g}, the clip norm is now {self.clip_norm:.6g}"
        )

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
        """A checkpoint's releases and clip: a release or clip that is not a finite number is refused
        (ValueError); a clip outside [clip_floor, clip_ceiling] (one written before the clip was
        bounded, after a node pushed it to 0 or past the ring) is put back within them, with a warning."""
        try:
            releases = [Release(*map(float, r)) for r in state["releases"]]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"the checkpoint's distributed DP releases are malformed ({err})") from None
        clip = state.get("clip_norm")
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip):
            raise ValueError(f"the checkpoint's distributed DP clip_norm is {clip!r}, not a finite number")
        self.releases, self.clip_norm = releases, self.bounded(float(clip))
        if self.clip_norm != clip:
            log.warning(
                "the checkpoint's distributed DP clip_norm %g is outside [%.3g, %g] (the adaptive clip's floor and "
                "secagg.clipping_range): resuming with %g", clip, self.clip_floor, self.clip_ceiling, self.clip_norm
            )  # fmt: skip
