"""The pieces of a two-level deployment that need no Flower processes (the whole stack is
tests/test_regions_deployment.py): how a region's sub-run overrides are composed, what an
aggregator takes from its sub-run's results and replies, what the global server refuses and how
it caps an aggregator, the ClientApp on an aggregator node, `local_deployment.py`'s two-level
arguments and stacks, and docker/compose.regions.yaml."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common.config import parse_config_args
from flwr.supercore.run import Run

from app import protocol
from app.client_app import app as client_app
from app.config.compose import load_config
from app.config.schema import ConfigError
from app.regions.aggregator import RegionFailed, RegionNode, merge_overrides, quoted, read_result, reply_of
from app.regions.deployed import deployed_regions, region_run_overrides
from app.task.data import DataSpec
from app.task.models import build_model
from tests.helpers import load_script
from tests.test_docker import DOCKER, _argv, _assert_mounted_read_only, _compose, _flags, _mounts

REGIONS = "topology=regions topology.regions=2"
REGION_ENV = {
    "REGION_CREDS_DIR": "/srv/region-a/creds",
    "GLOBAL_SUPERLINK": "superlink.example.org:9092",
    "GLOBAL_CA_CERT": "/srv/region-a/global/ca.crt",
    "AGGREGATOR_KEY": "/srv/region-a/global/region-a",
    "REGION_NAME": "region-a",
}


# ----------------------------------------------------------------------------- overrides


def test_a_later_layer_wins_key_by_key_and_a_group_choice_drops_the_earlier_groups_keys() -> None:
    merged = merge_overrides(
        "strategy=krum strategy.num_byzantine=2 train.lr=0.1 name=exp1 dataset.path='/a b/c'",
        "train.lr=0.05 federation.min_train_nodes=1",
        "strategy=fedavg name=sub",
    )
    assert merged == "dataset.path='/a b/c' train.lr=0.05 federation.min_train_nodes=1 strategy=fedavg name=sub"


def test_a_regions_sub_run_takes_the_global_settings_with_its_own_rule_and_one_round(tmp_path: Path) -> None:
    overrides = (
        "topology=regions topology.regions=2 topology.region_rule=median topology.region_byzantine=1 strategy=krum "
        + ("strategy.num_byzantine=2 federation.rounds=7 train.epochs=2 name=exp1 resume=auto")
    )
    cfg, _ = load_config(overrides)
    sub = region_run_overrides(cfg, overrides)
    assert sub == "train.epochs=2 name=exp1 resume=auto strategy=median strategy.num_byzantine=1 topology=flat " + (
        "federation.rounds=1"
    )
    init = tmp_path / "global=model,1.pt"  # quoted: '=' and ',' mean something to Hydra
    torch.save(build_model(cfg.model, DataSpec((1, 8, 8), 10)).state_dict(), init)
    own = f"model.init_weights={quoted(str(init))} name=region-0-run1-round1-ab resume=null"
    typed, _ = load_config(merge_overrides(sub, "federation.min_train_nodes=1", own))  # what the sub-run composes
    assert (typed.strategy.name, typed.strategy.num_byzantine, typed.topology.name) == ("median", 1, "flat")
    assert (typed.federation.rounds, typed.federation.min_train_nodes, typed.train.epochs) == (1, 1, 2)
    assert (typed.name, typed.resume, typed.model.init_weights) == ("region-0-run1-round1-ab", None, str(init))
    with pytest.raises(RegionFailed, match="whitespace"):
        quoted(str(tmp_path / "a b.pt"))
    mean = region_run_overrides(load_config(REGIONS)[0], REGIONS)
    assert mean == "strategy=fedavg topology=flat federation.rounds=1"  # fedavg has no num_byzantine


class _DeployedGrid:
    """What `deployed_regions` reads of a deployed grid: Flower's record of the run (`grid.run`)."""

    def __init__(self, overrides: str) -> None:
        self.run = replace(Run.create_empty(7), override_config={"overrides": overrides})


def test_the_global_server_sends_the_sub_run_overrides_and_caps_an_aggregator_at_the_region_cap() -> None:
    overrides = (
        "topology=regions topology.regions=2 topology.region_max_examples=5000 federation.max_examples_per_node=100"
    )
    cfg, _ = load_config(overrides)
    grid = _DeployedGrid(overrides)
    assert deployed_regions(cfg, grid, simulated=True) is None  # simulation: the server combines the regions
    assert deployed_regions(load_config("")[0], grid, simulated=False) is None  # flat
    regional = deployed_regions(cfg, grid, simulated=False)
    assert regional.task_config == {protocol.REGION_RUN_OVERRIDES: region_run_overrides(cfg, overrides)}
    assert "federation.max_examples_per_node=100" in regional.task_config[protocol.REGION_RUN_OVERRIDES]
    assert regional.weight_cap(1, MetricRecord({}), MessageType.TRAIN) == 5000  # not the sites' 100
    default = deployed_regions(load_config(REGIONS)[0], _DeployedGrid(REGIONS), False)
    assert default.weight_cap(1, MetricRecord({}), MessageType.TRAIN) == 100_000  # federation.max_examples_per_node


def test_secagg_runs_inside_each_regions_sub_run_whose_row_gives_the_aggregator_its_weight(tmp_path: Path) -> None:
    """secagg=plus on a two-level deployment: the sub-runs' overrides carry it (each aggregator
    learns its sites' sums only), the global server's own strategy is plain FedAvg over the
    aggregators. The sub-run an aggregator starts (in process here, three sites): its row's
    train["num-examples"] is the sites' summed capped examples (each quantized to a ring step),
    which the aggregator replies with as its region's weight."""
    from app.run.factory import partition_sizes
    from app.task.data import load_splits
    from app.tools.in_process import run_in_process

    overrides = REGIONS + " secagg=plus"
    cfg, _ = load_config(overrides)
    regional = deployed_regions(cfg, _DeployedGrid(overrides), simulated=False)
    sub = regional.task_config[protocol.REGION_RUN_OVERRIDES]
    assert "secagg=plus" in sub and "topology=flat" in sub and "federation.rounds=1" in sub
    assert regional.top(cfg).secagg.name == "none"
    summary, _ = run_in_process(merge_overrides(sub, "train.epochs=1 ledger=off name=sub"), tmp_path, nodes=3)
    result = read_result(Path(summary["run_dir"]))
    train, _ = load_splits(cfg.dataset, cfg.seed)
    size = partition_sizes(cfg, train.labels, 3)
    assert result.weight == pytest.approx(sum(size(p)[0] for p in range(3)), abs=0.01)
    assert result.row["secagg"]["survivors"] and "weight" not in json.dumps(result.row["secagg"])


def test_what_a_two_level_deployment_cannot_run_is_refused_all_at_once_before_any_work() -> None:
    cfg, _ = load_config(
        "topology=regions topology.regions=2 privacy=central privacy.noise_multiplier=1 compression=int8 federation.fraction_evaluate=0.5"
    )
    with pytest.raises(ConfigError) as err:
        deployed_regions(replace(cfg, topology=replace(cfg.topology, region_max_examples=-1)), None, simulated=False)
    text = str(err.value)
    assert text.startswith("4 problems:"), text
    for key in ("topology.region_max_examples=-1", "privacy=central", "compression=int8", "fraction_evaluate=0.5"):
        assert key in text, text


# ----------------------------------------------------------------------------- the aggregator


def _sub_run(tmp_path: Path, status: str = "completed", updated: bool = True, train: dict | None = None) -> Path:
    """A sub-run's results directory as the ServerApp leaves it (app/run/results.py)."""
    run_dir = tmp_path / "region-0-run1-round1-ab"
    run_dir.mkdir()
    torch.save(
        {"fc.weight": torch.full((2, 3), 0.5), "fc.bias": torch.zeros(2), "frozen": torch.ones(1)},
        run_dir / "model_final.pt",
    )
    row = {
        "round": 1, "num_sampled": 2, "num_clients": 1, "model_updated": updated, "rejected": [],
        "train": {"num-examples": 600.0, "train-loss": 0.7, "samples-per-s": 50.0} if train is None else train,
    }  # fmt: skip
    (run_dir / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"status": status, "stop_reason": "rounds"}))
    return run_dir


def test_the_reply_is_the_sub_runs_model_on_the_keys_sent_and_the_regions_summed_weight(tmp_path: Path) -> None:
    sent = {"fc.weight": torch.zeros(2, 3, dtype=torch.float16), "fc.bias": torch.zeros(2)}
    arrays, metrics = reply_of(read_result(_sub_run(tmp_path)), sent)
    state = arrays.to_torch_state_dict()
    assert list(state) == ["fc.weight", "fc.bias"]  # the frozen tensor stays out, as on a site
    assert state["fc.weight"].dtype == torch.float16 and torch.all(state["fc.weight"] == 0.5)
    assert metrics == {
        protocol.NUM_EXAMPLES: 600.0, protocol.TRAIN_LOSS: 0.7, protocol.SAMPLES_PER_S: 50.0,
        protocol.REGION_SAMPLED: 2, protocol.REGION_NODES: 1,
    }  # fmt: skip
    assert all(protocol.is_reply_metric(k) for k in metrics)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"status": "stopped"}, "ended 'stopped'"),
        ({"updated": False}, "left the model unchanged"),
        ({"train": {}}, "records no train['num-examples']"),
    ],
)
def test_a_sub_run_without_an_update_fails_the_regions_task(tmp_path: Path, kwargs: dict, why: str) -> None:
    with pytest.raises(RegionFailed, match=re.escape(why)):
        read_result(_sub_run(tmp_path, **kwargs))


def _aggregator_task(record: dict, node_config: dict) -> None:
    arrays = ArrayRecord({"w": torch.zeros(2)})
    ins = Message(
        RecordDict({protocol.ARRAYS: arrays, protocol.CONFIG: ConfigRecord(record)}),
        dst_node_id=5,
        message_type=MessageType.TRAIN,
    )
    ins.metadata.__dict__["_message_id"] = "aggregator-task"
    context = Context(run_id=1, node_id=5, node_config=node_config, state=RecordDict(), run_config={})
    client_app(ins, context)


def test_an_aggregator_node_refuses_a_global_run_that_is_not_two_level(tmp_path: Path) -> None:
    """The real ClientApp on a node configured as an aggregator (in process: the exception Flower
    turns into the error reply): a task without the sub-run's overrides (the global run is flat)
    says what to do; a node config that misses a key names it."""
    (tmp_path / "config.toml").write_text("")
    node = {
        protocol.REGION_SUPERLINK: "local", protocol.REGION_FLWR_HOME: str(tmp_path),
        protocol.REGION_OUTPUT_DIR: str(tmp_path / "runs"),
    }  # fmt: skip
    with pytest.raises(RegionFailed, match="submit it with topology=regions"):
        _aggregator_task({protocol.SERVER_ROUND: 1}, node)
    with pytest.raises(RegionFailed, match="needs region-flwr-home, region-output-dir"):
        _aggregator_task({protocol.REGION_RUN_OVERRIDES: ""}, {protocol.REGION_SUPERLINK: "local"})
    with pytest.raises(RegionFailed, match="must be a number of seconds"):
        RegionNode.of(Context(1, 5, {**node, protocol.REGION_TIMEOUT_S: "soon"}, RecordDict(), {}))


# ----------------------------------------------------------------------------- local_deployment.py


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--regions", "2"], "--regions and --nodes-per-region go together"),
        (["--nodes-per-region", "2"], "--regions and --nodes-per-region go together"),
        (["--regions", "2", "--nodes-per-region", "2", "--nodes", "4"], "--nodes and --edge are for a one-level"),
        (["--regions", "0", "--nodes-per-region", "2"], "must be at least 1"),
        (["--region-overrides", "federation.min_train_nodes=1"], "--region-overrides needs --regions"),
    ],
)
def test_bad_two_level_arguments_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], why: str
) -> None:
    script = load_script("local_deployment")
    with pytest.raises(SystemExit) as exit_:
        script.main(["up", "--state-dir", str(tmp_path / "state"), *args])
    assert exit_.value.code == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


def test_two_levels_are_separate_stacks_and_the_aggregators_point_at_their_regions(tmp_path: Path) -> None:
    script = load_script("local_deployment")
    data = [tmp_path / f"partition-{i}.npz" for i in range(6)]
    fed = script.TwoLevel.create(tmp_path / "state", 3, 2, True, data, None, "federation.min_train_nodes=1")
    assert [r.root for r in fed.regions] == [tmp_path / "state" / f"region-{r}" for r in range(3)]
    assert fed.top.num_nodes == fed.top.regions == 3 and all(r.num_nodes == 2 for r in fed.regions)
    assert [r.data_paths for r in fed.regions] == [data[0:2], data[2:4], data[4:6]]
    site = parse_config_args([fed.regions[1].node_config(1)])
    assert site == {"name": "region-1-site-1", "data-path": str(data[3])}
    aggregator = parse_config_args([fed.top.node_config(2)])  # Flower's own parser, as the SuperNode's
    assert aggregator == {
        "name": "region-2",
        protocol.REGION_SUPERLINK: script.CONNECTION,
        protocol.REGION_FLWR_HOME: str(tmp_path / "state" / "region-2" / "cli"),
        protocol.REGION_OUTPUT_DIR: str(tmp_path / "state" / "region-2" / "runs"),
        protocol.REGION_OVERRIDES: "federation.min_train_nodes=1",
    }
    assert len({fed.top.port, *(r.port for r in fed.regions)}) == 4


# ----------------------------------------------------------------------------- docker/compose.regions.yaml


def _region_model(tmp_path: Path, env: dict[str, str] = REGION_ENV) -> dict:
    proc = _compose(["compose.regions.yaml"], env, tmp_path, "config", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["services"]


def test_the_region_compose_file_is_a_secure_regional_stack_with_a_global_aggregator(tmp_path: Path) -> None:
    services = _region_model(tmp_path)
    assert set(services) == {"volumes-init", "superlink", "edge", "serverapp", "region-cli", "aggregator"}
    for name, service in services.items():
        assert not any("--insecure" in part for part in _argv(service)), name
    link = _flags(_argv(services["superlink"]))
    assert link["isolation"] == "process" and "enable-supernode-auth" in link
    region_ca = _assert_mounted_read_only(services["superlink"], link["ssl-ca-certfile"], "regional CA")["source"]
    assert region_ca == "/srv/region-a/creds/ca.crt"
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert set(published) == {"edge", "superlink"} and published["superlink"][0]["host_ip"] == "127.0.0.1"
    # the aggregator: the global level's CA and key, the region's connection and results
    aggregator = services["aggregator"]
    flags = _flags(_argv(aggregator))
    assert _argv(aggregator)[0] == "flower-supernode" and flags["superlink"] == REGION_ENV["GLOBAL_SUPERLINK"]
    ca = _assert_mounted_read_only(aggregator, flags["root-certificates"], "global CA")
    key = _assert_mounted_read_only(aggregator, flags["auth-supernode-private-key"], "aggregator key")
    assert (ca["source"], key["source"]) == (REGION_ENV["GLOBAL_CA_CERT"], REGION_ENV["AGGREGATOR_KEY"])
    config = parse_config_args([flags["node-config"]])
    assert config[protocol.REGION_SUPERLINK] == "region" and config["name"] == "region-a"
    cli = _flags(_argv(services["region-cli"]))
    assert (cli["name"], cli["address"], cli["flwr-home"]) == ("region", "superlink:9092", config["region-flwr-home"])
    region_cli_ca = _assert_mounted_read_only(services["region-cli"], cli["root-certificates"], "region CA")
    assert region_cli_ca["source"] == region_ca  # the aggregator reaches its region with the region's CA
    runs = config[protocol.REGION_OUTPUT_DIR]
    assert _mounts(aggregator)[runs]["source"] == _mounts(services["serverapp"])[runs]["source"] == "region-runs"
    assert Path(_mounts(services["edge"])["/etc/nginx/templates/fleet-edge.conf.template"]["source"]) == (
        DOCKER / "server" / "fleet-edge.conf.template"
    )


@pytest.mark.parametrize("variable", sorted(REGION_ENV))
def test_the_region_compose_file_names_a_missing_setting(tmp_path: Path, variable: str) -> None:
    env = {k: v for k, v in REGION_ENV.items() if k != variable}
    proc = _compose(["compose.regions.yaml"], env, tmp_path, "config", "-q")
    assert proc.returncode != 0 and f"required variable {variable} is missing a value" in proc.stderr, proc.stderr
