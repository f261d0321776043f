"""Central DP: accounting against Opacus and Flower, the noise scale, clipping,
adaptive clipping, the budget stop, refused combinations, and runs end to end."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant
from opacus.accountants import RDPAccountant

from app.config.compose import load_config
from app.config.schema import PUBLIC_COLUMNS, ConfigError
from app.run.factory import StrategyParts, build_strategy, central_dp
from app.run.results import read_rows
from app.simulation.local_grid import InProcessGrid
from app.tools.in_process import run_in_process
from strategies import node_wait
from strategies.central_dp import (
    AdaptiveClip,
    CentralDP,
    DPFedAvg,
    DPFedBuff,
    NonFiniteRelease,
    centred_count,
    clip_update,
    cohort_sensitivity,
    combined_noise_multiplier,
    update_norm,
)
from strategies.replies import Screened, ValidReply
from strategies.settings import ReplyLimits, Sampling, TaskWiring

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


def test_charged_multiplier_equals_a_worked_example():
    """By hand: z = 0.8, σ_b = 2. The sum (Δ = C, std zC) has RDP α/(2z²); the centred
    count (Δ = ½, std σ_b) has α·(½)²/(2σ_b²) = α/(2(2σ_b)²). Together α/(2z̃²) with
    z̃⁻² = 1/0.64 + 1/4² = 1.5625 + 0.0625 = 1.625, z̃ = 1.625^(−1/2) = 0.784465.
    Sensitivity 2 (a fixed-size cohort) doubles both Δ: z̃ = 0.392232."""
    for sensitivity, expected in ((1.0, 0.7844645405527362), (2.0, 0.3922322702763681)):
        dp = _dp(noise_multiplier=0.8, sensitivity=sensitivity, adaptive=AdaptiveClip(count_noise_std=2.0))
        assert dp.charged_noise_multiplier(expected_cohort=10.0) == pytest.approx(expected, rel=1e-12)
        _release_n(dp, 1)
        assert dp.accountant.history == [(pytest.approx(expected, rel=1e-12), 1.0, 1)]
    assert combined_noise_multiplier(2.0, None, sensitivity=2.0) == 1.0  # fixed clipping: z / s


def test_adaptive_clipping_releases_the_centred_count():
    """Norms 0.5, 2, 3 against C = 1: one unclipped of three, m = 4, no count noise to speak
    of. Centred: b̃ = (1 − 3/2)/4 + ½ = 0.375, so with lr 1 and γ = ½ the clip becomes
    exp(0.125) = 1.133148 (the uncentred count 1/4 would give exp(0.25)). Adding or
    removing one update moves the centred count by exactly ½ (the sensitivity charged)."""
    updates = [{"w": torch.tensor([n, 0.0])} for n in (0.5, 2.0, 3.0)]
    dp = _dp(adaptive=AdaptiveClip(target_quantile=0.5, lr=1.0, count_noise_std=1e-12))
    dp.release(updates, {"w": torch.zeros(2)}, expected_cohort=4.0)
    assert dp.clip_norm == pytest.approx(1.1331484530668263, rel=1e-9)
    assert dp.last_noised_unclipped_fraction == pytest.approx(0.375, abs=1e-9)
    norms = [0.5, 2.0, 3.0, 0.9]
    assert centred_count(norms, 1.0) == 0.0
    for extra in (0.1, 5.0):
        assert abs(centred_count([*norms, extra], 1.0) - centred_count(norms, 1.0)) == 0.5


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


def test_a_non_finite_release_is_never_made_nor_charged():
    dp = _dp()
    with pytest.raises(NonFiniteRelease, match="NaN or Inf"):
        dp.release([{"w": torch.tensor([float("inf"), 0.0])}], {"w": torch.zeros(2)}, expected_cohort=4.0)
    with pytest.raises(ValueError, match="expected_cohort=0"):
        dp.release([], {"w": torch.zeros(2)}, expected_cohort=0.0)
    assert dp.releases == 0 and dp.accountant.history == [] and dp.epsilon() == 0.0


def test_dpfedavg_never_releases_from_or_into_a_non_finite_model():
    strategy = DPFedAvg(dp=_dp(), sampling=Sampling(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1))
    strategy._global = {"w": torch.tensor([float("inf"), 0.0])}  # a model gone bad some other way
    with pytest.raises(NonFiniteRelease, match="the global model"):
        strategy.aggregate_models(3, Screened())
    assert strategy.dp.releases == 0
    # Finite model, finite update 3e37 (within C = 1e38), mean 3e38 over m = 0.1: the sum
    # overflows float32 (max 3.4e38). Noise std 1e-29 · 1e38 / 0.1 = 1e10 changes nothing.
    strategy.dp = _dp(clip_norm=1e38, noise_multiplier=1e-29)
    strategy._global, strategy._expected_cohort = {"w": torch.tensor([3e38])}, 0.1
    reply = ValidReply(node_id=1, weight=1.0, metrics=MetricRecord(), arrays={"w": torch.tensor([3.3e38])})
    with pytest.raises(NonFiniteRelease, match="round 3's model"):
        strategy.aggregate_models(3, Screened(valid=[reply]))


# --- sampling and cohorts ---------------------------------------------------------------------
def _poisson(q: float = 0.5) -> DPFedAvg:
    return DPFedAvg(
        dp=_dp(sample_rate=q),
        poisson=True,
        sampling=Sampling(fraction_train=q, min_train_nodes=1, min_available_nodes=2),
    )


def _arrays() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})


def test_poisson_cohorts_come_from_the_os_csprng_not_the_run_seed():
    """Two strategies after the same random.seed: 20 cohorts of 20 nodes at q = ½ agree by
    chance with probability 2⁻⁴⁰⁰. Python's seeded `random` is not even consulted."""
    grid = InProcessGrid(lambda msg, ctx: msg, num_nodes=20)
    cohorts = []
    for _ in range(2):
        random.seed(1234)
        state = random.getstate()
        strategy = _poisson()
        cohorts.append([tuple(strategy.select_nodes(grid, 0.5, 1, "train")) for _ in range(20)])
        assert random.getstate() == state
    assert cohorts[0] != cohorts[1]


def test_poisson_waits_for_nodes_and_divides_by_the_population_not_who_is_online(monkeypatch):
    """No node connected at first: the cohort waits (strategies/node_wait.py) instead of
    releasing noise divided by 0 · q. N is fixed then (8), so with 6 nodes gone (2 left,
    min_available_nodes) the expected cohort stays q·N = 4 and the release stays finite."""
    waits = []
    monkeypatch.setattr(node_wait.time, "sleep", waits.append)

    class LateGrid(InProcessGrid):
        calls = 0

        def get_node_ids(self):
            self.calls += 1
            return [] if self.calls <= 2 else super().get_node_ids()

    grid = LateGrid(lambda msg, ctx: msg, num_nodes=8)
    strategy = _poisson()
    strategy.configure_train(1, _arrays(), ConfigRecord(), grid)
    assert len(waits) == 2 and strategy.population == 8 and strategy._expected_cohort == 4.0
    for node in list(grid.contexts)[2:]:
        grid.kill(node)
    strategy.configure_train(2, _arrays(), ConfigRecord(), grid)
    assert strategy._expected_cohort == 4.0
    new = strategy.aggregate_models(2, Screened())
    assert torch.isfinite(new["w"]).all()
    assert strategy.state_dict()["population"] == 8  # a resumed run keeps N


def test_sensitivity_is_two_clips_for_fixed_size_cohorts_from_a_larger_population():
    assert cohort_sensitivity(fedbuff=False, poisson=False, fraction_train=1.0) == 1.0  # everyone
    assert cohort_sensitivity(fedbuff=False, poisson=True, fraction_train=0.3) == 1.0  # Poisson
    assert cohort_sensitivity(fedbuff=False, poisson=False, fraction_train=0.5) == 2.0
    assert cohort_sensitivity(fedbuff=True, poisson=False, fraction_train=1.0) == 2.0
    with pytest.raises(ValueError, match="sensitivity 2.0C"):
        DPFedAvg(dp=_dp(), sampling=Sampling(fraction_train=0.5))


# --- DP FedBuff: one update per node per release ----------------------------------------------
def _echo(msg: Message, ctx) -> Message:
    """A client whose update is +1 everywhere (norm > C: clipped)."""
    arrays = ArrayRecord({k: Array(v.numpy() + 1.0) for k, v in msg.content["arrays"].items()})
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)


class OneFastNodeGrid(InProcessGrid):
    """Node 1000 answers at once; the others only on every 4th poll (counted, not timed),
    so the fast node alone could fill a buffer."""

    polls = 0

    def pull_messages(self, message_ids):
        self.polls += 1
        ids = list(message_ids)
        if self.polls % 4:
            ids = [m for m in ids if m in self._pending and self._pending[m][0].metadata.dst_node_id == 1000]
        return super().pull_messages(ids)


def test_dp_fedbuff_takes_at_most_one_update_per_node_per_release():
    cfg, _ = load_config("strategy=fedbuff strategy.buffer_size=3 strategy.staleness_fn=constant privacy=central")
    strategy = build_strategy(cfg, StrategyParts(torch.device("cpu"), central_dp(cfg), ReplyLimits(), TaskWiring()))
    assert isinstance(strategy, DPFedBuff)
    strategy.poll_interval_s = 0.0
    grid = OneFastNodeGrid(_echo, num_nodes=4)
    releases: list[list[int]] = []

    def on_version(report, arrays) -> bool:
        releases.append([u["node_id"] for u in report.applied])
        return len(releases) == 4

    strategy.run(grid, _arrays(), ConfigRecord(), on_version)
    assert len(releases) == 4
    for nodes in releases:
        assert len(nodes) == 3 and max(Counter(nodes).values()) == 1, releases
    assert grid.max_in_flight == 1
    reference = RDPAccountant()  # a FedBuff buffer is a fixed-size subset: sensitivity 2C, z/2 charged
    reference.history = [(0.5, 1.0, 4)]
    assert strategy.dp.epsilon() == pytest.approx(reference.get_epsilon(delta=DELTA), rel=0.01)


def test_dp_fedbuff_buffer_larger_than_the_nodes_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"strategy.buffer_size=10: a central-DP buffer .* only 3 nodes"):
        _run(tmp_path, "strategy=fedbuff strategy.buffer_size=10 privacy=central federation.rounds=1", nodes=3)


# --- runs ------------------------------------------------------------------------------------
def _run(tmp_path, overrides: str, nodes: int = 5) -> dict:
    """The summary of a run with this module's defaults: one local epoch, seed 3, 5 nodes."""
    return run_in_process(overrides + " train.epochs=1 seed=3", tmp_path, nodes=nodes)[0]


def test_the_run_stops_before_the_budget_and_keeps_the_last_released_model(tmp_path):
    summary = _run(tmp_path, "privacy=central privacy.max_epsilon=8 federation.rounds=10 name=b")
    rows = read_rows(summary["run_dir"])
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
        "privacy=central privacy.poisson_sampling=true federation.fraction_train=0.5 federation.rounds=6 "
        "privacy.report_exact=true",
        nodes=8,
    )
    rows = read_rows(summary["run_dir"])
    sizes = [r["num_sampled"] for r in rows]
    assert len(set(sizes)) > 1  # the cohort size varies from round to round
    reference = RDPAccountant()
    reference.history = [(1.0, 0.5, 6)]
    assert summary["privacy"]["epsilon"] == pytest.approx(reference.get_epsilon(delta=DELTA), rel=0.01)
    assert summary["privacy"]["sample_rate"] == 0.5


def test_fedbuff_flushes_are_releases_with_q_one(tmp_path):
    summary = _run(tmp_path, "strategy=fedbuff strategy.buffer_size=3 privacy=central_adaptive federation.rounds=4")
    rows = read_rows(summary["run_dir"])
    assert [r["releases"] for r in rows] == [1, 2, 3, 4]
    assert all(b["epsilon"] > a["epsilon"] for a, b in zip(rows, rows[1:], strict=False))
    assert rows[0]["clip_norm"] != rows[-1]["clip_norm"]  # adaptive clipping moved it
    assert all(isinstance(r["noised_unclipped_fraction"], float) for r in rows)  # released, so reported
    assert summary["privacy"]["mechanism"] == "gaussian, adaptive clipping"


def test_a_fixed_size_cohort_smaller_than_the_population_is_charged_twice_the_clip(tmp_path):
    """3 of 6 nodes per round, no Poisson sampling: one more client can push another out of
    the cohort, so the sum moves by up to 2C; z = 1 is charged as z = ½, q = 1."""
    summary = _run(tmp_path, "privacy=central federation.fraction_train=0.5 federation.rounds=2", nodes=6)
    reference = RDPAccountant()
    reference.history = [(0.5, 1.0, 2)]
    assert summary["privacy"]["epsilon"] == pytest.approx(reference.get_epsilon(delta=DELTA), rel=0.01)
    assert summary["privacy"]["sensitivity"] == 2.0


@pytest.mark.parametrize("exact", [False, True])
def test_exact_values_outside_epsilon_are_recorded_only_when_asked(tmp_path, exact):
    summary = _run(tmp_path, f"privacy=central federation.rounds=2 privacy.report_exact={str(exact).lower()}", nodes=4)
    for row in read_rows(summary["run_dir"]):
        assert "epsilon" in row and "accuracy" in row
        recorded = {"clipped_fraction", "num_sampled", "num_clients", "node_partitions", "train", "rejected"}
        recorded &= set(row)
        if exact:
            assert len(recorded) == 6 and row["train"]["num-examples"] > 0 and len(row["node_partitions"]) == 4
        else:
            assert not recorded and set(row) <= PUBLIC_COLUMNS | {"accuracy"}


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
        ("privacy=central privacy.report_exact=maybe", "privacy.report_exact"),
        ("privacy=central strategy=fedbuff strategy.buffer_size=4 strategy.concurrency=3", "strategy.buffer_size=4"),
        ("privacy=laplace", "privacy"),
        ("privacy=local strategy=fedbuff privacy.target_epsilon=5", "privacy.target_epsilon"),
    ],
)
def test_refused_combinations_and_bad_values_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)
