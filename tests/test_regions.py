"""topology=regions in simulation (strategies/regional.py, app/regions/, the virtual clock's
`Regions`): two-level FedAvg equals flat FedAvg, robust rules at either level, the WAN codec's
error feedback, the hand-computed two-level timeline, WAN bytes, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.config.compose import load_config
from app.config.schema import ConfigError, TopologyConfig
from app.regions.topology import region_of_partitions
from app.regions.traffic import wan_bytes
from app.regions.wan import WanCodec
from app.run.factory import partition_sizes
from app.run.results import read_rows
from app.task.data import load_splits
from app.tools.in_process import run_in_process
from strategies.coordinatewise import MedianRule
from strategies.fedavg import FedAvg
from strategies.krum import KrumRule
from strategies.regional import RegionalCombine, region_node
from strategies.replies import Screened, ValidReply
from strategies.robust import RobustStrategy
from tests.test_fleet import _fleet, _train_size

FAST = "train.epochs=1 seed=3 ledger=off "


def _reply(node: int, value: float, weight: float = 1.0, size: int = 4) -> ValidReply:
    from flwr.app import MetricRecord

    return ValidReply(
        node, weight, MetricRecord({"num-examples": weight, "train_loss": value}), {"w": torch.full((size,), value)}
    )


def _strategy(regions: RegionalCombine, rule: object = None) -> FedAvg:
    strategy = FedAvg(regions=regions) if rule is None else RobustStrategy(rule=rule, regions=regions)
    strategy._global = {"w": torch.zeros(4)}  # what configure_train sets: every reply's base
    return strategy


def _combine(strategy: FedAvg, replies: list[ValidReply]) -> tuple[torch.Tensor | None, Screened]:
    screened = Screened(valid=list(replies))
    new = strategy.combine(1, screened)
    return (new["w"] if new is not None else None), screened


# ----------------------------------------------------------------------------- the combine


def test_two_level_means_are_the_flat_weighted_mean() -> None:
    """Σ_r W_r (Σ_{i in r} w_i x_i / W_r) / Σ_r W_r = Σ w_i x_i / Σ w_i: any grouping, any weights."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(9, generator=gen).tolist()
    weights = (torch.rand(9, generator=gen) * 100 + 1).tolist()
    region = [0, 2, 1, 1, 0, 2, 2, 0, 1]
    replies = [_reply(1000 + i, v, w) for i, (v, w) in enumerate(zip(values, weights, strict=True))]
    combine = RegionalCombine(lambda n: region[n - 1000], 3)
    new, _ = _combine(_strategy(combine), replies)
    flat = sum(w * v for v, w in zip(values, weights, strict=True)) / sum(weights)
    assert new == pytest.approx(torch.full((4,), flat), abs=1e-6)
    row = combine.row()
    for r in range(3):
        members = [i for i in range(9) if region[i] == r]
        assert row[str(r)]["weight"] == pytest.approx(sum(weights[i] for i in members))
        assert sorted(row[str(r)]["nodes"]) == [1000 + i for i in members]


def test_krum_inside_a_region_leaves_its_attacker_out() -> None:
    """Region 0: four honest updates near 1 and one at 100; Krum (f = 1, n = 5 >= 2f + 3) picks an
    honest one, so the region's model is near 1; region 1's mean is 2; the top mean weighs both."""
    honest = [_reply(1000 + i, 1.0 + 0.01 * i) for i in range(4)]
    attacker = _reply(1004, 100.0)
    other = [_reply(1005, 2.0), _reply(1006, 2.0)]
    region = {**dict.fromkeys(range(1000, 1005), 0), 1005: 1, 1006: 1}
    combine = RegionalCombine(region.get, 2, rule=KrumRule(num_byzantine=1))
    strategy = _strategy(combine)
    new, _ = _combine(strategy, [*honest, attacker, *other])
    assert new is not None and float(new.max()) < 2.5  # the attacker moved nothing
    assert 1004 in strategy.train_report.excluded
    assert combine.row()["0"]["excluded"] and combine.row()["0"]["weight"] == 1.0  # Krum keeps one update


def test_a_median_of_region_means_bounds_a_poisoned_region() -> None:
    """Three regions with means 1, 1.2 and 50 (its attacker): the top median is 1.2 exactly."""
    replies = [
        _reply(1000, 1.0),
        _reply(1001, 1.0),
        _reply(1002, 1.2),
        _reply(1003, 1.2),
        _reply(1004, 99.0),
        _reply(1005, 1.0),
    ]
    region = dict(zip(range(1000, 1006), [0, 0, 1, 1, 2, 2], strict=True))
    new, _ = _combine(_strategy(RegionalCombine(region.get, 3), MedianRule(num_byzantine=1)), replies)
    assert new == pytest.approx(torch.full((4,), 1.2))


def test_a_region_the_top_rule_leaves_out_takes_its_members_with_it() -> None:
    """Krum at the top over five regions (f = 1): the region at 100 is excluded, and its two
    members become the round's excluded nodes; the scores go to the regions' entries."""
    values = [1.0, 1.1, 0.9, 1.05, 100.0]
    replies = [_reply(1000 + 2 * r + k, v) for r, v in enumerate(values) for k in range(2)]
    combine = RegionalCombine(lambda n: (n - 1000) // 2, 5)
    strategy = _strategy(combine, KrumRule(num_byzantine=1))
    new, _ = _combine(strategy, replies)
    assert new is not None and float(new.max()) < 2
    assert set(strategy.train_report.excluded) >= {1008, 1009}
    assert strategy.train_report.scores == {}
    row = combine.row()
    assert row["4"]["top_excluded"] is True and "score" in row["0"]


def test_a_node_without_a_region_is_rejected_not_averaged() -> None:
    combine = RegionalCombine(lambda n: 0 if n == 1000 else None, 1)
    new, screened = _combine(_strategy(combine), [_reply(1000, 1.0), _reply(1001, 50.0)])
    assert new == pytest.approx(torch.ones(4))
    assert [r.node_id for r in screened.rejected] == [1001]


def test_the_wan_codec_sends_what_it_rounded_away_later() -> None:
    """Error feedback on the WAN leg: over rounds the decoded updates sum to the true ones minus
    the last residual, and int8 costs about a quarter of float32's bytes."""
    codec = WanCodec("int8", seed=1)
    gen = torch.Generator().manual_seed(2)
    true, sent = torch.zeros(5000), torch.zeros(5000)
    for _ in range(5):
        update = {"w": torch.randn(5000, generator=gen)}
        decoded, nbytes = codec(0, update)
        true += update["w"]
        sent += decoded["w"]
        assert nbytes < 5000 * 4 / 3
    assert sent + codec.residuals[0]["w"] == pytest.approx(true, abs=1e-4)
    again = WanCodec("int8", seed=1)
    again.load_state_dict(codec.state_dict())
    update = {"w": torch.randn(5000, generator=gen)}
    assert torch.equal(codec(0, update)[0]["w"], again(0, update)[0]["w"])  # a resumed run rounds the same


# ----------------------------------------------------------------------------- assignment and bytes


def test_regions_come_from_a_count_a_list_or_a_csv(tmp_path: Path) -> None:
    assert region_of_partitions(TopologyConfig(regions=2), 5) == [0, 1, 0, 1, 0]
    assert region_of_partitions(TopologyConfig(assignment=[1, 0, 1]), 3) == [1, 0, 1]
    csv = tmp_path / "regions.csv"
    csv.write_text("partition,region\n0,0\n2,1\n1,1\n")
    assert region_of_partitions(TopologyConfig(csv=str(csv)), 3) == [0, 1, 1]
    for bad, n, words in [
        (TopologyConfig(assignment=[0, 1]), 3, "missing [2]"),
        (TopologyConfig(assignment=[0, 2, 0]), 3, "0..R-1"),
        (TopologyConfig(regions=4), 3, "more regions than"),
    ]:
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            region_of_partitions(bad, n)


def test_wan_bytes_count_every_transfer_flat_and_one_each_way_per_region() -> None:
    region = {1: 0, 2: 0, 3: 1}.get
    sent, received = [(1, 100), (2, 100), (3, 100)], [(1, 90), (2, 90), (3, 90)]
    assert wan_bytes(region, sent, received, None) == (570, {0: 180, 1: 90})
    assert wan_bytes(region, sent, received, {}) == (380, {0: 90, 1: 90})
    assert wan_bytes(region, sent, received, {0: 20}) == (310, {0: 20, 1: 90})  # region 0 through a codec


# ----------------------------------------------------------------------------- federations


def test_hierarchical_fedavg_gives_the_flat_model(tmp_path: Path) -> None:
    """Six nodes in three regions: the two-level model equals flat FedAvg's to float32 rounding
    (the same sums in another order: about 1e-7 after one round, which a second round of training
    from the two models grows to about 1e-5; 1e-4 here); WAN bytes fall by the sites per region
    (2); the row names each region's members."""
    flat, _ = run_in_process(FAST + "federation.rounds=2 topology.regions=3 name=flat", tmp_path, nodes=6)
    tree, _ = run_in_process(
        FAST + "federation.rounds=2 topology=regions topology.regions=3 name=tree", tmp_path, nodes=6
    )
    a, b = (torch.load(Path(s["run_dir"]) / "model_final.pt", weights_only=True) for s in (flat, tree))
    assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) < 1e-4
    flat_rows, tree_rows = read_rows(flat["run_dir"]), read_rows(tree["run_dir"])
    for f, t in zip(flat_rows, tree_rows, strict=True):
        assert f["wan_bytes"] == f["bytes_down_total"] + f["bytes_up_total"]
        assert t["wan_bytes"] * 2 == pytest.approx(f["wan_bytes"], rel=0.01)
        assert "regions" not in f and sorted(len(r["nodes"]) for r in t["regions"].values()) == [2, 2, 2]
        assert f["accuracy"] == pytest.approx(t["accuracy"], abs=1e-9)


def test_a_streamed_regional_round_equals_the_gathered_one(tmp_path: Path) -> None:
    """federation.aggregation=stream with the mean inside regions: one running mean per region
    (the server holds no reply), the same model as gathering them, to float rounding."""
    runs = {}
    for how in ("stream", "gather"):
        overrides = f"federation.rounds=1 topology=regions topology.regions=2 federation.aggregation={how} name={how}"
        summary, _ = run_in_process(FAST + overrides, tmp_path, nodes=4)
        runs[how] = torch.load(Path(summary["run_dir"]) / "model_final.pt", weights_only=True)
        (row,) = read_rows(summary["run_dir"])
        assert sorted(len(r["nodes"]) for r in row["regions"].values()) == [2, 2]
    a, b = runs["stream"], runs["gather"]
    assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) < 1e-6


def test_the_clock_charges_each_regions_wan_leg_once(tmp_path: Path) -> None:
    """Four nodes 1, 2, 1 and 3 times slower than the reference device (which trains a
    partition in about 0.75 s here: 1 s for a third of the data), regions [0, 0, 1, 1], instant
    links inside a region; region 0's WAN: 1 MB/s down and up, 0.5 s one way; region 1's: 2 MB/s
    down, 0.5 MB/s up, 0.1 s. A round: the model (D bytes) down the WAN, the slowest member, the
    update (U) up: region 0 ends at 0.5 + D/1e6 + its slowest + 0.5 + U/1e6, region 1 at
    0.1 + D/2e6 + its slowest + 0.1 + U/5e5, the round with the later. Under flat each site gets
    half its region's link and pays both latencies itself."""
    wan = "fleet.wan_downlink_mbps=[8,16] fleet.wan_uplink_mbps=[8,4] fleet.wan_latency_ms=[500,100]"
    place = "topology.assignment=[0,0,1,1]"
    cfg, _ = load_config("")
    train, _ = load_splits(cfg.dataset, cfg.seed)
    size = partition_sizes(cfg, train.labels, 4)
    compute = [size(p)[0] / _train_size() * f for p, f in enumerate([1, 2, 1, 3])]
    tree, _ = run_in_process(
        _fleet("[1,2,1,3]", f"federation.rounds=1 ledger=off {wan} topology=regions {place} name=tree"),
        tmp_path,
        nodes=4,
    )
    (row,) = read_rows(tree["run_dir"])
    d, u = row["bytes_down"], row["bytes_up"]
    expected = max(0.5 + d / 1e6 + max(compute[:2]) + 0.5 + u / 1e6, 0.1 + d / 2e6 + max(compute[2:]) + 0.1 + u / 5e5)
    assert row["sim_time_s"] == pytest.approx(expected, rel=1e-6)
    flat, _ = run_in_process(
        _fleet("[1,2,1,3]", f"federation.rounds=1 ledger=off {wan} {place} name=flat"), tmp_path, nodes=4
    )
    (row,) = read_rows(flat["run_dir"])
    d, u = row["bytes_down"], row["bytes_up"]
    per_node = [
        0.5 + d / 5e5 + compute[p] + 0.5 + u / 5e5 if p < 2 else 0.1 + d / 1e6 + compute[p] + 0.1 + u / 2.5e5
        for p in range(4)
    ]
    assert row["sim_time_s"] == pytest.approx(max(per_node), rel=1e-6)


def test_fedbuff_over_regions_follows_the_hand_computed_timeline(tmp_path: Path) -> None:
    """FedBuff with regions as its nodes, K = 1, the clock test's fleet: each region's task takes
    P_r = WAN down + its slowest site + WAN up (region 0 about 3.3 s, region 1 about 3.4 s), and
    it starts again on the version current when it reports. So versions land at P0, P1, 2 P0,
    2 P1, from regions 0, 1, 0, 1 (node ids -1, -2), with staleness 0, 1, 1, 1; each version's
    bytes are the regions' own transfers, all over the WAN."""
    wan = "fleet.wan_downlink_mbps=[8,16] fleet.wan_uplink_mbps=[8,4] fleet.wan_latency_ms=[500,100]"
    cfg, _ = load_config("")
    train, _ = load_splits(cfg.dataset, cfg.seed)
    size = partition_sizes(cfg, train.labels, 4)
    compute = [size(p)[0] / _train_size() * f for p, f in enumerate([1, 2, 1, 3])]
    overrides = _fleet(
        "[1,2,1,3]",
        f"strategy=fedbuff strategy.buffer_size=1 federation.rounds=4 federation.eval_every=4 ledger=off {wan} "
        "topology=regions topology.assignment=[0,0,1,1]",
    )
    summary, _ = run_in_process(overrides, tmp_path, nodes=4, workers=2)
    rows = read_rows(summary["run_dir"])
    d, u = rows[0]["bytes_down"], rows[0]["bytes_up"]
    p0 = 0.5 + d / 1e6 + max(compute[:2]) + 0.5 + u / 1e6
    p1 = 0.1 + d / 2e6 + max(compute[2:]) + 0.1 + u / 5e5
    assert p0 < p1 < 2 * p0  # the order below
    assert [r["sim_time_s"] for r in rows] == pytest.approx([p0, p1, 2 * p0, 2 * p1], rel=1e-6)
    assert [(a["node_id"], a["staleness"]) for r in rows for a in r["applied"]] == [(-1, 0), (-2, 1), (-1, 1), (-2, 1)]
    assert all(r["wan_bytes"] == r["bytes_down_total"] + r["bytes_up_total"] for r in rows)


def test_int8_on_the_wan_leg_shrinks_each_regions_update(tmp_path: Path) -> None:
    summary, _ = run_in_process(
        FAST + "federation.rounds=2 topology=regions topology.regions=2 topology.wan_compression=int8",
        tmp_path,
        nodes=4,
    )
    for row in read_rows(summary["run_dir"]):
        for region in row["regions"].values():
            assert 0 < region["wan_bytes_up"] < row["bytes_up"] / 3  # int8: about a quarter of float32
        assert row["model_updated"] is True


def test_a_resumed_run_keeps_each_aggregators_wan_residual(tmp_path: Path) -> None:
    """int8 on the WAN leg: 2 rounds, then resumed to 3, give the model 3 straight rounds give;
    without the residuals (and the rounding generator) in the checkpoint round 3 would differ."""
    # a constant lr: the resume extends federation.rounds, over which the default cosine is laid
    wan = FAST + "topology=regions topology.regions=2 topology.wan_compression=int8 train.lr_schedule=constant "
    straight, _ = run_in_process(wan + "federation.rounds=3 name=straight", tmp_path, nodes=4)
    run_in_process(wan + "federation.rounds=2 name=r", tmp_path, nodes=4)
    resumed, _ = run_in_process(
        wan + f"federation.rounds=3 name=r resume={tmp_path / 'r' / 'checkpoint.pt'}", tmp_path, nodes=4
    )
    a, b = (torch.load(Path(s["run_dir"]) / "model_final.pt", weights_only=True) for s in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_central_dp_with_regions_is_charged_as_flat(tmp_path: Path) -> None:
    """Clip per client, noise once: the accountant's ε is flat's (the same z, cohort and releases)."""
    dp = FAST + "federation.rounds=2 privacy=central privacy.noise_multiplier=1.0 "
    flat, _ = run_in_process(dp + "name=flat", tmp_path, nodes=4)
    tree, _ = run_in_process(dp + "topology=regions topology.regions=2 name=tree", tmp_path, nodes=4)
    assert tree["privacy"]["epsilon"] == pytest.approx(flat["privacy"]["epsilon"])
    rows = read_rows(tree["run_dir"])
    assert all("wan_bytes" not in r and "regions" not in r for r in rows)  # exact: they count the replies


def test_local_dp_under_regions_accounts_each_site_as_flat(tmp_path: Path) -> None:
    """Local DP is the sites' own: every site's ε is the one a flat run reports (same steps, same
    noise multiplier), and the regions' model is the flat model of the same DP-SGD updates."""
    dp = FAST + "federation.rounds=1 privacy=local privacy.noise_multiplier=1.0 "
    flat, _ = run_in_process(dp + "name=flat", tmp_path, nodes=4)
    tree, _ = run_in_process(
        dp + "topology=regions topology.regions=2 privacy.report_exact=true name=tree", tmp_path, nodes=4
    )  # report_exact: the regions' members are exact figures
    (f,), (t,) = read_rows(flat["run_dir"]), read_rows(tree["run_dir"])
    assert t["client_epsilon_max"] == pytest.approx(f["client_epsilon_max"]) and t["client_epsilon_max"] > 0
    assert sorted(len(r["nodes"]) for r in t["regions"].values()) == [2, 2]


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ("topology=regions topology.regions=0", "needs the regions"),
        ("topology=regions topology.regions=2 topology.assignment=[0,1]", "one way"),
        ("topology=regions topology.regions=2 strategy=fedbuff privacy=local", "FedBuff over regions"),
        ("topology=regions topology.regions=2 strategy=fedbuff ledger.contribution=loo", "FedBuff over regions"),
        ("topology=regions topology.regions=2 compression.downlink=fp16", "forwards one model"),
        ("topology=regions topology.regions=2 privacy=central topology.wan_compression=int8", "sensitivity"),
        ("topology=regions topology.regions=2 privacy=central topology.region_rule=median", "sensitivity"),
        ("topology=regions topology.regions=2 ledger.contribution=loo strategy=median", "contribution"),
        (
            "fleet=devices fleet.wan_uplink_mbps=[10] fleet.wan_downlink_mbps=[10] fleet.wan_latency_ms=[1]",
            "belong to regions",
        ),
        ("fleet=devices_wan topology.regions=2 fleet.wan_latency_ms=[]", "together"),
        ("topology=regions topology.regions=2 topology.region_rule=nope", "topology.region_rule"),
    ],
)
def test_impossible_topologies_are_refused(overrides: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(overrides)


def test_a_region_too_small_for_its_rule_is_refused_before_any_work(tmp_path: Path) -> None:
    """Krum with f = 1 needs 5 replies; three sites a region can never give them."""
    overrides = (
        FAST + "topology=regions topology.regions=2 topology.region_rule=krum topology.region_byzantine=1 name=x"
    )
    with pytest.raises(ConfigError, match=r"region 0 \(3 sites\)"):
        run_in_process(overrides, tmp_path, nodes=6)
    assert not (tmp_path / "x").exists()


def test_the_default_run_has_no_wan_columns(tmp_path: Path) -> None:
    summary, _ = run_in_process(FAST + "federation.rounds=1", tmp_path, nodes=2)
    (row,) = read_rows(summary["run_dir"])
    assert "wan_bytes" not in row and "regions" not in row
    assert json.loads(json.dumps(load_config("")[0].topology.__dict__))["name"] == "flat"
    assert region_node(0) == -1
