"""What the server checks in a secure round's unmasked sums, how it finds the node behind a refused
sum (group testing, app/secagg/groups.py), the smallest secure cohort, and distributed DP's adaptive
clip against one node's count: issue 48, findings 1, 4 (a node that lies inside the ring), 5, 17.

The nodes are tests/test_secagg.py's (the real node stages on fixed trained models); a lying node
changes its plain ring vector before masking it, as a modified ClientApp could."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

from app.config.compose import load_config
from app.config.schema import ConfigError
from app.secagg import node as secagg_node
from app.secagg.dp import DistributedDP
from app.secagg.groups import GroupSearch
from app.secagg.ring import ACCURACY, PLAIN_EXTRAS, UNCLIPPED, WEIGHT, Layout, Ring
from app.secagg.server import Outcome, SecureRound
from app.secagg.strategy import SecAggSettings, SecureFedAvg
from app.simulation.local_grid import InProcessGrid
from strategies.settings import Sampling
from strategies.tensor_ops import record_to_tensors
from tests.test_secagg import RING, Nodes, _fedavg, _models

BAD = 1000  # the lying node
Edit = Callable[[np.ndarray, Layout], None]  # changes a node's ring vector (int64, ring units) in place


def lie(monkeypatch: pytest.MonkeyPatch, edit: Edit, extras: tuple[str, ...], base: dict, ring: Ring = RING) -> None:
    """Node BAD's plain ring vector goes through `edit` before it is masked (masks are additive: the
    server's sum carries the edit)."""
    original = secagg_node.mask
    layout = Layout.of(base, extras)

    def mask(state, vector, modulus, context):  # noqa: ANN001, ANN202
        if state.node == BAD:
            ints = vector.astype(np.int64)
            ints[ints >= modulus // 2] -= modulus
            edit(ints, layout)
            vector = ring.reduce(ints)
        return original(state, vector, modulus, context)

    monkeypatch.setattr(secagg_node, "mask", mask)


def extra_at(layout: Layout, name: str) -> int:
    return layout.size - len(layout.extras) + layout.extras.index(name)


def _neg_weight(n: int) -> Edit:
    def edit(ints: np.ndarray, layout: Layout) -> None:  # the weights sum to -0.1
        ints[extra_at(layout, WEIGHT)] = round((-0.1 * (n - 1) - 0.1) / RING.step)

    return edit


def _tiny_divisor(n: int) -> Edit:
    def edit(ints: np.ndarray, layout: Layout) -> None:  # the weights sum to 4 ring steps: a x15M step
        ints[extra_at(layout, WEIGHT)] = round(-0.1 * (n - 1) / RING.step) + 4

    return edit


def _beyond_clip(n: int) -> Edit:
    def edit(ints: np.ndarray, layout: Layout) -> None:  # one coordinate far beyond n inputs of +-c
        ints[0] = RING.quantization_range * n

    return edit


def _accuracy(n: int) -> Edit:
    def edit(ints: np.ndarray, layout: Layout) -> None:  # a weighted accuracy of 50: above the weights' sum
        ints[extra_at(layout, ACCURACY)] = round(50 / RING.step)

    return edit


def _strategy(n: int, ring: Ring = RING, **settings: object) -> SecureFedAvg:
    return SecureFedAvg(
        secagg=SecAggSettings(ring, max_weight=1000.0, **settings),  # type: ignore[arg-type]
        sampling=Sampling(min_train_nodes=n, min_available_nodes=n),
    )


def _rounds(
    strategy: SecureFedAvg, grid: InProcessGrid, base: dict, rounds: int
) -> list[tuple[dict[str, torch.Tensor] | None, Outcome, list[int]]]:
    """`rounds` rounds: each one's new model (None: kept), its outcome and the nodes it sampled."""
    arrays = ArrayRecord({k: Array(v.numpy()) for k, v in base.items()})
    out = []
    for rnd in range(1, rounds + 1):
        messages = list(strategy.configure_train(rnd, arrays, ConfigRecord({}), grid))
        new, _, outcome = strategy.secure_train(rnd, messages, lambda stage: list(grid.send_and_receive(stage)))
        out.append(
            (record_to_tensors(new) if new is not None else None, outcome, [m.metadata.dst_node_id for m in messages])
        )
        arrays = new or arrays
    return out


def _close_to_fedavg(got: dict[str, torch.Tensor], models: list[dict], nodes: list[int], weight: float = 0.1) -> None:
    """`got` is FedAvg over `nodes` (equal weights) to within each node's rounding of one ring step."""
    want = _fedavg([models[v - 1000] for v in nodes], [1] * len(nodes))
    bound = len(nodes) * RING.step / (weight * len(nodes))
    for k in want:
        assert torch.allclose(got[k].double(), want[k], atol=bound, rtol=0), k


@pytest.mark.parametrize("how", [_neg_weight, _tiny_divisor, _beyond_clip, _accuracy])
def test_one_node_that_lies_inside_the_ring_is_refused_isolated_and_excluded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, how: Callable[[int], Edit]
) -> None:
    """One node of 10 lies in its ring vector every round (a negative weight, a weight leaving a
    tiny divisor, an update coordinate beyond the clipping range, an accuracy above its weight):
    round 1's sums fail the checks and the round is refused (model kept, reason given); the next
    rounds run group testing, each group its own SecAgg+ round of at least 3, the passing groups'
    FedAvg applied; the liar is isolated, named and excluded; at least 4 of 5 rounds apply, and
    once it is out the round is FedAvg over the 9 honest nodes."""
    n = 10
    base, models = _models(n, seed=7)
    lie(monkeypatch, how(n), PLAIN_EXTRAS, base)
    strategy = _strategy(n)
    grid = InProcessGrid(Nodes(models, [100] * n), n)
    with caplog.at_level(logging.INFO, logger="flwr.fedgpu"):
        rounds = _rounds(strategy, grid, base, 5)
    first, outcome, _ = rounds[0]
    assert first is None
    assert outcome.aborted is not None and "refused" in outcome.aborted, outcome.aborted
    applied = [(new, outcome, sampled) for new, outcome, sampled in rounds if new is not None]
    assert len(applied) >= 4, [o.aborted for _, o, _ in rounds]
    for new, outcome, sampled in applied:
        assert BAD not in outcome.survivors and len(outcome.survivors) >= 3
        _close_to_fedavg(new, models, outcome.survivors)
        assert set(outcome.survivors) | set(outcome.dropped) == set(sampled)  # each node applied or named
    assert set(strategy.excluded) == {BAD}, strategy.excluded
    last_new, last, sampled = rounds[-1]
    assert BAD not in sampled and sorted(last.survivors) == list(range(1001, 1000 + n))
    _close_to_fedavg(last_new, models, last.survivors)
    excluded = [
        r.getMessage() for r in caplog.records if "excluded" in r.getMessage() and "node 1000" in r.getMessage()
    ]
    assert excluded, [r.getMessage() for r in caplog.records]


def test_the_audits_cohort_of_six_also_isolates_the_liar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit's cohort of 6 (secagg_one_node_stalls.py): two groups of 3 are the smallest split."""
    n = 6
    base, models = _models(n, seed=7)
    lie(monkeypatch, _tiny_divisor(n), PLAIN_EXTRAS, base)
    strategy = _strategy(n)
    rounds = _rounds(strategy, InProcessGrid(Nodes(models, [100] * n), n), base, 5)
    assert sum(new is not None for new, _, _ in rounds) >= 4
    assert set(strategy.excluded) == {BAD}


def test_a_round_too_small_to_split_is_refused_every_time_and_never_applies_the_lie(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """5 nodes cannot form two groups of 3: each round with the liar is refused whole, nobody is
    excluded on a guess, and no lie reaches the model."""
    n = 5
    base, models = _models(n, seed=7)
    lie(monkeypatch, _neg_weight(n), PLAIN_EXTRAS, base)
    strategy = _strategy(n)
    rounds = _rounds(strategy, InProcessGrid(Nodes(models, [100] * n), n), base, 2)
    assert all(new is None for new, _, _ in rounds) and strategy.excluded == {}


def test_honest_rounds_pass_the_checks_at_the_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Honest inputs at the edges of the box (every weight 1/max_weight, updates of +-c, accuracy
    1) pass: the bounds leave room for each node's rounding, nothing more."""
    n = 4
    g = torch.Generator().manual_seed(3)
    base = {"w": torch.zeros(40), "b": torch.zeros(3)}
    signs = [torch.randint(0, 2, (40,), generator=g).float() * 2 - 1 for _ in range(n)]
    models = [{"w": RING.clipping_range * s, "b": torch.zeros(3)} for s in signs]
    nodes = Nodes(models, [1] * n)  # weight 1/1000 each: the smallest an honest node sends
    strategy = _strategy(n)
    ((new, outcome, _),) = _rounds(strategy, InProcessGrid(nodes, n), base, 1)
    assert new is not None and outcome.aborted is None


def test_a_step_that_would_make_the_model_non_finite_is_refused() -> None:
    """The same finite-step check as every other strategy: a float16 model one honest step from
    overflowing keeps its values."""
    n = 3
    ring = Ring(32.0, 2**20, 2**32)
    base = {"w": torch.full((4,), 65504.0, dtype=torch.float16)}  # float16's largest value
    models = [{"w": torch.full((4,), 65524.0, dtype=torch.float64)} for _ in range(n)]  # +20: honest, within c
    strategy = _strategy(n, ring)
    ((new, outcome, _),) = _rounds(strategy, InProcessGrid(Nodes(models, [100] * n), n), base, 1)
    assert new is None, new
    assert outcome.aborted is not None and "non-finite" in outcome.aborted


def test_exclusions_and_suspects_survive_a_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The run-wide exclusions and the search's suspects are in the strategy's state (written with
    torch.save, read back with weights_only=True): a resumed run does not sample the excluded node."""
    n = 10
    base, models = _models(n, seed=7)
    lie(monkeypatch, _neg_weight(n), PLAIN_EXTRAS, base)
    strategy = _strategy(n)
    grid = InProcessGrid(Nodes(models, [100] * n), n)
    _rounds(strategy, grid, base, 5)
    path = tmp_path / "state.pt"
    torch.save(strategy.state_dict(), path)
    resumed = _strategy(n)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert resumed.excluded == strategy.excluded and BAD in resumed.excluded
    arrays = ArrayRecord({k: Array(v.numpy()) for k, v in base.items()})
    sampled = {m.metadata.dst_node_id for m in resumed.configure_train(6, arrays, ConfigRecord({}), grid)}
    assert BAD not in sampled and len(sampled) == n - 1


def test_a_node_the_protocol_proves_deviated_is_excluded_for_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes the SecAgg+ round names as culprits (`Outcome.culprits`: proven at the protocol level)
    join the same exclusion set: not sampled again."""
    n = 6
    base, models = _models(n, seed=2)
    run = SecureRound.run

    def blaming(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        outcome = run(self, *args, **kwargs)
        outcome.culprits = {1003: "its share for node 1001 does not decrypt"}
        return outcome

    monkeypatch.setattr(SecureRound, "run", blaming)
    strategy = _strategy(n)
    rounds = _rounds(strategy, InProcessGrid(Nodes(models, [100] * n), n), base, 2)
    assert "does not decrypt" in strategy.excluded[1003]
    assert 1003 not in rounds[1][2]


@pytest.mark.parametrize("bad", range(10))
def test_group_testing_isolates_one_node_of_ten_by_round_four(bad: int) -> None:
    """The planner alone: every group has at least `least` members and the groups cover the cohort;
    suspects are split into as many parts as the cleared nodes can pad; a failure narrows the
    suspects to the failing group's (one deviating node is in every failing group); a node is
    excluded only once it is the one suspect left, and that is the liar by round 4."""
    search = GroupSearch(least=3)
    cohort = list(range(10))
    assert search.groups(cohort) == [cohort]
    assert search.record(1, [(cohort, "weights")]) == []
    assert sorted(map(len, search.groups(cohort))) == [3, 3, 4]
    for rnd in range(2, 5):
        groups = search.groups(cohort)
        assert all(len(g) >= 3 for g in groups) and sorted(sum(groups, [])) == cohort
        (failing,) = [g for g in groups if bad in g]
        if newly := search.record(rnd, [(failing, "weights")]):
            assert [node for node, _ in newly] == [bad]
            break
    assert list(search.excluded) == [bad] and not search.suspects
    assert search.groups([0, 1, 2]) == [[0, 1, 2]]


def test_group_testing_restarts_when_two_groups_fail_and_never_splits_below_three() -> None:
    search = GroupSearch(least=3)
    cohort = list(range(10))
    search.record(1, [(cohort, "w")])
    assert search.record(2, [(cohort[:5], "w"), (cohort[5:], "w")]) == [] and search.suspects == set(cohort)
    small = GroupSearch(least=3, suspects={0, 1, 2, 3, 4})
    assert small.groups([0, 1, 2, 3, 4]) == [[0, 1, 2, 3, 4]]  # 5 suspects, nobody cleared: no split
    assert all(len(g) >= 4 for g in GroupSearch(least=4, suspects={0, 1}).groups(list(range(8))))


# --- finding 17: a secure round of fewer than 3 contributors protects nothing ---------------------------------


@pytest.mark.parametrize(
    ("nodes", "settings", "words"),
    [
        (2, {}, "num-supernodes"),
        (5, {"threshold": 2}, "secagg.threshold"),
        (10, {"degree": 1}, "secagg.degree"),
    ],
)
def test_a_secure_round_of_fewer_than_three_contributors_is_refused(nodes: int, settings: dict, words: str) -> None:
    problem = _strategy(nodes, **settings).node_count_problem(nodes)
    assert problem is not None and words in problem and "3" in problem, problem
    assert _strategy(3).node_count_problem(3) is None
    sampled_two = SecureFedAvg(
        secagg=SecAggSettings(RING, max_weight=10.0), sampling=Sampling(fraction_train=0.1, min_train_nodes=2)
    ).node_count_problem(10)
    assert sampled_two is not None and "2 of the 10" in sampled_two and "min_train_nodes=3" in sampled_two


def test_a_threshold_of_two_is_refused_with_the_config() -> None:
    with pytest.raises(ConfigError, match=r"secagg.threshold.*use >= 3"):
        load_config("secagg=plus secagg.threshold=2")


def test_secagg_with_two_simulated_nodes_stops_before_any_training(tmp_path: Path) -> None:
    """The README's `secagg=plus` on Flower's default of 2 simulated nodes: refused before round 1,
    naming the numbers and the fix; no message is sent."""
    from app.tools.in_process import run_in_process

    grid = InProcessGrid(Nodes([], []), 2)
    with pytest.raises(ConfigError, match=r"num-supernodes") as err:
        run_in_process("secagg=plus federation.rounds=1 name=two", tmp_path, grid=grid)
    assert "2" in str(err.value)
    assert not grid.pushed


# --- finding 1: distributed DP's adaptive clip against one node's count --------------------------------------


def _dp(**kw: object) -> DistributedDP:
    args: dict = {"noise_multiplier": 1.0, "clip_norm": 0.5, "delta": 1e-5, "ring": Ring(1.0, 2**16, 2**40), "dim": 50}
    return DistributedDP(**(args | {"adaptive": True} | kw))


@pytest.mark.parametrize("count", [1e6, -1e6, 6e12, -6e12])
def test_a_count_beyond_what_the_survivors_can_send_is_clamped_and_the_clip_stays_bounded(count: float) -> None:
    """The decoded 'unclipped' count is clamped to [0, survivors] widened by the count noise's
    margin; the clip stays within [its floor, secagg.clipping_range] and the next round plans."""
    dp = _dp()
    for _ in range(3):
        dp.account(6, 6, count)
        assert dp.clip_floor <= dp.clip_norm <= dp.ring.clipping_range
        assert -1 < dp.last_noised_unclipped_fraction < 2
        dp.plan(6)  # positive, finite: the next round's noise
    assert dp.clip_floor > 0


def test_the_adaptive_clip_never_leaves_its_bounds_however_long_honest_counts_push() -> None:
    dp = _dp()
    for _ in range(300):
        dp.account(6, 6, 6.0)  # no update clipped: the clip shrinks each round
    assert dp.clip_norm == pytest.approx(dp.clip_floor)
    for _ in range(300):
        dp.account(6, 6, 0.0)  # every update clipped: it grows
    assert dp.clip_norm == pytest.approx(dp.ring.clipping_range)


def test_the_ring_must_hold_the_noise_at_the_adaptive_clips_ceiling() -> None:
    """The adaptive clip may grow to secagg.clipping_range, and the noise with it: the ring must
    carry that noise from the start (checked before round 1)."""
    ring = Ring(8.0, 2**22, 2**32)
    fixed = DistributedDP(noise_multiplier=200.0, clip_norm=0.1, delta=1e-5, ring=ring, dim=10)
    adaptive = DistributedDP(noise_multiplier=200.0, clip_norm=0.1, delta=1e-5, ring=ring, dim=10, adaptive=True)
    assert fixed.room_problem(10) is None
    assert adaptive.room_problem(10) is not None and "modulus_range" in adaptive.room_problem(10)


@pytest.mark.parametrize("sign", [+1, -1])
def test_one_node_writing_its_unclipped_count_cannot_stop_an_adaptive_round(
    monkeypatch: pytest.MonkeyPatch, sign: int
) -> None:
    """The audit's attack through the real node stages (distributed_adaptive_one_node.py): node 1000
    writes +-M/14 in its count; both rounds finish, the clip stays within its bounds."""
    n, dim = 6, 50
    ring = Ring(1.0, 2**16, 2**40)
    base = {"w": torch.zeros(dim)}
    models = [{"w": 0.01 * torch.ones(dim)} for _ in range(n)]

    def edit(ints: np.ndarray, layout: Layout) -> None:
        ints[extra_at(layout, UNCLIPPED)] = sign * (ring.modulus // 2 // 7)

    lie(monkeypatch, edit, (UNCLIPPED,), base, ring)
    dp = _dp(ring=ring, dim=dim)
    sampling = Sampling(min_train_nodes=n, min_available_nodes=n)
    strategy = SecureFedAvg(secagg=SecAggSettings(ring, max_weight=1000.0), dp=dp, sampling=sampling)
    rounds = _rounds(strategy, InProcessGrid(Nodes(models, [10] * n), n), base, 2)
    assert all(new is not None for new, _, _ in rounds)
    assert dp.clip_floor <= dp.clip_norm <= ring.clipping_range


def test_a_checkpoints_bad_clip_is_clamped_with_a_warning_and_a_broken_state_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A clip outside [floor, ceiling] in a checkpoint (one written before the clamp, or edited) is
    clamped with a warning naming the value, so resume=auto continues; a clip or a release that is
    not a finite number is refused with the value."""
    good = _dp()
    good.account(6, 6, 3.0)
    state = good.state_dict()
    for bad, want in ((0.0, good.clip_floor), (-3.0, good.clip_floor), (1e300, good.ring.clipping_range)):
        dp = _dp()
        with caplog.at_level(logging.WARNING, logger="flwr.fedgpu"):
            dp.load_state_dict(state | {"clip_norm": bad})
        assert dp.clip_norm == want and dp.releases == good.releases
        assert any(f"{bad:g}" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    for broken in ({"clip_norm": float("nan")}, {"clip_norm": "1.0"}, {"releases": [[-1.0, 1.0, 1.0]]}):
        with pytest.raises(ValueError, match="distributed DP"):
            _dp().load_state_dict(state | broken)


@pytest.mark.slow
def test_resume_auto_from_a_checkpoint_holding_a_zero_clip_continues_and_a_nan_clip_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The audit's resume (distributed_adaptive_one_node.py), with the real ClientApp: a checkpoint
    whose clip a node drove to 0.0 before the clip was bounded resumes with the clip at its floor
    (warned); one holding NaN stops with the file and the value named, before any round."""
    from app.tools.in_process import run_in_process

    overrides = (
        "train.epochs=1 seed=5 secagg=plus privacy=distributed_adaptive federation.min_train_nodes=3 "
        "federation.min_available_nodes=3 name=adaptive resume=auto ledger=off tracking.tensorboard=false"
    )
    summary, _ = run_in_process(f"federation.rounds=1 {overrides}", tmp_path, nodes=3)
    assert summary["status"] == "completed"
    path = tmp_path / "adaptive" / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=True)
    for clip in (float("nan"), 0.0):
        ckpt["strategy_state"]["distributed_dp"]["clip_norm"] = clip
        torch.save(ckpt, path)
        if math.isnan(clip):
            with pytest.raises(ValueError, match=rf"resume={path}: .*clip_norm is nan"):
                run_in_process(f"federation.rounds=2 {overrides}", tmp_path, nodes=3)
            continue
        with caplog.at_level(logging.WARNING, logger="flwr.fedgpu"):
            summary, _ = run_in_process(f"federation.rounds=2 {overrides}", tmp_path, nodes=3)
        assert summary["status"] == "completed", summary
        assert any("clip_norm 0 is outside" in r.getMessage() for r in caplog.records)
        assert summary["privacy"]["clip_norm"] > 0, summary["privacy"]
