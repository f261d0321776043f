"""Central (client-level) differential privacy with honest accounting.

The Gaussian mechanism of DP-FedAvg (McMahan et al. 2018, "Learning Differentially
Private Recurrent Language Models", https://arxiv.org/abs/1710.06963): every client
update Δᵢ (model − the model it trained from) is clipped to L2 norm ≤ C, the clipped
updates are summed with equal weight, N(0, (z·C)²) noise is added to every coordinate
of the sum, and the sum is divided by the expected cohort size m. One client changes
the sum by at most C, whatever it sends, so the release is (z, q)-Gaussian.

Sample counts are not used as weights: a client's weight would scale its influence
on the sum, and it is a number the client itself reports, so the sensitivity bound C
would no longer hold (a client claiming a huge count could dominate the release).

Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive
Clipping", https://arxiv.org/abs/1905.03871): after each release the clip norm moves
geometrically toward the `target_quantile` of the update norms, estimated from a noised
count of unclipped updates (noise std σ_b). That count is released too, so the
accountant charges the combined noise multiplier (z⁻² + (2σ_b)⁻²)^(−1/2).

Accounting: Opacus's RDP accountant, one step per release with the sampling rate that
was really used: q = fraction when nodes are Poisson-sampled with that probability
(`poisson_sampling`), q = 1 otherwise (a fixed-size cohort chosen by the server claims
no amplification). FedBuff's buffer flushes are releases with q = 1.

The noise generator is seeded from the operating system's CSPRNG, never from the run's
seed: noise an attacker can reproduce protects nothing.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType
from flwr.serverapp import Grid
from opacus.accountants import RDPAccountant

from strategies.fedavg import FedAvg
from strategies.fedbuff import FedBuff
from strategies.opacus_logging import remove_opacus_root_handler
from strategies.replies import Screened
from strategies.robust_ops import apply_update, float_keys
from strategies.tensor_ops import TensorDict

log = logging.getLogger("flwr.fedgpu." + __name__)
remove_opacus_root_handler()  # Opacus calls logging.basicConfig on import


class PrivacyBudgetExhausted(RuntimeError):
    """The next release would take ε past the budget; it was not made."""


def update_norm(update: TensorDict) -> float:
    """L2 norm over all floating-point tensors of an update."""
    norms = [t.float().norm() for t in update.values() if t.is_floating_point()]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def clip_update(update: TensorDict, clip: float) -> tuple[TensorDict, float]:
    """The update scaled to L2 norm ≤ clip, and its norm before (floating-point tensors only)."""
    norm = update_norm(update)
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: t.float() * scale if t.is_floating_point() else t for k, t in update.items()}, norm


def combined_noise_multiplier(noise_multiplier: float, count_noise_std: float | None) -> float:
    """The noise multiplier the accountant charges per release (Andrew et al. 2021, Thm 1)."""
    if not count_noise_std:
        return noise_multiplier
    return (noise_multiplier**-2 + (2 * count_noise_std) ** -2) ** -0.5


@dataclass
class AdaptiveClip:
    """Geometric clip-norm update toward a target quantile of update norms."""

    target_quantile: float = 0.5
    lr: float = 0.2
    count_noise_std: float = 0.0  # σ_b; set from the expected cohort when 0

    def next_clip(self, clip: float, unclipped_fraction: float) -> float:
        return clip * math.exp(-self.lr * (unclipped_fraction - self.target_quantile))


class CentralDP:
    """Clip, sum, noise and account: the server side of client-level DP."""

    def __init__(
        self,
        *,
        noise_multiplier: float,
        clip_norm: float,
        delta: float,
        sample_rate: float = 1.0,
        max_epsilon: float = 0.0,
        adaptive: AdaptiveClip | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if noise_multiplier <= 0 or clip_norm <= 0 or not 0 < delta < 1 or not 0 < sample_rate <= 1:
            raise ValueError(
                f"need noise_multiplier > 0, clip_norm > 0, 0 < delta < 1 and 0 < sample_rate <= 1 "
                f"(got {noise_multiplier}, {clip_norm}, {delta}, {sample_rate})"
            )
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.delta = delta
        self.sample_rate = sample_rate
        self.max_epsilon = max_epsilon
        self.adaptive = adaptive
        self.generator = generator or torch.Generator().manual_seed(secrets.randbits(63))
        self.accountant = RDPAccountant()
        self.releases = 0
        self.last_clipped_fraction: float | None = None

    @property
    def mechanism(self) -> str:
        return "gaussian, adaptive clipping" if self.adaptive else "gaussian, fixed clipping"

    def charged_noise_multiplier(self, expected_cohort: float) -> float:
        return combined_noise_multiplier(
            self.noise_multiplier, self._count_std(expected_cohort) if self.adaptive else None
        )

    def _count_std(self, expected_cohort: float) -> float:
        assert self.adaptive is not None
        return self.adaptive.count_noise_std or expected_cohort / 20

    def epsilon(self, extra_releases: int = 0, expected_cohort: float = 1.0) -> float:
        """ε at δ after the releases so far (plus `extra_releases` hypothetical ones)."""
        if self.releases + extra_releases == 0:
            return 0.0
        accountant = RDPAccountant()
        accountant.history = list(self.accountant.history)
        for _ in range(extra_releases):
            accountant.step(
                noise_multiplier=self.charged_noise_multiplier(expected_cohort), sample_rate=self.sample_rate
            )
        return float(accountant.get_epsilon(delta=self.delta))

    def check_budget(self, expected_cohort: float) -> None:
        """Raise PrivacyBudgetExhausted when one more release would exceed max_epsilon."""
        if self.max_epsilon and (after := self.epsilon(1, expected_cohort)) > self.max_epsilon:
            raise PrivacyBudgetExhausted(
                f"privacy budget: release {self.releases + 1} would take epsilon from "
                f"{self.epsilon():.3f} to {after:.3f} > privacy.max_epsilon={self.max_epsilon} (delta={self.delta})"
            )

    def release(
        self,
        updates: Iterable[TensorDict],
        like: TensorDict,
        expected_cohort: float,
        scales: Sequence[float] | None = None,
    ) -> TensorDict:
        """(Σ sᵢ·clip(Δᵢ) + N(0, (zC)²)) / m, with m the expected cohort; accounted.

        `updates` is consumed one at a time (a generator keeps one update in memory).
        `scales` sᵢ ≤ 1 (FedBuff's staleness weights) can only lower a client's
        influence, so the sensitivity stays C. `like` gives keys, shapes and device (the
        current global model). Integer tensors (BatchNorm counters) are not released:
        they come back as zeros (no change).
        """
        if scales is not None and not all(0 <= x <= 1 for x in scales):
            raise ValueError(f"need one scale in [0, 1] per update, got {scales}")
        self.check_budget(expected_cohort)
        clip = self.clip_norm
        total = {k: torch.zeros(t.shape, dtype=torch.float32, device=t.device) for k, t in like.items()}
        unclipped = count = 0
        pairs = zip(updates, scales, strict=True) if scales is not None else ((u, 1.0) for u in updates)
        for update, scale in pairs:
            count += 1
            clipped, norm = clip_update(update, clip)
            unclipped += norm <= clip
            for k, t in clipped.items():
                if t.is_floating_point():
                    total[k].add_(t.to(total[k].device), alpha=scale)
        std = self.noise_multiplier * clip
        for k, t in like.items():
            if t.is_floating_point():
                noise = torch.normal(0.0, std, size=t.shape, generator=self.generator)
                total[k].add_(noise.to(total[k].device)).div_(expected_cohort)
        self.accountant.step(
            noise_multiplier=self.charged_noise_multiplier(expected_cohort), sample_rate=self.sample_rate
        )
        self.releases += 1
        self.last_clipped_fraction = 1 - unclipped / count if count else None
        if self.adaptive is not None:
            noised = unclipped + float(
                torch.normal(0.0, self._count_std(expected_cohort), (1,), generator=self.generator)
            )
            self.clip_norm = self.adaptive.next_clip(clip, noised / expected_cohort)
        return total

    def summary(self) -> dict[str, Any]:
        """What summary.json records about privacy."""
        return {
            "epsilon": self.epsilon(),
            "delta": self.delta,
            "mechanism": self.mechanism,
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.clip_norm,
            "sampling": "poisson" if self.sample_rate < 1 else "none (q = 1)",
            "sample_rate": self.sample_rate,
            "releases": self.releases,
            "accountant": "opacus RDPAccountant",
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [list(h) for h in self.accountant.history],
            "releases": self.releases,
            "clip_norm": self.clip_norm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.history = [tuple(h) for h in state["history"]]
        self.releases = int(state["releases"])
        self.clip_norm = float(state["clip_norm"])


class DPFedAvg(FedAvg):
    """FedAvg whose aggregate is a central-DP release (see the module docstring).

    With `poisson=True` every connected node joins a round independently with
    probability `fraction_train` (the sampling the accountant's q assumes); the
    expected cohort is q·N. Otherwise the cohort is FedAvg's fixed-size sample and
    the accountant uses q = 1. A round whose cohort sent no valid update still releases
    (noise only): skipping it would reveal that the cohort was empty.
    """

    screen_finite = True  # NaN/Inf replies are rejected before clipping

    def __init__(self, *, dp: CentralDP, poisson: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if poisson and dp.sample_rate != self.fraction_train:
            raise ValueError(
                f"Poisson sampling at {self.fraction_train} must be accounted with q = {self.fraction_train}"
            )
        self.dp, self.poisson = dp, poisson
        self._expected_cohort = 1.0

    def summary(self) -> None:
        super().summary()
        log.info(
            "central DP: noise multiplier %g, clip %g (%s), delta %g, %s sampling (q = %g)%s",
            self.dp.noise_multiplier,
            self.dp.clip_norm,
            self.dp.mechanism,
            self.dp.delta,
            "Poisson" if self.poisson else "fixed-size",
            self.dp.sample_rate,
            f", budget epsilon <= {self.dp.max_epsilon}" if self.dp.max_epsilon else "",
        )

    def select_nodes(self, grid: Grid, fraction: float, minimum: int, kind: str) -> list[int]:
        if not self.poisson or kind != MessageType.TRAIN:
            return super().select_nodes(grid, fraction, minimum, kind)
        return [n for n in grid.get_node_ids() if random.random() < fraction]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample the cohort, then check the budget before any message is sent."""
        nodes = len(list(grid.get_node_ids()))
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._expected_cohort = self.fraction_train * nodes if self.poisson else max(len(messages), 1)
        self.dp.check_budget(self._expected_cohort)
        return messages

    def aggregate_models(self, server_round: int, screened: Screened) -> TensorDict | None:
        # Called with no valid reply too: DP still releases (noise only).
        keys = float_keys(self._global)
        updates = ({k: r.arrays[k].float() - self._global[k].float() for k in keys} for r in screened.valid)
        noised_mean = self.dp.release(updates, self._global, self._expected_cohort)
        return apply_update(self._global, noised_mean)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dp": self.dp.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.dp.load_state_dict(state["dp"])


class DPFedBuff(FedBuff):
    """FedBuff whose buffer flush is a central-DP release with q = 1.

    The buffered updates are clipped and summed with their staleness weights s(τ) ≤ 1
    (which never raise one client's influence above C), never with sample counts, and
    divided by K.
    """

    def __init__(self, *, dp: CentralDP, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.buffer_rule is not None:
            raise ValueError("central DP has no sensitivity bound for a robust buffer rule")
        if dp.sample_rate != 1.0:
            raise ValueError("FedBuff's releases are accounted with q = 1")
        self.dp = dp

    def summary(self) -> None:
        super().summary()
        log.info(
            "central DP: noise multiplier %g, clip %g (%s), delta %g, one release per buffer flush (q = 1)%s",
            self.dp.noise_multiplier,
            self.dp.clip_norm,
            self.dp.mechanism,
            self.dp.delta,
            f", budget epsilon <= {self.dp.max_epsilon}" if self.dp.max_epsilon else "",
        )

    def _aggregate_buffer(self, current: TensorDict) -> TensorDict:
        keys = float_keys(current)
        updates = ({k: r.arrays[k].float() - r.base[k].float() for k in keys} for r in self.buffer)
        scales = [min(self.staleness(r.staleness), 1.0) for r in self.buffer]
        return self.dp.release(updates, current, self.buffer_size, scales)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dp": self.dp.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.dp.load_state_dict(state["dp"])
