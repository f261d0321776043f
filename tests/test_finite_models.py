"""Only finite steps reach the global model (issue 32, finding 2).

One liar sending +float32-max in a coordinate, then -float32-max, once carried plain FedBuff's
model to -inf: `model - base` overflowed, every later reply was rejected, and the non-finite model
was checkpointed. Every strategy now checks the model it is about to apply
(`strategies.tensor_ops.finite_step`): a step that would hold NaN or Inf is refused, the replies
that push it there are rejected by name, the step is redone without them, and no checkpoint is ever
written with a non-finite value (`app.run.checkpoint`).

`test_a_liar_cannot_make_any_model_non_finite` drives each strategy with finite inputs that make
its step non-finite. Robust rules are immune to one liar in practice (Krum's Gram diagonal rejects
the update, the median ignores it), so there the rule is replaced by one that adds every update at
full weight, which the ±max attack overflows: the guard, not the rule, must catch it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from app.compression.packing import pack, unpack
from app.config.schema import CompressionConfig
from app.run.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from app.simulation.local_grid import InProcessGrid
from app.simulation.messages import make_reply
from strategies.central_dp import CentralDP, DPFedAvg, DPFedBuff, NonFiniteRelease
from strategies.coordinatewise import MedianRule, TrimmedMeanRule
from strategies.fedavg import FedAvg
from strategies.fedbuff import FedBuff, InFlight, VersionReport
from strategies.krum import KrumRule, MultiKrumRule
from strategies.replies import Screened, ValidReply
from strategies.robust import RobustRule, RobustStrategy
from strategies.settings import ReplyLimits, Sampling
from strategies.staleness import staleness_fn
from strategies.tensor_ops import finite_step, is_finite, non_finite_keys

MAX = float(np.finfo(np.float32).max)
LIAR = 1
HONEST = [2, 3, 4, 5, 6]
LIAR_COUNT, HONEST_COUNT = 1000, 10  # the liar's claim fits the example cap; the honest nodes hold less data


def _record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def _numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in record.items()}


# --- drivers: one aggregation step from (node, model or update, count) triples ----------------
@dataclass
class Outcome:
    rejected: dict[int, str]
    accepted: set[int]


class SyncDriver:
    """A synchronous strategy (FedAvg and its subclasses): one round per step."""

    def __init__(self, strategy: FedAvg, start: dict[str, np.ndarray], nodes: int) -> None:
        self.strategy, self.arrays, self.round = strategy, _record(start), 0
        strategy.sampling = replace(strategy.sampling, min_available_nodes=nodes, min_train_nodes=nodes)
        self.grid = InProcessGrid(lambda m, c: m, num_nodes=nodes)

    @property
    def model(self) -> dict[str, np.ndarray]:
        return _numpy(self.arrays)

    def step(self, sends: list[tuple[int, dict[str, np.ndarray], int]]) -> Outcome:
        self.round += 1
        self.strategy.configure_train(self.round, self.arrays, ConfigRecord(), self.grid)
        replies = [make_reply(node, arrays, {"num-examples": n}) for node, arrays, n in sends]
        new, _ = self.strategy.aggregate_train(self.round, replies)
        if new is not None:
            self.arrays = new
        report = self.strategy.train_report
        return Outcome({r.node_id: r.reason for r in report.rejected}, set(report.accepted))


class AsyncDriver:
    """FedBuff: one buffer of replies, all trained on the current version, per step."""

    def __init__(self, strategy: FedBuff, start: dict[str, np.ndarray]) -> None:
        self.strategy, self.tasks = strategy, 0
        strategy.set_model(_record(start), 0)

    @property
    def model(self) -> dict[str, np.ndarray]:
        return _numpy(self.strategy.arrays)

    def step(self, sends: list[tuple[int, dict[str, np.ndarray], int]]) -> Outcome:
        s, replies = self.strategy, []
        for node, arrays, n in sends:
            self.tasks += 1
            s.in_flight[f"t{self.tasks}"] = InFlight(node, s.version, math.inf)
            replies.append(make_reply(node, arrays, {"num-examples": n}, message_id=f"t{self.tasks}"))
        s.aggregate_train(s.version, replies)
        report, s.report = s.report, VersionReport()  # as FedBuff.run hands each version's report on
        return Outcome({r.node_id: r.reason for r in report.rejected}, {u["node_id"] for u in report.applied})


# --- the attack: the liar's values at coordinate 0 of "w", honest nodes a small step ------------
def _honest(model: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v + np.float32(0.01) for k, v in model.items()}


def _liar(model: dict[str, np.ndarray], value: float) -> dict[str, np.ndarray]:
    out = _honest(model)
    out["w"] = out["w"].copy()
    out["w"][0] = value
    return out


@dataclass
class Scenario:
    build: Callable[[], SyncDriver | AsyncDriver]
    attack: list[float]  # the liar's value at w[0] in each attack step
    start_w0: float = 0.0  # the global model's w[0] at the start
    honest_per_step: int = 2
    rule_adds_updates: bool = False  # replace the robust rule by one that adds every update (see the module docstring)
    encode: Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
    relative: bool = False  # the liar's value is added to the model's w[0] (an update) instead of replacing it
    refused_step: list[bool] = field(default_factory=list)  # which attack steps the liar must be rejected in


def _fedbuff(**kwargs) -> FedBuff:  # noqa: ANN003
    defaults = {"buffer_size": 3, "max_staleness": 5, "staleness": staleness_fn("constant"), "server_lr": 0.5}
    return FedBuff(**{**defaults, **kwargs})


def _dp(sensitivity: float = 1.0) -> CentralDP:
    return CentralDP(
        noise_multiplier=1.0,
        clip_norm=1.0,
        delta=1e-5,
        sensitivity=sensitivity,
        generator=torch.Generator().manual_seed(0),
    )


TOPK = CompressionConfig(name="topk", ratio=0.5, error_feedback=False)


def _compressed_fedbuff() -> AsyncDriver:
    strategy = _fedbuff(
        server_lr=1.0, server_momentum=0.9, limits=ReplyLimits(unpack=lambda record, base: unpack(record, base, TOPK))
    )
    return AsyncDriver(strategy, _start(0.0))


def _topk_update(trained: dict[str, np.ndarray], received: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a node with a topk uplink sends: its encoded update (trained - received)."""
    as_torch = {k: torch.from_numpy(v) for k, v in trained.items()}
    record = pack(as_torch, {k: torch.from_numpy(v) for k, v in received.items()}, TOPK, RecordDict())
    return _numpy(record)


def _start(w0: float) -> dict[str, np.ndarray]:
    w = np.full(6, 0.1, dtype=np.float32)
    w[0] = w0
    return {"w": w, "b": np.zeros(2, dtype=np.float32)}


def _sync(strategy: FedAvg, w0: float = 0.0, nodes: int = 3) -> Callable[[], SyncDriver]:
    return lambda: SyncDriver(strategy, _start(w0), nodes)


SCENARIOS: dict[str, Scenario] = {
    # The liar has already saturated w[0] (a few rounds of +max do it): its capped claim then
    # rounds the weighted mean of values all equal to float32-max up to inf.
    "fedavg": Scenario(lambda: SyncDriver(FedAvg(), _start(MAX), 3), attack=[MAX], start_w0=MAX, refused_step=[True]),
    "krum": Scenario(
        lambda: SyncDriver(RobustStrategy(rule=KrumRule(num_byzantine=1)), _start(0.0), 5),
        attack=[MAX, -MAX],
        honest_per_step=4,
        rule_adds_updates=True,
        refused_step=[False, True],
    ),
    "multikrum": Scenario(
        lambda: SyncDriver(RobustStrategy(rule=MultiKrumRule(num_byzantine=1, num_selected=3)), _start(0.0), 5),
        attack=[MAX, -MAX],
        honest_per_step=4,
        rule_adds_updates=True,
        refused_step=[False, True],
    ),
    "median": Scenario(
        lambda: SyncDriver(RobustStrategy(rule=MedianRule(num_byzantine=1)), _start(0.0), 5),
        attack=[MAX, -MAX],
        honest_per_step=4,
        rule_adds_updates=True,
        refused_step=[False, True],
    ),
    "trimmed_mean": Scenario(
        lambda: SyncDriver(RobustStrategy(rule=TrimmedMeanRule(num_byzantine=1, trim_ratio=0.2)), _start(0.0), 5),
        attack=[MAX, -MAX],
        honest_per_step=4,
        rule_adds_updates=True,
        refused_step=[False, True],
    ),
    # The finding as reported: +max is a finite step, -max then overflows `model - base`.
    "fedbuff_mean": Scenario(
        lambda: AsyncDriver(_fedbuff(), _start(0.0)), attack=[MAX, -MAX], refused_step=[False, True]
    ),
    "fedbuff_robust": Scenario(
        lambda: AsyncDriver(_fedbuff(buffer_size=5, buffer_rule=KrumRule(num_byzantine=1)), _start(0.0)),
        attack=[MAX, -MAX],
        honest_per_step=4,
        rule_adds_updates=True,
        refused_step=[False, True],
    ),
    # Central DP clips every update, but clipping an update that overflowed float32 gives NaN: the
    # release (and the run) used to fail. The model sits at -0.75 max, the liar sends +0.75 max.
    "central_dp_sync": Scenario(
        lambda: SyncDriver(DPFedAvg(dp=_dp()), _start(-0.75 * MAX), 3),
        attack=[0.75 * MAX],
        start_w0=-0.75 * MAX,
        refused_step=[True],
    ),
    "central_dp_fedbuff": Scenario(
        lambda: AsyncDriver(
            DPFedBuff(dp=_dp(sensitivity=2.0), buffer_size=3, staleness=staleness_fn("constant")), _start(-0.75 * MAX)
        ),
        attack=[0.75 * MAX],
        start_w0=-0.75 * MAX,
        refused_step=[True],
    ),
    # A topk uplink: every decoded model is finite (screening checks it), but server momentum
    # carries two updates of +0.45 max past float32-max; later the momentum alone would.
    "compressed_uplink": Scenario(
        _compressed_fedbuff,
        attack=[0.45 * MAX, 0.45 * MAX],
        encode=_topk_update,
        relative=True,
        refused_step=[False, True],
    ),
}


def _adds_every_update(
    self: RobustRule, server_round: int, current, screened: Screened, bases, report
) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """A broken rule: current + the sum of all updates, in float32 (no mean, no selection)."""
    out = {k: t.clone() for k, t in current.items()}
    for reply, base in zip(screened.valid, bases, strict=True):
        for k in out:
            out[k] += reply.arrays[k] - base[k]
    return out


def _checkpoint_is_finite(path: Path, model: dict[str, np.ndarray], step: int, strategy) -> bool:  # noqa: ANN001
    save_checkpoint(
        path, Checkpoint({k: torch.from_numpy(v) for k, v in model.items()}, step, strategy.state_dict(), {}, 0.0)
    )
    saved = torch.load(path, map_location="cpu", weights_only=True)  # as written, before load_checkpoint's checks
    tensors = list(saved["state_dict"].values()) + list((saved["strategy_state"].get("velocity") or {}).values())
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_liar_cannot_make_any_model_non_finite(name, monkeypatch, tmp_path, caplog):
    scenario = SCENARIOS[name]
    if scenario.rule_adds_updates:
        for rule in (MultiKrumRule, MedianRule):  # KrumRule and TrimmedMeanRule inherit these
            monkeypatch.setattr(rule, "combine", _adds_every_update)
            monkeypatch.setattr(rule, "finds_non_finite", False)
    driver = scenario.build()
    honest = HONEST[: scenario.honest_per_step]
    checkpoint = tmp_path / "checkpoint.pt"
    caplog.set_level(logging.WARNING)

    def sends(liar_value: float | None) -> list[tuple[int, dict[str, np.ndarray], int]]:
        model = driver.model
        if liar_value is not None and scenario.relative:
            liar_value += float(model["w"][0])
        out = [] if liar_value is None else [(LIAR, _liar(model, liar_value), LIAR_COUNT)]
        nodes = honest if liar_value is not None else HONEST[: len(honest) + 1]  # a full buffer of honest nodes
        out += [(node, _honest(model), HONEST_COUNT) for node in nodes]
        if scenario.encode is not None:
            out = [(node, scenario.encode(arrays, model), n) for node, arrays, n in out]
        return out

    for step, value in enumerate(scenario.attack, start=1):
        caplog.clear()
        outcome = driver.step(sends(value))
        assert all(np.isfinite(v).all() for v in driver.model.values()), f"step {step}: {driver.model}"
        assert _checkpoint_is_finite(checkpoint, driver.model, step, driver.strategy)
        if scenario.refused_step[step - 1]:
            assert LIAR in outcome.rejected and "non-finite" in outcome.rejected[LIAR], outcome
            assert LIAR not in outcome.accepted
            assert any(f"node {LIAR}" in r.getMessage() and "non-finite" in r.getMessage() for r in caplog.records)
            assert set(honest) <= outcome.accepted, outcome  # the step is redone without the liar
    for step in range(len(scenario.attack) + 1, len(scenario.attack) + 3):  # honest replies go on being used
        outcome = driver.step(sends(None))
        assert not outcome.rejected, outcome
        assert outcome.accepted, outcome
        assert all(np.isfinite(v).all() for v in driver.model.values())
        assert _checkpoint_is_finite(checkpoint, driver.model, step, driver.strategy)
    assert np.isfinite(driver.model["w"][0])


# --- the robust rules themselves, unpatched ---------------------------------------------------------
@pytest.mark.parametrize(
    "build",
    [
        lambda: SyncDriver(RobustStrategy(rule=KrumRule(num_byzantine=1)), _start(0.0), 5),
        lambda: SyncDriver(RobustStrategy(rule=MultiKrumRule(num_byzantine=1, num_selected=3)), _start(0.0), 5),
        lambda: SyncDriver(RobustStrategy(rule=MedianRule(num_byzantine=1)), _start(0.0), 5),
        lambda: SyncDriver(RobustStrategy(rule=TrimmedMeanRule(num_byzantine=1, trim_ratio=0.2)), _start(0.0), 5),
        # f = 0 and nothing trimmed: the mean of updates, where -max - base overflows
        lambda: SyncDriver(RobustStrategy(rule=TrimmedMeanRule(num_byzantine=0, trim_ratio=0.1)), _start(0.0), 5),
        lambda: AsyncDriver(_fedbuff(buffer_size=5, buffer_rule=KrumRule(num_byzantine=1)), _start(0.0)),
        lambda: AsyncDriver(_fedbuff(buffer_size=5, buffer_rule=TrimmedMeanRule(trim_ratio=0.1)), _start(0.0)),
    ],
    ids=["krum", "multikrum", "median", "trimmed_mean", "trimmed_mean_f0", "fedbuff_krum", "fedbuff_trimmed_f0"],
)
def test_robust_rules_keep_the_model_finite_under_the_attack(build):
    driver = build()
    for value in (MAX, -MAX, MAX, None):
        model = driver.model
        sends = [(LIAR, _liar(model, value), LIAR_COUNT)] if value is not None else []
        driver.step(sends + [(node, _honest(model), HONEST_COUNT) for node in HONEST[:4]])
        assert all(np.isfinite(v).all() for v in driver.model.values()), driver.model


# --- the guard itself ---------------------------------------------------------------------------
def test_finite_step_drops_the_largest_push_and_redoes_the_step():
    """Three contributions to a sum; the one whose scaled update is largest where the sum
    overflows goes, then the step is finite."""
    base = {"w": torch.tensor([0.0, 0.0])}
    models = {
        "a": {"w": torch.tensor([MAX, 1.0])},
        "b": {"w": torch.tensor([MAX / 2, 1.0])},
        "c": {"w": torch.tensor([1.0, 1.0])},
    }

    def step(kept):
        out = {"w": base["w"].clone()}
        for name in kept:
            out["w"] += models[name]["w"] - base["w"]
        return out, [(name, models[name], base, 1.0) for name in kept]

    new, dropped = finite_step(["a", "b", "c"], step)
    assert [d for d, _ in dropped] == ["a"] and "non-finite" in dropped[0][1]
    assert is_finite(new["w"])


def test_finite_step_refuses_a_step_nobody_can_be_blamed_for():
    new, dropped = finite_step(
        ["a"], lambda kept: ({"w": torch.tensor([math.inf])}, [(x, {"w": torch.zeros(1)}, None, 1.0) for x in kept])
    )
    assert new is None and [d for d, _ in dropped] == ["a"]


def test_is_finite_is_exact_where_a_sum_of_finite_values_overflows():
    big = torch.full((4,), MAX)
    assert is_finite(big) and non_finite_keys({"w": big}) == []
    assert not is_finite(torch.tensor([MAX, math.inf])) and not is_finite(torch.tensor([0.0, math.nan]))


def test_a_dp_release_leaves_out_an_update_that_is_not_finite_and_names_it():
    dp = _dp()
    refused: list[int] = []
    updates = [{"w": torch.tensor([math.inf, 0.0])}, {"w": torch.tensor([0.5, 0.0])}]
    total = dp.release(updates, {"w": torch.zeros(2)}, expected_cohort=2.0, refused=refused)
    assert refused == [0] and is_finite(total["w"]) and dp.releases == 1


def test_dp_model_overflow_stops_the_run_naming_the_nodes():
    """Clipped updates cannot overflow a sane model: a non-finite model after a release means the
    settings are absurd; redoing the release would spend epsilon twice, so it raises instead."""
    strategy = DPFedAvg(
        dp=CentralDP(noise_multiplier=1e-29, clip_norm=1e38, delta=1e-5), sampling=Sampling(min_train_nodes=1)
    )
    strategy._global, strategy._expected_cohort = {"w": torch.tensor([3e38])}, 0.1
    reply = ValidReply(node_id=7, weight=1.0, metrics=MetricRecord(), arrays={"w": torch.tensor([3.3e38])})
    with pytest.raises(NonFiniteRelease, match=r"round 3's model \(updates of \[node 7\]\)"):
        strategy.aggregate_models(3, Screened(valid=[reply]))


# --- checkpoints ------------------------------------------------------------------------------------
def _ckpt(w: torch.Tensor, velocity: dict | None = None) -> Checkpoint:
    return Checkpoint({"w": w, "n": torch.tensor(3)}, 4, {"strategy": "FedBuff", "velocity": velocity}, {}, 1.0)


def test_a_non_finite_model_is_never_checkpointed(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, _ckpt(torch.ones(3)))
    for bad in (_ckpt(torch.tensor([1.0, -math.inf, 0.0])), _ckpt(torch.ones(3), {"w": torch.tensor([math.nan])})):
        with pytest.raises(ValueError, match="NaN or Inf") as err:
            save_checkpoint(path, bad)
        assert "w" in str(err.value)
    assert torch.equal(load_checkpoint(path).state_dict["w"], torch.ones(3))  # the last good one stands
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_a_non_finite_checkpoint_is_not_resumed_from(tmp_path):
    """A checkpoint written before the guard existed."""
    path = tmp_path / "old.pt"
    torch.save(
        {
            "format": 1,
            "state_dict": {"w": torch.tensor([-math.inf])},
            "round": 2,
            "strategy_state": {},
            "rng": {},
            "wall_time_s": 0.0,
        },
        path,
    )
    with pytest.raises(ValueError, match=r"resume=.*NaN or Inf.*\['w'\]"):
        load_checkpoint(path)
