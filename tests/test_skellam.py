"""Distributed DP with Skellam noise (app/privacy/skellam.py): the RDP bound against the exact
Rényi divergence, the (ε, δ) conversion, dropouts, the sampler, noise planning, sensitivity."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from scipy.special import logsumexp

from app.privacy import skellam
from app.privacy.skellam import (
    ORDERS,
    Release,
    charged_variance,
    epsilon,
    noise_for_epsilon,
    noise_variance,
    os_rng,
    per_client_variance,
    sensitivity,
    skellam_noise,
    skellam_rdp,
)

ALPHAS = (2, 3, 5, 10, 20)


def exact_divergence(mu: float, shift: int, alpha: int) -> float:
    """D_alpha(Sk(mu) + shift || Sk(mu)) summed over a support wide enough that the rest is negligible."""
    width = int(12 * math.sqrt(mu) + 50 + shift)
    k = np.arange(-width, width + 1)
    log_p = stats.skellam.logpmf(k - shift, mu / 2, mu / 2)
    log_q = stats.skellam.logpmf(k, mu / 2, mu / 2)
    return float(logsumexp(alpha * log_p + (1 - alpha) * log_q) / (alpha - 1))


def reference_rdp(mu: float, d1: float, d2: float, alpha: np.ndarray) -> np.ndarray:
    return alpha * d2**2 / (2 * mu) + np.minimum(((2 * alpha - 1) * d2**2 + 6 * d1) / (4 * mu**2), 3 * d1 / (2 * mu))


@pytest.mark.parametrize("mu", [2.0, 20.0, 200.0, 2000.0])
@pytest.mark.parametrize("shift", [1, 3])
def test_bound_is_sound_and_tight(mu: float, shift: int) -> None:
    bound = skellam_rdp(mu, shift, shift, orders=ALPHAS)
    exact = np.array([exact_divergence(mu, shift, a) for a in ALPHAS])
    assert np.all(exact > 0)
    assert np.all(bound >= exact), (bound, exact)
    if mu >= 200:  # the discreteness surcharge vanishes: the bound and the truth approach the Gaussian's
        gaussian = np.array(ALPHAS) * shift**2 / (2 * mu)
        assert np.all(bound <= exact * 1.05 + 1e-9), (bound, exact)
        assert np.allclose(exact, gaussian, rtol=0.03)


def test_bound_formula_in_both_branches() -> None:
    """Exact-shift checks cannot see the discreteness term (the true divergence stays under the
    Gaussian's), so the formula itself is pinned, with each side of the min active."""
    alpha = np.array(ORDERS, dtype=float)
    for mu, l1, l2 in [(2.0, 3.0, 3.0), (1e4, 40.0, 10.0), (0.5, 1.0, 1.0), (1e6, 5000.0, 80.0)]:
        expected = reference_rdp(mu, l1, l2, alpha)
        assert np.allclose(skellam_rdp(mu, l1, l2), expected, rtol=1e-13, atol=0)
    quadratic = ((2 * 2 - 1) * 10.0**2 + 6 * 40.0) / (4 * 1e4**2)
    assert skellam_rdp(1e4, 40.0, 10.0, orders=(2,))[0] == pytest.approx(2 * 100 / 2e4 + quadratic, rel=1e-14)
    assert skellam_rdp(2.0, 3.0, 3.0, orders=(2,))[0] == pytest.approx(2 * 9 / 4 + 3 * 3 / 4, rel=1e-14)


def test_orders_are_integers_above_one() -> None:
    assert all(isinstance(a, int) and a > 1 for a in ORDERS)
    assert list(ORDERS) == sorted(set(ORDERS))
    for bad in [(2.5,), (1,), (0, 2)]:
        with pytest.raises(ValueError, match="orders"):
            skellam_rdp(100.0, 1.0, 1.0, orders=bad)


def test_epsilon_is_opacus_conversion_of_summed_rdp() -> None:
    clip, scale, dim, delta = 1.0, 64.0, 1000, 1e-5
    l2 = scale * clip + math.sqrt(dim) / 2
    l1 = min(math.sqrt(dim) * l2, l2**2)
    mu = noise_variance(8.0, clip, scale)
    per = per_client_variance(mu, 10)
    history = [Release(mu, l1, l2), Release(charged_variance(per, 6), l1, l2), Release(mu, l1, l2)]
    eps, order = epsilon(history, delta)

    alpha = np.array(ORDERS, dtype=float)
    rdp = reference_rdp(mu, l1, l2, alpha) * 2 + reference_rdp(mu * 6 / 10, l1, l2, alpha)
    classical = rdp + math.log(1 / delta) / (alpha - 1)
    balle = rdp - (math.log(delta) + np.log(alpha)) / (alpha - 1) + np.log((alpha - 1) / alpha)
    assert 0.5 < eps < 20  # a regime where the best order is inside ORDERS
    assert eps == pytest.approx(balle.min(), rel=1e-12)
    assert order == alpha[np.argmin(balle)]
    assert eps < classical.min()


def test_no_release_costs_nothing() -> None:
    eps, order = epsilon([], 1e-5)
    assert eps == 0.0 and math.isnan(order)


def test_dropouts_cost_privacy() -> None:
    mu, planned, l1, l2 = 1000.0, 10, 12.0, 4.0
    per = per_client_variance(mu, planned)
    assert per * planned == pytest.approx(mu)
    assert charged_variance(per, 7) == pytest.approx(0.7 * mu)
    assert charged_variance(per, planned) == pytest.approx(mu)
    eps = [epsilon([Release(charged_variance(per, s), l1, l2)], 1e-5)[0] for s in range(planned, 0, -1)]
    assert np.all(np.diff(eps) > 0), eps  # each dropout strictly raises epsilon
    for t in (1, 3, 7):
        assert epsilon([Release(charged_variance(per, t), l1, l2)], 1e-5) == epsilon(
            [Release(mu * t / planned, l1, l2)], 1e-5
        )


def test_noise_moments() -> None:
    variance, n = 7.3, 200_000
    draws = skellam_noise(n, variance, np.random.default_rng(1))
    assert draws.dtype == np.int64 and draws.shape == (n,)
    mean_se = math.sqrt(variance / n)
    var_se = math.sqrt((variance + 2 * variance**2) / n)  # Skellam: 4th central moment mu + 3 mu^2
    assert abs(draws.mean()) < 5 * mean_se
    assert abs(draws.var() - variance) < 5 * var_se
    assert skellam_noise((2, 3), 0.0, np.random.default_rng(0)).tolist() == [[0, 0, 0], [0, 0, 0]]


def test_sum_of_shares_is_skellam_of_summed_variance() -> None:
    share, clients, n = 0.5, 10, 200_000
    rng = np.random.default_rng(7)
    total = sum(skellam_noise(n, share, rng) for _ in range(clients))
    mu = share * clients
    support = np.arange(-8, 9)  # expected count >= ~30 at the ends; the tails pooled into two bins
    dist = stats.skellam(mu / 2, mu / 2)
    expected = np.concatenate([[dist.cdf(support[0] - 1)], dist.pmf(support), [dist.sf(support[-1])]]) * n
    observed = np.concatenate(
        [[np.sum(total < support[0])], [np.sum(total == k) for k in support], [np.sum(total > support[-1])]]
    )
    assert observed.sum() == n and expected.sum() == pytest.approx(n)
    assert stats.chisquare(observed, expected).pvalue > 1e-4


def test_os_rng_is_seeded_from_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not np.array_equal(os_rng().integers(0, 2**62, 8), os_rng().integers(0, 2**62, 8))
    monkeypatch.setattr(skellam.secrets, "randbits", lambda bits: 12345)
    assert np.array_equal(os_rng().integers(0, 2**62, 8), os_rng().integers(0, 2**62, 8))


@pytest.mark.parametrize("target", [1.0, 4.0])
def test_noise_for_epsilon(target: float) -> None:
    delta, rounds, clip, scale, dim = 1e-5, 50, 1.0, 64.0, 1000
    mu = noise_for_epsilon(target, delta, rounds, clip, scale, dim)
    l1, l2 = sensitivity(clip, scale, dim)
    reached = epsilon([Release(mu, l1, l2)] * rounds, delta)[0]
    assert target * 0.97 <= reached <= target
    assert epsilon([Release(mu * 0.9, l1, l2)] * rounds, delta)[0] > target


def test_noise_for_epsilon_unreachable() -> None:
    with pytest.raises(ValueError, match="target_epsilon"):
        noise_for_epsilon(1e-4, 1e-5, 1, 1.0, 64.0, 10)
    with pytest.raises(ValueError, match="rounds"):
        noise_for_epsilon(1.0, 1e-5, 0, 1.0, 64.0, 10)


def test_noise_variance() -> None:
    assert noise_variance(1.5, 2.0, 10.0) == pytest.approx(900.0)


def test_sensitivity_worked_examples() -> None:
    l1, l2 = sensitivity(1.0, 100.0, 16)
    assert l2 == pytest.approx(100 + 4 / 2)
    assert l1 == pytest.approx(4 * 102) == pytest.approx(100 * 1.0 * 4 + 16 / 2)  # the two direct L1 bounds agree
    l1, l2 = sensitivity(0.01, 1.0, 10_000)  # scale * clip < sqrt(dim) / 2: integers make L1 <= L2^2 the smaller
    assert l2 == pytest.approx(0.01 + 50)
    assert l1 == pytest.approx(50.01**2)
    # tight: every coordinate at a half rounds up
    l1, l2 = sensitivity(1.0, 1.0, 4)
    v = np.floor(np.full(4, 0.5) + 0.5)
    assert np.linalg.norm(v) == pytest.approx(l2) and np.abs(v).sum() == pytest.approx(l1)


@pytest.mark.parametrize("clip,scale,dim", [(1.0, 100.0, 16), (0.01, 1.0, 10_000), (2.0, 3.0, 50), (1.0, 0.7, 3)])
def test_sensitivity_bounds_rounded_vectors(clip: float, scale: float, dim: int) -> None:
    l1, l2 = sensitivity(clip, scale, dim)
    rng = np.random.default_rng(3)
    for _ in range(200):
        x = rng.standard_normal(dim)
        x *= clip / np.linalg.norm(x)
        v = np.rint(scale * x)
        assert np.linalg.norm(v) <= l2 + 1e-9
        assert np.abs(v).sum() <= l1 + 1e-9


def test_bad_input_names_the_argument() -> None:
    for mu in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="mu"):
            skellam_rdp(mu, 1.0, 1.0)
    with pytest.raises(ValueError, match="mu"):
        Release(0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="l2"):
        Release(1.0, 1.0, -1.0)
    for delta in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="delta"):
            epsilon([Release(100.0, 1.0, 1.0)], delta)
        with pytest.raises(ValueError, match="delta"):
            noise_for_epsilon(1.0, delta, 1, 1.0, 1.0, 1)
    with pytest.raises(ValueError, match="clip"):
        sensitivity(-1.0, 1.0, 1)
    with pytest.raises(ValueError, match="clip"):
        noise_variance(1.0, -1.0, 1.0)
    with pytest.raises(ValueError, match="scale"):
        sensitivity(1.0, 0.0, 1)
    with pytest.raises(ValueError, match="dim"):
        sensitivity(1.0, 1.0, 0)
    with pytest.raises(ValueError, match="planned"):
        per_client_variance(100.0, 0)
    with pytest.raises(ValueError, match="survivors"):
        charged_variance(10.0, 0)
    with pytest.raises(ValueError, match="variance"):
        skellam_noise(3, -1.0, np.random.default_rng(0))
