"""Distributed DP under secure aggregation: the Skellam mechanism's noise and its accountant.

Each client clips its update to L2 norm <= C, scales it by `scale` (ring units per float unit),
rounds every coordinate to the nearest integer and adds integer Skellam noise of variance mu/n
per coordinate, drawn on the node (`skellam_noise`, `os_rng`). Secure aggregation shows the
server only the sum over the survivors. Skellam(mu) here is Poisson(mu/2) - Poisson(mu/2): mean
0, variance mu, and a sum of independent Skellams is Skellam with the summed variance, so when s
of the n planned clients survive the sum carries variance mu * s / n (`charged_variance`):
dropouts remove noise, and the accountant charges what the sum actually held (`Release`).

RDP bound (Agarwal, Kairouz, Liu, "The Skellam Mechanism for Differentially Private Federated
Learning", NeurIPS 2021, arXiv:2110.04995, the multi-dimensional Skellam mechanism's RDP; the
same expression as `_skellam_rdp` in the authors' google-research/federated distributed_dp code,
there written in float units): for an integer-valued query whose neighbouring values differ by
an integer vector of L1 norm <= D1 and L2 norm <= D2, adding independent Skellam noise of
variance mu to every coordinate is (alpha, eps(alpha))-RDP for every INTEGER alpha > 1 with

    eps(alpha) <= alpha D2^2 / (2 mu) + min( ((2 alpha - 1) D2^2 + 6 D1) / (4 mu^2),  3 D1 / (2 mu) ).

The first term is the Gaussian mechanism's; the min is the price of discreteness, O(1/mu^2)
for large mu.

Adjacency: one client's contribution present or zeroed (its data added or removed; the client
is in the cohort either way and its noise share is in the sum either way), so D is the norm of
one client's rounded vector (`sensitivity`), not twice it. Every survivor's noise is counted: a
client that tells the server its noise removes its share, which this accountant does not model.
Privacy amplification by sampling does NOT apply: the server chooses the cohort and knows it.
Releases compose by adding RDP over rounds; (epsilon, delta) comes from the same conversion as
central and local DP here (Opacus's `get_privacy_spent`, Balle et al. 2020), so the figures
compare.
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from strategies.opacus_logging import remove_opacus_root_handler

# The bound holds for integer orders only; past a few hundred the best order is rarely needed
# (it is for epsilon far below 1), and orders above 1/delta make the conversion meaningless.
ORDERS: tuple[int, ...] = tuple(range(2, 257)) + (320, 384, 448, 512, 640, 768, 896, 1024)
# noise_for_epsilon gives up beyond this total variance (ring units squared).
MAX_VARIANCE = 1e30


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _count(name: str, value: int, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


def _delta(delta: float) -> float:
    if not (isinstance(delta, (int, float, np.floating)) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


def sensitivity(clip: float, scale: float, dim: int) -> tuple[float, float]:
    """(L1, L2) bounds on one client's vector round(scale * x), ||x||_2 <= clip, `dim` coordinates.

    Rounding to nearest moves each coordinate by <= 1/2, so L2 <= scale*clip + sqrt(dim)/2
    (triangle inequality). L1 <= sqrt(dim) * L2 (Cauchy-Schwarz; equal to the direct
    scale*clip*sqrt(dim) + dim/2), and, the coordinates being integers (|v_i| <= v_i^2),
    L1 <= L2^2, which is the smaller when scale*clip < sqrt(dim)/2.
    """
    clip, scale = _positive("clip", clip), _positive("scale", scale)
    dim = _count("dim", dim, 1)
    l2 = scale * clip + math.sqrt(dim) / 2
    return min(math.sqrt(dim) * l2, l2 * l2), l2


def skellam_rdp(mu: float, l1: float, l2: float, orders: Sequence[int] = ORDERS) -> np.ndarray:
    """The RDP bound above at every order: Skellam noise of variance `mu` per coordinate on an
    integer query of L1 / L2 sensitivity `l1` / `l2`. ValueError on a non-integer order or order <= 1
    (the paper proves the bound for integer orders > 1 only)."""
    mu = _positive("mu (the Skellam variance)", mu)
    for name, value in (("l1", l1), ("l2", l2)):
        if not (isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} (a sensitivity) must be a finite number >= 0, got {value!r}")
    alpha = np.asarray(orders, dtype=float)
    if alpha.ndim != 1 or not np.all(alpha == np.floor(alpha)) or not np.all(alpha > 1):
        raise ValueError(f"orders must be integers > 1 (the Skellam bound holds for those only), got {orders!r}")
    gaussian = alpha * l2**2 / (2 * mu)
    discrete = np.minimum(((2 * alpha - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))
    return gaussian + discrete


@dataclass(frozen=True)
class Release:
    """What one round's sum actually held: Skellam variance `mu` per coordinate (the survivors'
    shares added up) and the L1 / L2 sensitivity of one client's vector in ring units."""

    mu: float
    l1: float
    l2: float

    def __post_init__(self) -> None:
        skellam_rdp(self.mu, self.l1, self.l2, orders=(2,))  # the same checks, raised at construction


def _to_epsilon(rdp: np.ndarray, delta: float) -> tuple[float, float]:
    # Imported here: nodes sample noise with this module without loading Opacus (and torch).
    from opacus.accountants.analysis.rdp import get_privacy_spent

    remove_opacus_root_handler()
    eps, order = get_privacy_spent(orders=list(ORDERS), rdp=rdp, delta=delta)
    # Balle et al.'s epsilon can dip below 0 at orders > 1/delta; (eps < 0, delta)-DP implies (0, delta)-DP.
    return max(float(eps), 0.0), float(order)


def epsilon(releases: Sequence[Release], delta: float) -> tuple[float, float]:
    """(epsilon, best order) at `delta` after `releases` (RDP summed over them, then Opacus's
    conversion). No release: (0.0, nan)."""
    delta = _delta(delta)
    if not releases:
        return 0.0, math.nan
    return _to_epsilon(sum(skellam_rdp(r.mu, r.l1, r.l2) for r in releases), delta)


def noise_variance(noise_multiplier: float, clip: float, scale: float) -> float:
    """Total Skellam variance mu = (noise_multiplier * clip * scale)^2 in ring units: the float-domain
    std is z * C, as for central DP's Gaussian, so the same z gives nearly the same epsilon."""
    z = _positive("noise_multiplier", noise_multiplier)
    return (z * _positive("clip", clip) * _positive("scale", scale)) ** 2


def per_client_variance(mu_total: float, planned: int) -> float:
    """Each client's share mu_total / planned: the sum holds mu_total only if all `planned` survive."""
    return _positive("mu_total", mu_total) / _count("planned", planned, 1)


def charged_variance(per_client: float, survivors: int) -> float:
    """The variance the sum actually holds when only `survivors` clients added their share: what
    the accountant must charge (dropped clients' noise never reached the sum)."""
    return _positive("per_client", per_client) * _count("survivors", survivors, 1)


def skellam_noise(shape: int | tuple[int, ...], variance: float, rng: np.random.Generator) -> np.ndarray:
    """Integer noise Poisson(variance/2) - Poisson(variance/2) of the given shape (int64): mean 0,
    `variance` per element. Variance 0 gives zeros (no noise)."""
    if not (isinstance(variance, (int, float, np.integer, np.floating)) and math.isfinite(variance) and variance >= 0):
        raise ValueError(f"variance must be a finite number >= 0, got {variance!r}")
    lam = variance / 2
    return rng.poisson(lam, size=shape).astype(np.int64) - rng.poisson(lam, size=shape).astype(np.int64)


def os_rng() -> np.random.Generator:
    """A generator seeded with 128 bits from the OS CSPRNG, never from the run's seed: the server
    knows (or can guess) a run seed, and with the noise seed it can regenerate and subtract the
    noise, leaving the client's update bare."""
    return np.random.default_rng(secrets.randbits(128))


def noise_for_epsilon(target_epsilon: float, delta: float, rounds: int, clip: float, scale: float, dim: int) -> float:
    """The smallest total variance mu (to a relative 1e-9, never under) with which `rounds` full-cohort
    releases keep epsilon <= target_epsilon: for planning a config. Epsilon falls as mu grows
    (every order's RDP does), so a bisection on log(mu) finds it. ValueError if mu up to
    MAX_VARIANCE is not enough (below about 0.004 at delta=1e-5 no mu is: the conversion alone
    costs that at the largest order)."""
    target = _positive("target_epsilon", target_epsilon)
    delta, rounds = _delta(delta), _count("rounds", rounds, 1)
    l1, l2 = sensitivity(clip, scale, dim)

    def eps(mu: float) -> float:
        return _to_epsilon(rounds * skellam_rdp(mu, l1, l2), delta)[0]

    with warnings.catch_warnings():  # Opacus warns when the best order is an end of ORDERS; expected while searching
        warnings.simplefilter("ignore", UserWarning)
        if eps(MAX_VARIANCE) > target:
            raise ValueError(
                f"target_epsilon={target_epsilon} is unreachable at delta={delta} over {rounds} rounds: "
                f"even Skellam variance {MAX_VARIANCE:g} gives more"
            )
        hi, lo = MAX_VARIANCE, MAX_VARIANCE / 1e3
        while eps(lo) <= target:  # terminates: epsilon grows without bound as mu -> 0
            hi, lo = lo, lo / 1e3
        while hi / lo > 1 + 1e-9:  # eps(lo) > target >= eps(hi)
            mid = math.sqrt(lo * hi)
            if eps(mid) <= target:
                hi = mid
            else:
                lo = mid
    return hi
