"""Central (client-level) DP: the Gaussian mechanism of DP-FedAvg (McMahan et al. 2018,
https://arxiv.org/abs/1710.06963) for FedAvg and FedBuff, adaptive clipping (Andrew et al. 2021,
https://arxiv.org/abs/1905.03871) and Opacus RDP accounting (add or remove one client).

The ε holds only if: each update is clipped to L2 ≤ C and weighted ≤ 1 (never by sample counts);
the accountant charges z/s per release (adaptive: `combined_noise_multiplier`), s = 1 for all nodes
or a Poisson cohort, s = 2 for a fixed-size cohort of a larger population (FedAvg's sample, every
FedBuff buffer, one update per node); q < 1 only for a Poisson cohort drawn with `secrets.SystemRandom`;
the noise is seeded from the OS's CSPRNG, never the run's seed; the divisor is the public expected
cohort m, never the number of replies. Why, with the derivations: docs/privacy.md#central-client-level-dp
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType
from flwr.serverapp import Grid
from opacus.accountants import RDPAccountant

from strategies.budget import PrivacyBudgetExhausted
from strategies.fedavg import FedAvg
from strategies.fedbuff import FEDBUFF_SERVER_LR, BufferStep, FedBuff
from strategies.node_names import labels
from strategies.node_wait import wait_for_nodes
from strategies.opacus_logging import remove_opacus_root_handler
from strategies.replies import Rejection, Screened, ValidReply, reject, warn_rejected
from strategies.robust_ops import apply_update, float_keys
from strategies.server_opt import ServerOptimizer
from strategies.settings import ReplyLimits, Sampling, TaskWiring
from strategies.staleness import StalenessFn
from strategies.tensor_ops import TensorDict, non_finite_keys

log = logging.getLogger("flwr.fedgpu." + __name__)
remove_opacus_root_handler()  # Opacus calls logging.basicConfig on import


class NonFiniteRelease(RuntimeError):
    """A release (or the model it makes) would hold NaN or Inf; it was not made."""


def update_norm(update: TensorDict) -> float:
    """L2 norm over all floating-point tensors of an update."""
    norms = [t.float().norm() for t in update.values() if t.is_floating_point()]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def clip_update(update: TensorDict, clip: float) -> tuple[TensorDict, float]:
    """The update scaled to L2 norm ≤ clip, and its norm before (floating-point tensors only)."""
    norm = update_norm(update)
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: t.float() * scale if t.is_floating_point() else t for k, t in update.items()}, norm


def require_finite(tensors: TensorDict, what: str) -> TensorDict:
    """`tensors` unchanged, or NonFiniteRelease naming the keys with NaN or Inf."""
    if bad := non_finite_keys(tensors):
        raise NonFiniteRelease(f"{what} has NaN or Inf in {bad}: not released")
    return tensors


NON_FINITE_UPDATE = "its update (model - base) is non-finite in float32 (NaN or Inf): left out of the release"


def combined_noise_multiplier(
    noise_multiplier: float, count_noise_std: float | None, sensitivity: float = 1.0
) -> float:
    """The Gaussian noise multiplier the accountant charges per release.

    Rényi DP of order α of a Gaussian with sensitivity Δ and std σ is αΔ²/(2σ²); the
    update sum (Δ = sC, σ = zC) and the centred count (Δ = s/2, σ = σ_b) add up to
    α/(2z̃²) with z̃ = (z⁻² + (2σ_b)⁻²)^(−1/2) / s (Andrew et al. 2021, Thm 1, for s = 1).
    """
    if not count_noise_std:
        return noise_multiplier / sensitivity
    return (noise_multiplier**-2 + (2 * count_noise_std) ** -2) ** -0.5 / sensitivity


def cohort_sensitivity(*, fedbuff: bool, poisson: bool, fraction_train: float) -> float:
    """Sensitivity of the update sum in units of C (module docstring): 2 when the cohort
    is a fixed-size subset of a larger population, so that one more client can push
    another out; 1 when it is everyone or a Poisson sample."""
    return 2.0 if fedbuff or (not poisson and fraction_train < 1) else 1.0


def centred_count(norms: Sequence[float], clip: float) -> float:
    """Σ(bᵢ − ½), bᵢ = 1 if ‖Δᵢ‖ ≤ clip: adding or removing one update moves it by exactly ½."""
    return sum((n <= clip) - 0.5 for n in norms)


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
        sensitivity: float = 1.0,
        max_epsilon: float = 0.0,
        adaptive: AdaptiveClip | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if noise_multiplier <= 0 or clip_norm <= 0 or not 0 < delta < 1 or not 0 < sample_rate <= 1:
            raise ValueError(
                f"need noise_multiplier > 0, clip_norm > 0, 0 < delta < 1 and 0 < sample_rate <= 1 "
                f"(got {noise_multiplier}, {clip_norm}, {delta}, {sample_rate})"
            )
        if sensitivity not in (1.0, 2.0):
            raise ValueError(f"sensitivity={sensitivity}: 1 (add or remove one client) or 2 (one replaces another)")
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.delta = delta
        self.sample_rate = sample_rate
        self.sensitivity = sensitivity
        self.max_epsilon = max_epsilon
        self.adaptive = adaptive
        self.generator = generator or torch.Generator().manual_seed(secrets.randbits(63))
        self.accountant = RDPAccountant()
        self.releases = 0
        self.last_clipped_fraction: float | None = None  # exact: not covered by epsilon
        self.last_noised_unclipped_fraction: float | None = None  # b̃, a DP release (adaptive clipping)

    @property
    def mechanism(self) -> str:
        return "gaussian, adaptive clipping" if self.adaptive else "gaussian, fixed clipping"

    def charged_noise_multiplier(self, expected_cohort: float) -> float:
        return combined_noise_multiplier(
            self.noise_multiplier, self._count_std(expected_cohort) if self.adaptive else None, self.sensitivity
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
        refused: list[int] | None = None,
    ) -> TensorDict:
        """(Σ sᵢ·clip(Δᵢ) + N(0, (zC)²)) / m, with m the expected cohort; accounted.

        `updates` is consumed one at a time (a generator keeps one update in memory).
        `scales` sᵢ ≤ 1 (FedBuff's staleness weights) can only lower a client's
        influence, so the sensitivity stays C. `like` gives keys, shapes and device (the
        current global model). Integer tensors (BatchNorm counters) are not released:
        they come back as zeros (no change). A non-finite `like` or result raises
        NonFiniteRelease before the accountant is charged.

        With `refused` (a list the caller names the nodes from), an update holding NaN or Inf
        (a finite reply whose difference from its base overflowed float32) is left out and its
        index appended, instead of turning the sum into NaN: the release is then the one without
        that client, a neighbouring input, so the accounting holds. Found through the clipping
        norm, which is finite for every finite update but the huge ones: no extra pass.
        """
        if not expected_cohort > 0:
            raise ValueError(f"expected_cohort={expected_cohort}: the release divides by it, so it must be > 0")
        if scales is not None and not all(0 <= x <= 1 for x in scales):
            raise ValueError(f"need one scale in [0, 1] per update, got {scales}")
        require_finite(like, "the global model the release would update")
        self.check_budget(expected_cohort)
        clip = self.clip_norm
        total = {k: torch.zeros(t.shape, dtype=torch.float32, device=t.device) for k, t in like.items()}
        norms: list[float] = []
        pairs = zip(updates, scales, strict=True) if scales is not None else ((u, 1.0) for u in updates)
        for i, (update, scale) in enumerate(pairs):
            clipped, norm = clip_update(update, clip)
            if refused is not None and not math.isfinite(norm) and non_finite_keys(update):
                refused.append(i)
                continue
            norms.append(norm)
            for k, t in clipped.items():
                if t.is_floating_point():
                    total[k].add_(t.to(total[k].device), alpha=scale)
        std = self.noise_multiplier * clip
        for k, t in like.items():
            if t.is_floating_point():
                noise = torch.normal(0.0, std, size=t.shape, generator=self.generator)
                total[k].add_(noise.to(total[k].device)).div_(expected_cohort)
        require_finite(total, f"release {self.releases + 1} (the noised mean update)")
        noised_fraction = None
        if self.adaptive is not None:
            count_noise = float(torch.normal(0.0, self._count_std(expected_cohort), (1,), generator=self.generator))
            noised_fraction = (centred_count(norms, clip) + count_noise) / expected_cohort + 0.5
        self.accountant.step(
            noise_multiplier=self.charged_noise_multiplier(expected_cohort), sample_rate=self.sample_rate
        )
        self.releases += 1
        self.last_clipped_fraction = sum(n > clip for n in norms) / len(norms) if norms else None
        if noised_fraction is not None:
            self.last_noised_unclipped_fraction = noised_fraction
            self.clip_norm = self.adaptive.next_clip(clip, noised_fraction)
        return total

    def summary(self) -> dict[str, Any]:
        """What summary.json records about privacy."""
        return {
            "epsilon": self.epsilon(),
            "delta": self.delta,
            "mechanism": self.mechanism,
            "noise_multiplier": self.noise_multiplier,
            "clip_norm": self.clip_norm,
            "sensitivity": self.sensitivity,  # in units of clip_norm: 2 = fixed-size cohort from a larger population
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


def _taking(valid: Iterable[ValidReply], taken: list[ValidReply]) -> Iterator[ValidReply]:
    """`valid` in turn, each appended to `taken` (small once a streamed reply's arrays are dropped)."""
    for reply in valid:
        taken.append(reply)
        yield reply


class DPFedAvg(FedAvg):
    """FedAvg whose aggregate is a central-DP release (see the module docstring).

    With `poisson=True` every connected node joins a round independently with
    probability `fraction_train`, drawn from `secrets.SystemRandom` (the sampling the
    accountant's q assumes); the expected cohort is q·N with N the population: the
    nodes connected when the first cohort is drawn (after waiting for
    `min_available_nodes`, as FedAvg does), kept in checkpoints. A fixed N keeps the
    divisor public and nonzero when nodes come and go; nodes that join later are
    sampled too (the sum's sensitivity is unchanged, only the mean's scale drifts).
    Otherwise the cohort is FedAvg's fixed-size sample and the accountant uses q = 1
    (and sensitivity 2C when that sample is smaller than the population). A round whose
    cohort sent no valid update still releases (noise only): skipping it would reveal
    that the cohort was empty.

    DP-FedAvg [McMahan et al., 2018], with adaptive clipping [Andrew et al., 2021] when
    `dp.adaptive` is set.

    Parameters
    ----------
    dp : CentralDP
        The mechanism: clip norm, noise multiplier, δ, budget and accountant. Its
        `sample_rate` must be `fraction_train` with `poisson`, and its `sensitivity`
        2 for a fixed-size sample smaller than the population (`cohort_sensitivity`).
    poisson : bool (default: False)
        Sample each node independently with probability `fraction_train` instead of
        FedAvg's fixed-size sample.
    sampling, limits, wiring, device
        As in `FedAvg` (counts never weigh a release; the weight cap bounds the training
        metrics' weights).
    """

    screen_finite = True  # NaN/Inf replies are rejected before clipping

    def __init__(
        self,
        *,
        dp: CentralDP,
        poisson: bool = False,
        sampling: Sampling | None = None,
        limits: ReplyLimits | None = None,
        wiring: TaskWiring | None = None,
        device: torch.device | str = "cpu",
        server_opt: ServerOptimizer | None = None,
    ) -> None:
        super().__init__(sampling=sampling, limits=limits, wiring=wiring, device=device, server_opt=server_opt)
        if poisson and dp.sample_rate != self.sampling.fraction_train:
            raise ValueError(
                f"Poisson sampling at {self.sampling.fraction_train} must be accounted with q = {self.sampling.fraction_train}"
            )
        expected = cohort_sensitivity(fedbuff=False, poisson=poisson, fraction_train=self.sampling.fraction_train)
        if dp.sensitivity < expected:
            raise ValueError(
                f"a fixed-size cohort of a fraction {self.sampling.fraction_train} has sensitivity {expected}C"
            )
        self.dp, self.poisson = dp, poisson
        self.population = 0  # Poisson: N, fixed by the first cohort drawn
        self._cohort_rng = secrets.SystemRandom()
        self._expected_cohort = 1.0

    def summary(self) -> None:
        super().summary()
        log.info(
            "central DP: noise multiplier %g, clip %g (%s), delta %g, %s sampling (q = %g), sensitivity %gC%s",
            self.dp.noise_multiplier,
            self.dp.clip_norm,
            self.dp.mechanism,
            self.dp.delta,
            "Poisson" if self.poisson else "fixed-size",
            self.dp.sample_rate,
            self.dp.sensitivity,
            f", budget epsilon <= {self.dp.max_epsilon}" if self.dp.max_epsilon else "",
        )

    def select_nodes(self, grid: Grid, fraction: float, minimum: int, kind: str) -> list[int]:
        if not self.poisson or kind != MessageType.TRAIN:
            return super().select_nodes(grid, fraction, minimum, kind)
        # A bounded wait for min_available_nodes (at least one). A node missing from the Poisson
        # draw only lowers its own sampling probability: the accountant's q still bounds everyone's.
        connected = wait_for_nodes(
            grid,
            max(self.sampling.min_available_nodes, 1),
            1,
            self.sampling.round_wait_timeout_s,
            self.seen,
            names=self.wiring.names,
        )
        if not self.population:
            self.population = len(connected)
            log.info("central DP: population N = %d, expected cohort %g", self.population, fraction * self.population)
        return [n for n in connected if self._cohort_rng.random() < fraction]

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample the cohort, then check the budget before any message is sent."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._expected_cohort = (
            self.sampling.fraction_train * self.population if self.poisson else max(len(messages), 1)
        )
        self.dp.check_budget(self._expected_cohort)
        return messages

    def aggregate_models(self, server_round: int, screened: Screened) -> TensorDict | None:
        return self.fold_models(server_round, list(screened.valid), screened)

    def fold_models(self, server_round: int, valid: Iterable[ValidReply], screened: Screened) -> TensorDict | None:
        """Clip each update as it comes and add it to the release's sum (`CentralDP.release` reads
        `valid` lazily), then noise once: gathered or streamed, one update at a time.

        Called with no valid reply too: DP still releases (noise only).
        An update that overflows float32 is left out of the release and its reply rejected. The
        model after a release cannot be checked and redone like FedAvg's (`finite_step`): a second
        release would spend ε again. It is finite unless clip_norm / the cohort is absurd (every
        update moves it by at most C / m), so a non-finite one stops the run (NonFiniteRelease).
        """
        keys = float_keys(self._global)
        taken: list[ValidReply] = []  # release's index i is the i-th reply taken
        updates = ({k: r.arrays[k].float() - self._global[k].float() for k in keys} for r in _taking(valid, taken))
        refused: list[int] = []
        noised_mean = self.dp.release(updates, self._global, self._expected_cohort, refused=refused)
        for i in refused:
            reject(screened, taken[i], NON_FINITE_UPDATE)
        nodes = labels([r.node_id for r in screened.valid], self.wiring.names)
        return require_finite(
            apply_update(self._global, noised_mean), f"round {server_round}'s model (updates of {nodes})"
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dp": self.dp.state_dict(), "population": self.population}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.dp.load_state_dict(state["dp"])
        self.population = int(state.get("population", 0))


class DPFedBuff(FedBuff):
    """FedBuff whose buffer flush is a central-DP release with q = 1 and sensitivity 2C.

    The buffered updates are clipped and summed with their staleness weights s(τ) ≤ 1
    (which never raise one client's influence above C), never with sample counts, and
    divided by K. At most one update per node goes into a release: a node whose update
    waits in the buffer is not sent a new task until the flush. (The other way, a newer
    update replacing the older one as the robust buffer does, would have the node train
    for nothing.) So K must not exceed the nodes that can train at once. The buffer is
    the first K distinct nodes to answer, a fixed-size subset: one more client can push
    another out, hence 2C. (A robust buffer rule has no such sensitivity bound: this class
    takes none.)

    FedBuff [Nguyen et al., 2022] with DP-FedAvg's Gaussian mechanism [McMahan et al.,
    2018], and adaptive clipping [Andrew et al., 2021] when `dp.adaptive` is set.

    Parameters
    ----------
    dp : CentralDP
        The mechanism, with `sample_rate` 1 and `sensitivity` 2.
    buffer_size, concurrency, max_staleness, staleness, staleness_name, server_lr, server_momentum
        The buffer, the staleness bound and weights and the server step, as in
        `FedBuff`; `buffer_size` must not exceed a nonzero `concurrency`.
    sampling, limits, wiring, poll_interval_s, deadline_grace_s, device
        As in `FedBuff`.
    """

    one_update_per_node = "central-DP"

    @property
    def streams(self) -> bool:
        """Gathered: the release (`dp.release`) clips each buffered update with the others; not folded."""
        return False

    def __init__(
        self,
        *,
        dp: CentralDP,
        buffer_size: int = 10,
        concurrency: int = 0,
        max_staleness: int = 10,
        staleness: StalenessFn,
        staleness_name: str = "polynomial",
        server_lr: float = FEDBUFF_SERVER_LR,
        server_momentum: float = 0.0,
        sampling: Sampling | None = None,
        limits: ReplyLimits | None = None,
        wiring: TaskWiring | None = None,
        poll_interval_s: float = 0.02,
        deadline_grace_s: float = 5.0,
        device: torch.device | str = "cpu",
        stall_versions: int = 0,
    ) -> None:
        super().__init__(
            buffer_size=buffer_size,
            concurrency=concurrency,
            max_staleness=max_staleness,
            staleness=staleness,
            staleness_name=staleness_name,
            server_lr=server_lr,
            server_momentum=server_momentum,
            sampling=sampling,
            limits=limits,
            wiring=wiring,
            poll_interval_s=poll_interval_s,
            deadline_grace_s=deadline_grace_s,
            device=device,
            stall_versions=stall_versions,
        )
        if dp.sample_rate != 1.0 or dp.sensitivity != 2.0:
            raise ValueError("FedBuff's releases are accounted with q = 1 and sensitivity 2C")
        if self.concurrency and self.buffer_size > self.concurrency:
            raise ValueError(
                f"buffer_size={self.buffer_size} > concurrency={self.concurrency}: "
                "a DP buffer takes one update per node"
            )
        self.dp = dp

    def summary(self) -> None:
        super().summary()
        log.info(
            "central DP: noise multiplier %g, clip %g (%s), delta %g, one release per buffer flush (q = 1, "
            "sensitivity 2C), at most one update per node per release%s",
            self.dp.noise_multiplier,
            self.dp.clip_norm,
            self.dp.mechanism,
            self.dp.delta,
            f", budget epsilon <= {self.dp.max_epsilon}" if self.dp.max_epsilon else "",
        )

    def held_nodes(self) -> set[int]:
        """Nodes with an update in the buffer: no new task before the flush."""
        return {r.node_id for r in self.buffer}

    def _aggregate_buffer(self, current: TensorDict, buffer: list[ValidReply]) -> BufferStep:
        nodes = [r.node_id for r in buffer]
        if len(set(nodes)) != len(nodes):  # the sensitivity bound assumes it: never release otherwise
            raise RuntimeError(f"a DP buffer holds two updates of one node: {sorted(nodes)}")
        keys = float_keys(current)
        updates = ({k: r.arrays[k].float() - r.base[k].float() for k in keys} for r in buffer)
        scales = [min(self.staleness(r.staleness), 1.0) for r in buffer]
        refused: list[int] = []
        update = self.dp.release(updates, current, self.buffer_size, scales, refused=refused)
        rejected = [Rejection(buffer[i].node_id, NON_FINITE_UPDATE) for i in refused]
        for rejection in rejected:
            warn_rejected(rejection.node_id, rejection.reason, self.wiring.names)
        lr = self.server_lr / self.buffer_size
        used = [
            (r, r.arrays, r.base, lr * s)
            for i, (r, s) in enumerate(zip(buffer, scales, strict=True))
            if i not in refused
        ]
        return BufferStep(update, used, rejected)

    def _step(self, current, kept):  # noqa: ANN001, ANN202 - FedBuff._step's
        """FedBuff's step, never redone: a second release would spend ε again (see
        DPFedAvg.aggregate_models), so a model that is still not finite stops the run."""
        new, parts, state = super()._step(current, kept)
        if new is not None:
            nodes = labels([p[0].node_id for p in parts if isinstance(p[0], ValidReply)], self.wiring.names)
            require_finite(new, f"version {self.version + 1}'s model (updates of {nodes})")
        return new, parts, state

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dp": self.dp.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.dp.load_state_dict(state["dp"])
