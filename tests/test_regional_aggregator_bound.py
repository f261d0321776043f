"""A malicious regional aggregator (topology=regions on a deployment; issue 48, finding 15).

The global server cannot see a region's sites: an aggregator replies with its region's model and
weight, and the top level takes it as any node's reply, built here exactly as a two-level
deployment builds it (`deployed_regions`: the weight cap `topology.region_max_examples`; the
configured strategy with its reply screening and `strategy.norm_bound`). What that bounds: the
weight (capped), the arrays (keys, shapes, dtypes, finite), the step (norm bound; finite model).
What it does not: the counts and metrics the region reports beside its weight.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.supercore.run import Run

from app import protocol
from app.config.compose import load_config
from app.regions.deployed import deployed_regions
from app.run.factory import StrategyParts, build_strategy
from app.simulation.local_grid import InProcessGrid
from app.simulation.messages import make_reply
from strategies.settings import ReplyLimits, TaskWiring

CAP = 1000  # topology.region_max_examples
HONEST = 600  # each honest region's summed (capped) site counts
REGIONS = 4
LIAR = 1000 + REGIONS - 1  # the last aggregator's node id (InProcessGrid numbers nodes from 1000)
OVERRIDES = (
    f"topology=regions topology.regions={REGIONS} topology.region_max_examples={CAP} "
    f"federation.max_examples_per_node=100 federation.min_train_nodes={REGIONS} "
    f"federation.min_available_nodes={REGIONS}"
)


class _DeployedGrid:
    """What `deployed_regions` reads of a deployed grid: Flower's record of the run."""

    def __init__(self, overrides: str) -> None:
        self.run = replace(Run.create_empty(7), override_config={"overrides": overrides})


def _top(overrides: str = OVERRIDES):  # noqa: ANN202
    """The global server's strategy over aggregators, as app/run/assemble.py builds it on a deployment."""
    cfg, _ = load_config(overrides)
    regional = deployed_regions(cfg, _DeployedGrid(overrides), simulated=False)
    limits = ReplyLimits(weight_cap=regional.weight_cap)
    return build_strategy(regional.top(cfg), StrategyParts(torch.device("cpu"), None, limits, TaskWiring()))


def _round(strategy, replies_of):  # noqa: ANN001, ANN202
    """One round: the global model sent to every aggregator, `replies_of(global)` back; the new
    model, the round's metrics and the report."""
    g = np.random.default_rng(0)
    model = {"w": g.normal(size=(8, 4)).astype(np.float32), "b": g.normal(size=4).astype(np.float32)}
    grid = InProcessGrid(lambda msg, ctx: msg, REGIONS)
    try:
        messages = list(
            strategy.configure_train(1, ArrayRecord({k: Array(v) for k, v in model.items()}), ConfigRecord({}), grid)
        )
    finally:
        grid.close()
    for m in messages:  # the ids the grid would give them when pushing
        m.metadata.__dict__["_message_id"] = f"m{m.metadata.dst_node_id}"
    arrays, metrics = strategy.aggregate_train(1, replies_of(model))
    new = {k: a.numpy() for k, a in arrays.items()} if arrays is not None else None
    return model, new, metrics, strategy.train_report


def _honest(model: dict[str, np.ndarray], node: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(node)
    return {k: v + 0.01 * g.normal(size=v.shape).astype(np.float32) for k, v in model.items()}


def _claims(weight: float, nodes: int = 3) -> dict[str, float]:
    return {protocol.NUM_EXAMPLES: weight, protocol.REGION_SAMPLED: nodes, protocol.REGION_NODES: nodes}


def test_an_aggregator_claiming_a_huge_count_weighs_at_most_the_region_cap_and_its_other_counts_go_unchecked():
    """The liar claims 1e12 examples and 10^9 sites for a (moderate, finite) update of its choice:
    its weight is the cap, so its share of the mean is CAP / (CAP + the honest weights); the sites
    it says it had are reported as claimed (the top level cannot check them)."""

    def replies(model):  # noqa: ANN001, ANN202
        out = [make_reply(n, _honest(model, n), _claims(HONEST)) for n in range(1000, LIAR)]
        bad = {k: v - 0.5 for k, v in model.items()}
        return [*out, make_reply(LIAR, bad, _claims(1e12, nodes=10**9))]

    model, new, metrics, report = _round(_top(), replies)
    assert report.capped == [{"node_id": LIAR, "claimed": 1e12, "weight": CAP}]
    assert sorted(report.accepted) == list(range(1000, LIAR + 1))
    total = HONEST * (REGIONS - 1) + CAP
    for k, v in model.items():
        want = (
            sum(HONEST * _honest(model, n)[k].astype(np.float64) for n in range(1000, LIAR)) + CAP * (v - 0.5)
        ) / total
        np.testing.assert_allclose(new[k], want, rtol=1e-5, atol=1e-5)
    assert metrics[protocol.NUM_EXAMPLES] == total  # the claim's excess counts nowhere
    # not bounded: the region's own account of its sites enters the row's weighted metrics as sent
    assert metrics[protocol.REGION_NODES] == pytest.approx((3 * HONEST * (REGIONS - 1) + 10**9 * CAP) / total)


def test_an_aggregator_sending_non_finite_or_wrongly_shaped_arrays_is_rejected_and_the_round_goes_on():
    def replies(model):  # noqa: ANN001, ANN202
        nan = {**model, "w": np.full_like(model["w"], np.nan)}
        shape = {**model, "b": np.zeros(5, np.float32)}
        return [
            make_reply(1000, _honest(model, 1000), _claims(HONEST)),
            make_reply(1001, _honest(model, 1001), _claims(HONEST)),
            make_reply(1002, nan, _claims(HONEST)),
            make_reply(1003, shape, _claims(HONEST)),
        ]

    model, new, _, report = _round(_top(), replies)
    reasons = {r.node_id: r.reason for r in report.rejected}
    assert sorted(reasons) == [1002, 1003] and "non-finite" in reasons[1002] and "b" in reasons[1003], reasons
    for k in model:
        want = (_honest(model, 1000)[k].astype(np.float64) + _honest(model, 1001)[k]) / 2
        np.testing.assert_allclose(new[k], want, rtol=1e-5, atol=1e-6)


def test_a_finite_exploded_region_update_is_rejected_by_the_norm_bound_and_else_moves_the_model_by_its_capped_share():
    """global + 1e6 (finite, of the right shape, claiming the cap): under the default
    strategy.norm_bound it is rejected ("update norm ..."; the first round's reference is the
    model's own norm) and the honest regions' mean is the model; with the bound off it enters the
    mean at its capped share, no more: new - global = CAP / total x 1e6 + the honest part."""

    def replies(model):  # noqa: ANN001, ANN202
        out = [make_reply(n, _honest(model, n), _claims(HONEST)) for n in range(1000, LIAR)]
        return [*out, make_reply(LIAR, {k: v + np.float32(1e6) for k, v in model.items()}, _claims(CAP))]

    model, new, _, report = _round(_top(), replies)
    ((node, why),) = [(r.node_id, r.reason) for r in report.rejected]
    assert node == LIAR and why.startswith("update norm"), why
    for k in model:
        want = sum(_honest(model, n)[k].astype(np.float64) for n in range(1000, LIAR)) / (REGIONS - 1)
        np.testing.assert_allclose(new[k], want, rtol=1e-5, atol=1e-5)

    model, new, _, report = _round(_top(OVERRIDES + " strategy.norm_bound=0"), replies)
    assert report.rejected == [] and LIAR in report.accepted
    share = CAP / (HONEST * (REGIONS - 1) + CAP)
    for k, v in model.items():
        honest = sum(HONEST * (_honest(model, n)[k].astype(np.float64) - v) for n in range(1000, LIAR))
        want = v + share * 1e6 + honest / (HONEST * (REGIONS - 1) + CAP)
        np.testing.assert_allclose(new[k], want, rtol=1e-5)
