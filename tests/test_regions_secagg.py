"""SecAgg+ inside each region (secagg=plus topology=regions; app/secagg/strategy.py `_regional`):
each region's sites run their own SecAgg+ round, so its aggregator learns only the region's sums;
the regions' models then combine as any regions' do. The two-level model is flat FedAvg's within
the quantization error, no reply is ever in the clear, a region whose round aborts sends nothing
while the others go on, and on a virtual clock the regions' rounds run side by side."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.config.compose import load_config
from app.config.schema import ConfigError
from app.protocol import SECAGG, SECAGG_KEYS, SECAGG_MASKED, SECAGG_TRAIN
from app.run.factory import partition_sizes
from app.run.results import read_rows
from app.secagg.strategy import SecureAbort
from app.task.data import load_splits
from app.tools.in_process import run_in_process
from strategies.regional import RegionalCombine
from strategies.tensor_ops import record_to_tensors
from tests.test_fleet import _fleet, _train_size
from tests.test_secagg import RING, Nodes, Seen, _fedavg, _models, _round

N = 6  # nodes 1000..1005; node 1000 + i in region i // 2


def _regions(wan: object = None) -> RegionalCombine:
    return RegionalCombine(lambda node: (node - 1000) // 2, 3, wan=wan)


def test_two_level_secure_fedavg_is_flat_fedavg_within_the_quantization_error() -> None:
    """Three regions of two sites, unequal weights: global + sum over regions of (region's sum) /
    sum of weights is flat FedAvg; each node's rounding error below one step of its weighted
    coordinate, as flat SecAgg+. Every reply the server receives is one masked vector, and each
    node's SecAgg+ neighbours are its own region's sites only."""
    base, models = _models(N, seed=7)
    examples = [10, 25, 40, 5, 60, 30]
    nodes, seen = Nodes(models, examples), Seen()
    strategy, new, metrics, outcome, grid = _round(nodes, base, N, seen=seen, regions=_regions())
    assert outcome.aborted is None and outcome.survivors == list(range(1000, 1006))
    want = _fedavg(models, examples)
    bound = N * RING.step / (sum(examples) / 1000.0)
    for k, v in record_to_tensors(new).items():
        assert torch.allclose(v.double(), want[k], atol=bound, rtol=0), k
    loss = sum((0.5 + i) * e for i, e in enumerate(examples)) / sum(examples)
    assert metrics["train-loss"] == pytest.approx(loss, abs=64 * N * RING.step * 1000 / sum(examples))
    assert all(list(arrays.get("arrays", {SECAGG_MASKED: 0})) == [SECAGG_MASKED] for _, arrays, _ in seen.replies)
    assert sum(1 for _, arrays, _ in seen.replies if arrays) == N
    for msg in grid.pushed:
        if msg.metadata.message_type == SECAGG_KEYS:
            node = msg.metadata.dst_node_id
            assert list(msg.content[SECAGG]["neighbours"]) == [node ^ 1], "a neighbour outside the region"
    assert sorted(outcome.group_digests) == ["0", "1", "2"] and sorted(strategy.sum_digest) == ["0", "1", "2"]
    # each region's weight: its sites' examples, each quantized to a step of the ring (x max_weight)
    assert [o.weight for o in strategy.regions.last] == pytest.approx([35, 45, 90], abs=2 * RING.step * 1000)


def test_a_region_whose_round_aborts_sends_nothing_and_the_others_go_on() -> None:
    """Region 1's second site crashes before its masked input: one of two is fewer than t = 2, so
    region 1 unmasks nothing; the round's model is the other regions' FedAvg, both of region 1's
    sites are named with the reason. With every region aborting, secagg.on_too_few=stop stops."""
    base, models = _models(N, seed=8)
    examples = [10, 20, 30, 40, 50, 60]
    nodes = Nodes(models, examples)
    nodes.fail = {(1003, SECAGG_TRAIN)}
    strategy, new, _, outcome, _ = _round(nodes, base, N, regions=_regions())
    assert outcome.aborted is None and outcome.survivors == [1000, 1001, 1004, 1005]
    assert "region 1's secure round aborted" in outcome.dropped[1002] and 1003 in outcome.dropped
    assert {r.node_id for r in strategy.train_report.rejected} == {1002, 1003}
    keep = [0, 1, 4, 5]
    want = _fedavg([models[i] for i in keep], [examples[i] for i in keep])
    for k, v in record_to_tensors(new).items():
        assert torch.allclose(v.double(), want[k], atol=1e-4)
    assert [o.sent for o in strategy.regions.last] == [True, False, True]

    nodes.fail = {(1000 + i, SECAGG_TRAIN) for i in (0, 3, 5)}
    strategy, new, _, outcome, _ = _round(nodes, base, N, regions=_regions())
    assert new is None and outcome.aborted.count("fewer than the threshold") == 3
    assert strategy.train_report.policy.startswith("aborted")
    with pytest.raises(SecureAbort, match="every region"):
        _round(nodes, base, N, regions=_regions(), on_too_few="stop")


def test_secure_regions_through_the_real_clientapp_on_the_virtual_clock(tmp_path: Path) -> None:
    """The real ClientApp and ServerApp loop: four sites in two regions, regions' WAN links as in
    tests/test_regions.py's clock test, instant links inside a region. The regions' SecAgg+ rounds
    run side by side, their key, share and unmask stages inside the region (no WAN leg, no
    compute): the round ends at max over regions of (WAN latency + the model down + the slowest
    site + WAN latency + the region's model up), not at their sum. The row has
    one masked-sum hash per region and the WAN bytes of one model down and one up per region; the
    model is the same federation's in the clear, to the ring's rounding."""
    wan = "fleet.wan_downlink_mbps=[8,16] fleet.wan_uplink_mbps=[8,4] fleet.wan_latency_ms=[500,100]"
    cfg, _ = load_config("")
    train, _ = load_splits(cfg.dataset, cfg.seed)
    size = partition_sizes(cfg, train.labels, 4)
    compute = [size(p)[0] / _train_size() * f for p, f in enumerate([1, 2, 1, 3])]
    overrides = f"federation.rounds=2 ledger=off {wan} secagg=plus topology=regions topology.assignment=[0,0,1,1]"
    summary, _ = run_in_process(_fleet("[1,2,1,3]", overrides + " name=secure"), tmp_path, nodes=4)
    assert summary["status"] == "completed"
    rows = read_rows(summary["run_dir"])
    model = torch.load(Path(summary["run_dir"]) / "model_final.pt", weights_only=True)
    up = sum(t.numel() * t.element_size() for t in model.values())
    first = rows[0]
    assert first["secagg"]["aborted"] is None and sorted(first["secagg"]["masked_sum_sha256"]) == ["0", "1"]
    assert {k: len(r["nodes"]) for k, r in first["regions"].items()} == {"0": 2, "1": 2}
    assert all(r["wan_bytes_up"] == up for r in first["regions"].values())
    d = first["wan_bytes"] / 2 - up  # the largest task's bytes, per region: the model and its shares
    expected = max(0.5 + d / 1e6 + max(compute[:2]) + 0.5 + up / 1e6, 0.1 + d / 2e6 + max(compute[2:]) + 0.1 + up / 5e5)
    assert first["sim_time_s"] == pytest.approx(expected, rel=1e-3)
    # the same federation in the clear: the same accuracy, the model within the ring's rounding
    plain, _ = run_in_process(
        _fleet("[1,2,1,3]", overrides.replace("secagg=plus", "") + " name=plain"), tmp_path, nodes=4
    )
    clear = torch.load(Path(plain["run_dir"]) / "model_final.pt", weights_only=True)
    # (a ring step is 4e-6; a second round's training from the two models grows it: 6e-5 measured)
    assert max(float((model[k].double() - clear[k].double()).abs().max()) for k in model) < 1e-3
    assert rows[-1]["accuracy"] == pytest.approx(read_rows(plain["run_dir"])[-1]["accuracy"], abs=0.01)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ("secagg=plus topology=regions topology.regions=2 topology.region_rule=median", "region_rule=mean"),
        ("secagg=plus topology=regions topology.regions=2 privacy=distributed", "share of the noise"),
    ],
)
def test_what_secure_regions_cannot_do_is_refused(overrides: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(overrides)


def test_a_region_of_one_site_is_refused_before_any_work(tmp_path: Path) -> None:
    """One site's update would be its region's sum: its aggregator would see it in the clear."""
    overrides = "secagg=plus topology=regions topology.assignment=[0,0,1] federation.rounds=1 name=x"
    with pytest.raises(ConfigError, match=r"region 1 \(1 sites\)"):
        run_in_process(overrides, tmp_path, nodes=3)
    assert not (tmp_path / "x").exists()
