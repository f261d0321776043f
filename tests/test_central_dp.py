"""Central DP: accounting against Opacus and Flower, the noise scale, clipping,
adaptive clipping, the budget stop, refused combinations, and runs end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant
from opacus.accountants import RDPAccountant

from app.client_app import app as client_app
from app.config import ConfigError, load_config
from app.federated_run import run_federation
from app.local_grid import InProcessGrid
from strategies.central_dp import AdaptiveClip, CentralDP, clip_update, combined_noise_multiplier, update_norm

DELTA = 1e-5


def _dp(**kwargs) -> CentralDP:
    defaults = {
        "noise_multiplier": 1.0,
        "clip_norm": 1.0,
        "delta": DELTA,
        "generator": torch.Generator().manual_seed(0),
    }
    return CentralDP(**{**defaults, **kwargs})


def _zeros() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(200, 50), "b": torch.zeros(50), "n": torch.zeros((), dtype=torch.int64)}


def _release_n(dp: CentralDP, n: int, cohort: float = 10.0) -> None:
    for _ in range(n):
        dp.release([_zeros()], _zeros(), cohort)


# --- accounting ----------------------------------------------------------------------
@pytest.mark.parametrize("z, q, releases", [(1.0, 1.0, 1), (1.0, 1.0, 10), (0.7, 0.1, 30), (2.0, 0.25, 50)])
def test_epsilon_equals_an_independent_opacus_computation(z, q, releases):
    dp = _dp(noise_multiplier=z, sample_rate=q)
    _release_n(dp, releases)
    reference = RDPAccountant()
    reference.history = [(z, q, releases)]  # one entry for all steps: computed independently of ours
    assert dp.epsilon() == pytest.approx(reference.get_epsilon(delta=DELTA), rel=0.01)
    assert dp.releases == releases


@pytest.mark.parametrize("z, releases", [(1.0, 1), (1.0, 10), (2.0, 50)])
def test_epsilon_without_sampling_equals_flowers_rdp_accountant(z, releases):
    """q = 1 is the case Flower's fixed-clipping wrapper accounts (no amplification)."""
    dp = _dp(noise_multiplier=z)
    _release_n(dp, releases)
    config = PrivacyConfig(DELTA, 10, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION)
    flower = RdpAccountant(config)
    flower.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=10, population_size=10), count=releases)
    assert dp.epsilon() == pytest.approx(flower.get_epsilon(DELTA), rel=0.01)


def test_adaptive_clipping_charges_the_count_noise_too():
    assert combined_noise_multiplier(1.0, 0.5) == pytest.approx((1 + 1) ** -0.5)
    fixed, adaptive = _dp(), _dp(adaptive=AdaptiveClip(count_noise_std=0.5))
    _release_n(fixed, 5)
    _release_n(adaptive, 5)
    assert adaptive.epsilon() > fixed.epsilon()
    reference = RDPAccountant()
    reference.history = [(2**-0.5, 1.0, 5)]
    assert adaptive.epsilon() == pytest.approx(reference.get_epsilon(delta=DELTA), rel=0.01)


# --- the mechanism -------------------------------------------------------------------------
def test_noise_has_the_stated_scale():
    """All-zero updates: the release is pure noise with std z·C/m per coordinate."""
    dp = _dp(noise_multiplier=1.3, clip_norm=0.8)
    out = dp.release([_zeros() for _ in range(4)], _zeros(), expected_cohort=8.0)
    values = torch.cat([out["w"].flatten(), out["b"].flatten()])
    assert float(values.std()) == pytest.approx(1.3 * 0.8 / 8.0, rel=0.03)
    assert abs(float(values.mean())) < 0.01
    assert int(out["n"]) == 0  # integer buffers are not released


def test_clipping_bounds_every_update_and_the_release_is_the_clipped_mean(rng):
    updates = [{"w": torch.from_numpy(rng.normal(scale=s, size=(30, 7)).astype(np.float32))} for s in (0.01, 1.0, 50.0)]
    for u in updates:
        clipped, norm = clip_update(u, 1.0)
        assert update_norm(clipped) <= 1.0 + 1e-5
        assert norm == pytest.approx(update_norm(u))
        if norm <= 1.0:
            torch.testing.assert_close(clipped["w"], u["w"])
    dp = _dp(noise_multiplier=1e-9, clip_norm=1.0)
    out = dp.release(updates, {"w": torch.zeros(30, 7)}, expected_cohort=5.0)
    expected = sum(clip_update(u, 1.0)[0]["w"] for u in updates) / 5.0
    torch.testing.assert_close(out["w"], expected, atol=1e-6, rtol=1e-5)
    assert dp.last_clipped_fraction == pytest.approx(2 / 3)


@pytest.mark.parametrize("start", [0.05, 50.0])
def test_adaptive_clipping_moves_toward_the_target_quantile(start):
    norms = np.linspace(1.0, 10.0, 20)  # median 5.5
    updates = [{"w": torch.full((4,), float(n) / 2)} for n in norms]  # ||(n/2,)*4|| = n
    dp = _dp(clip_norm=start, adaptive=AdaptiveClip(target_quantile=0.5, lr=0.5, count_noise_std=0.01))
    clips = [start]
    for _ in range(60):
        dp.release(updates, {"w": torch.zeros(4)}, expected_cohort=20.0)
        clips.append(dp.clip_norm)
    assert 3.5 < clips[-1] < 7.5  # near the median norm
    assert abs(np.log(clips[-1] / 5.5)) < abs(np.log(start / 5.5))


def test_a_release_past_the_budget_is_refused():
    from strategies.central_dp import PrivacyBudgetExhausted

    dp = _dp(max_epsilon=8.0)
    _release_n(dp, 2)  # epsilon 7.08 after two releases with z = 1, q = 1
    with pytest.raises(PrivacyBudgetExhausted, match="max_epsilon=8"):
        dp.release([_zeros()], _zeros(), 10.0)
    assert dp.releases == 2 and dp.epsilon() <= 8.0


# --- runs ------------------------------------------------------------------------------------
def _run(tmp_path, overrides: str, nodes: int = 5):
    cfg, raw = load_config(overrides + " train.epochs=1 seed=3")
    return run_federation(InProcessGrid(client_app, nodes), cfg, raw, tmp_path)


def _rows(summary: dict) -> list[dict]:
    with open(f"{summary['run_dir']}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_the_run_stops_before_the_budget_and_keeps_the_last_released_model(tmp_path):
    summary = _run(tmp_path, "privacy=central privacy.max_epsilon=8 federation.rounds=10 name=b")
    rows = _rows(summary)
    assert [r["round"] for r in rows] == [1, 2] and "max_epsilon=8" in summary["stop_reason"]
    assert summary["status"] == "completed"
    privacy = summary["privacy"]
    assert privacy["epsilon"] == pytest.approx(rows[-1]["epsilon"]) and privacy["epsilon"] <= 8.0
    assert privacy["releases"] == 2 and privacy["delta"] == DELTA and privacy["sampling"] == "none (q = 1)"
    final = torch.load(tmp_path / "b" / "model_final.pt", weights_only=True)
    checkpoint = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    for key in final:  # the model saved is the one released in round 2
        torch.testing.assert_close(final[key], checkpoint["state_dict"][key])


def test_poisson_sampling_draws_cohorts_and_is_accounted_with_its_rate(tmp_path):
    summary = _run(
        tmp_path,
        "privacy=central privacy.poisson_sampling=true federation.fraction_train=0.5 federation.rounds=6",
        nodes=8,
    )
    rows = _rows(summary)
    sizes = [r["num_sampled"] for r in rows]
    assert len(set(sizes)) > 1  # the cohort size varies from round to round
    reference = RDPAccountant()
    reference.history = [(1.0, 0.5, 6)]
    assert summary["privacy"]["epsilon"] == pytest.approx(reference.get_epsilon(delta=DELTA), rel=0.01)
    assert summary["privacy"]["sample_rate"] == 0.5


def test_fedbuff_flushes_are_releases_with_q_one(tmp_path):
    summary = _run(tmp_path, "strategy=fedbuff strategy.buffer_size=3 privacy=central_adaptive federation.rounds=4")
    rows = _rows(summary)
    assert [r["releases"] for r in rows] == [1, 2, 3, 4]
    assert all(b["epsilon"] > a["epsilon"] for a, b in zip(rows, rows[1:], strict=False))
    assert rows[0]["clip_norm"] != rows[-1]["clip_norm"]  # adaptive clipping moved it
    assert summary["privacy"]["mechanism"] == "gaussian, adaptive clipping"


def test_resume_continues_the_accountant_without_double_counting(tmp_path):
    whole = _run(tmp_path / "a", "privacy=central privacy.noise_multiplier=3 federation.rounds=4")
    _run(tmp_path / "b", "privacy=central privacy.noise_multiplier=3 federation.rounds=2 name=p")
    resumed = _run(
        tmp_path / "b",
        f"privacy=central privacy.noise_multiplier=3 federation.rounds=4 name=p resume={tmp_path / 'b' / 'p' / 'checkpoint.pt'}",
    )
    assert resumed["privacy"]["releases"] == 4
    assert resumed["privacy"]["epsilon"] == pytest.approx(whole["privacy"]["epsilon"], rel=1e-9)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ("privacy=central strategy=krum strategy.num_byzantine=1", "no standard sensitivity bound for krum"),
        ("privacy=central strategy=median", "no standard sensitivity bound for median"),
        ("privacy=central strategy=fedbuff strategy.buffer_aggregator=trimmed_mean", "trimmed_mean"),
        ("privacy=central privacy.noise_multiplier=-1", "privacy.noise_multiplier"),
        ("privacy=central privacy.clip_norm=0", "privacy.clip_norm"),
        ("privacy=central privacy.delta=1.0", "privacy.delta"),
        ("privacy=central privacy.delta=0", "privacy.delta"),
        ("privacy=central privacy.max_epsilon=-1", "privacy.max_epsilon"),
        ("privacy=central_adaptive privacy.target_quantile=1.5", "privacy.target_quantile"),
        ("privacy=central strategy=fedbuff privacy.poisson_sampling=true", "privacy.poisson_sampling"),
        ("privacy=laplace", "privacy"),
        ("privacy=local strategy=fedbuff privacy.target_epsilon=5", "privacy.target_epsilon"),
    ],
)
def test_refused_combinations_and_bad_values_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)
