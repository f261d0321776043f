"""Every part of one run, built once, in one place, into one value (`Run`).

The parts depend on each other in one order, written out in `assemble`: the data and the
model; the connected nodes and who holds which partition; a checkpoint, if the run resumes,
read before anything is built from it; privacy; the strategy, given all of that in its
constructor, and its cohort check; the virtual clock. Nothing is written until then: a
refused configuration leaves no results directory. Then the results directory and the
ledger; `resume` applies the checkpoint's state. `app.run.federation` only runs the loops.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType
from flwr.serverapp import Grid
from omegaconf import DictConfig

from app.config.schema import Config, ConfigError, FleetConfig
from app.ledger.chain import Ledger
from app.ledger.nodes import NodeKeys
from app.ledger.signing import load_signing_key
from app.ledger.work import WorkChecks
from app.protocol import (
    BASE_DIGEST,
    DITTO_LAMBDA,
    LEDGER_ON,
    PROXIMAL_MU,
    RECEIPT_HASH,
    RECEIPT_REPLY,
    RECEIPT_STEP,
    ROUNDS_KEY,
    to_client_record,
)
from app.regions.deployed import deployed_regions
from app.regions.grid import RegionGrid
from app.regions.topology import has_regions, region_of_partitions, wan_links
from app.run.checkpoint import Checkpoint, load_checkpoint, restore_rng
from app.run.contributions import RoundScores
from app.run.factory import (
    StrategyParts,
    TimedUnpack,
    build_strategy,
    central_dp,
    check_cohort,
    downlink_encoder,
    example_cap,
    global_model,
    partition_sizes,
    regional_combine,
    run_privacy,
    secure_aggregation,
    uplink_decoder,
)
from app.run.memory import streams
from app.run.monitoring import Monitor
from app.run.privacy import RunPrivacy
from app.run.results import RunRecorder, new_run_dir
from app.run.work import open_work, reply_check, with_nonces, work_checks
from app.simulation.attacks import malicious_partitions
from app.simulation.fleet import describe, fleet_of, fleet_profiles, shared_wan
from app.simulation.local_grid import InProcessGrid
from app.simulation.virtual_clock import Regions, VirtualClockGrid, discover_partitions
from app.status.server import RunStatus, node_settings, run_status, server_broker
from app.task.data import (
    Examples,
    check_partitioning,
    data_spec,
    load_splits,
    materialize,
    partition_key,
    spec_to_record,
)
from app.task.metrics import Task
from app.task.models import model_key, trainable_keys
from app.task.training import Precision, evaluate, model_inputs, resolve_device, resolve_precision
from strategies.interface import ServerStrategy
from strategies.node_names import NodeNames
from strategies.partitions import PartitionBinding
from strategies.regional import RegionalCombine
from strategies.replies import MAX_WEIGHT
from strategies.settings import NodeConfig, ReplyLimits, TaskWiring

log = logging.getLogger("flwr.fedgpu." + __name__)

SIMULATION_SETTLE_S = 2.0  # Flower registers a simulation's nodes in one loop, right after the ServerApp starts


@dataclass
class Model:
    """The server's model, split into what the strategy aggregates (`trainable`) and what every
    task carries unchanged (`frozen`, None when everything trains)."""

    module: torch.nn.Module
    trainable: list[str]
    frozen: ArrayRecord | None = None

    def split(self, state: dict[str, torch.Tensor]) -> ArrayRecord:
        """The trainable tensors of `state`, keeping its other tensors as the frozen ones."""
        trainable = set(self.trainable)
        frozen = {k: v for k, v in state.items() if k not in trainable}
        self.frozen = ArrayRecord(frozen) if frozen else None
        return ArrayRecord({k: state[k] for k in self.trainable})

    def full_state(self, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
        """The whole model: the strategy's trainable tensors and the frozen ones."""
        frozen = self.frozen.to_torch_state_dict() if self.frozen is not None else {}
        return {**frozen, **arrays.to_torch_state_dict()}


@dataclass
class Run:
    """One run's parts, as `assemble` built them; the loops change `arrays`, the clock and the
    records, nothing else."""

    cfg: Config
    grid: Grid  # the virtual clock over the grid, when there is one
    device: torch.device
    precision: Precision
    task: Task  # the loss and metrics of central evaluation
    test_data: Examples
    model: Model
    arrays: ArrayRecord  # the global model's trainable tensors
    nodes: list[int]
    partitions: PartitionBinding
    names: NodeNames
    strategy: ServerStrategy
    unpack: TimedUnpack | None
    privacy: RunPrivacy
    recorder: RunRecorder
    monitor: Monitor
    client_config: ConfigRecord  # one live record: FedBuff copies it into every task
    ledger: Ledger | None = None
    status: RunStatus | None = None  # the MQTT status channel (monitoring.mqtt.host)
    node_keys: NodeKeys | None = None
    work: WorkChecks | None = None  # signed work records (ledger.work_keys): checked, then into the ledger
    scores: RoundScores | None = None
    clock: VirtualClockGrid | None = None
    fleet: dict[str, Any] | None = None  # summary.json's fleet entry
    region_of_partition: list[int] | None = None  # the sites' regions (topology.regions), when placed
    regions: RegionalCombine | None = None  # topology=regions: the strategy's two-level combine
    attacked: list[int] = field(default_factory=list)  # malicious partitions
    streams: bool = False  # training replies folded as they arrive (app/run/memory.py), else gathered
    first_round: int = 1
    elapsed_before: float = 0.0  # wall time of the runs this one resumes


def checkpoint_to_resume(cfg: Config, root: Path) -> Path | None:
    """The checkpoint `resume` names: a path, or with `auto` the named run's own checkpoint
    if it has one (so that the same command starts a run and, after a crash, continues it)."""
    if cfg.resume != "auto":
        return Path(cfg.resume) if cfg.resume else None
    path = root / str(cfg.name) / "checkpoint.pt"
    if not path.is_file():
        log.info("resume=auto: no checkpoint at %s yet; starting run %r", path, cfg.name)
        return None
    return path


def _check_compatible(ckpt: Checkpoint, model: torch.nn.Module, path: Path, rounds: int) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ckpt.state_dict.items()}
    if expected != got:
        raise ConfigError(
            f"resume={path}: the checkpoint's model does not match model={type(model).__name__} for this dataset"
        )
    if ckpt.round >= rounds:
        raise ConfigError(f"resume={path}: round {ckpt.round} already reached federation.rounds={rounds}")


def wait_for_nodes(grid: Grid, minimum: int, timeout_s: float, simulated: bool = False) -> list[int]:
    """The connected nodes once `minimum` are there; a clear error after `timeout_s`.

    A simulation's size is fixed when it starts (num-supernodes): Flower registers all of its
    nodes in one loop just after starting the ServerApp's thread, so once the count has stood
    still for SIMULATION_SETTLE_S below `minimum`, waiting cannot help and the run is refused
    at once. A deployment's nodes may still be starting: it waits, saying for how long."""
    start = time.monotonic()
    deadline, next_log = start + timeout_s, start
    seen, since = -1, start
    while len(nodes := list(grid.get_node_ids())) < minimum:
        now = time.monotonic()
        if len(nodes) != seen:
            seen, since = len(nodes), now
        if simulated and nodes and now - since >= SIMULATION_SETTLE_S:
            raise ConfigError(
                f"federation.min_available_nodes={minimum}, but this simulation has {len(nodes)} SuperNode(s): "
                f'raise num-supernodes (flwr run . --federation-config "num-supernodes={minimum}") or lower '
                "federation.min_available_nodes (and federation.min_train_nodes)"
            )
        if now >= deadline:
            raise ConfigError(
                f"federation.min_available_nodes={minimum}: only {len(nodes)} node(s) connected after "
                f"{timeout_s:.0f} s; start more SuperNodes (or num-supernodes in simulation), lower "
                "federation.min_available_nodes, or raise federation.node_wait_timeout_s"
            )
        if now >= next_log and not (simulated and nodes):
            log.info(
                "waiting up to %.0f s more (federation.node_wait_timeout_s) for nodes: %d connected, "
                "%d needed (federation.min_available_nodes)",
                deadline - now,
                len(nodes),
                minimum,
            )
            next_log = now + 10.0
        time.sleep(0.25 if simulated else 0.5)
    return nodes


def runs_simulated_nodes(grid: Grid) -> bool:
    """Whether `grid`'s nodes are simulated, each given its partition-id by the simulation
    itself: Flower's (`flwr run` on a simulation SuperLink hands the ServerApp an InMemoryGrid)
    or this process's (InProcessGrid). Anything else is a deployment. Flower's class is looked
    up only if it is loaded already: a deployed ServerApp never imports Flower's SuperLink."""
    in_memory = sys.modules.get("flwr.superlink.grid.inmemory_grid")
    return isinstance(grid, InProcessGrid) or (in_memory is not None and isinstance(grid, in_memory.InMemoryGrid))


class Receipts:
    """The ledger's receipt in every training task (ledger=on): the step and hash of the entry
    that recorded the node's previous reply, and that reply's hash as recorded (the node compares
    it with its own: docs/ledger.md#receipts).

    Made before the ledger opens: the strategy, which sends the receipts, is built and its cohort
    checked before the run creates any file, so that a refused configuration leaves nothing
    behind; `assemble` hands the opened ledger over (`ledger`) before the first task."""

    def __init__(self) -> None:
        self.ledger: Ledger | None = None

    def around(self, prior: NodeConfig | None) -> NodeConfig:
        """The per-node task config `prior` (local DP's, if any) plus the node's receipt."""

        def per_node(node: int, connected: Collection[int]) -> dict[str, Any]:
            extra = {**(prior(node, connected) if prior is not None else {}), LEDGER_ON: True}
            assert self.ledger is not None, "the ledger opens before the first task"
            if (receipt := self.ledger.receipts.get(node)) is not None:
                extra |= {RECEIPT_STEP: receipt[0], RECEIPT_HASH: receipt[1], RECEIPT_REPLY: receipt[2]}
            return extra

        return per_node


def start_clock(
    cfg: Config,
    fleet: FleetConfig,
    grid: Grid,
    nodes: list[int],
    partitions: PartitionBinding,
    labels: np.ndarray,
    asynchronous: bool,
    region_of_partition: list[int] | None = None,
) -> tuple[VirtualClockGrid, dict[str, Any]]:
    """The virtual clock over the grid (and summary.json's fleet entry): each node's partition
    (asked once), its profile, and the work each task means (its partition's training examples
    x epochs; evaluation: its validation examples). With the sites in regions and `fleet.wan_*`:
    topology=regions times each region's WAN leg (`Regions`); flat gives each site its fair share
    of its region's WAN link (`shared_wan`)."""
    if not partitions.from_claims:
        raise ConfigError(
            f"fleet={fleet.name}: fleet profiles and stragglers simulate nodes under `flwr run` simulation; "
            "this is a deployment, which runs in real time (fleet=none stragglers=none)"
        )
    held = discover_partitions(grid, nodes, cfg.federation.node_wait_timeout_s)
    for node, partition in held.items():
        if partitions.bind(node, partition) is None:
            raise ConfigError(f"fleet: node {node} claims partition {partition} of {len(nodes)}")
    profiles = fleet_profiles(fleet, len(nodes), cfg.seed)
    regions = None
    if region_of_partition is not None and (wan := wan_links(fleet, max(region_of_partition) + 1)) is not None:
        if cfg.topology.name == "regions":
            regions = Regions(region_of_partition, wan)
        else:
            sites = [region_of_partition.count(r) for r in range(len(wan))]
            profiles = [shared_wan(p, wan[r], sites[r]) for p, r in zip(profiles, region_of_partition, strict=True)]
    sizes = partition_sizes(cfg, labels, len(nodes))

    def work(partition: int, kind: str) -> float:
        train, validation = sizes(partition)
        t = cfg.train
        examples = train * t.epochs
        if t.max_steps and isinstance(t.batch_size, int):  # train.max_steps: that many steps, not epochs
            examples = t.max_steps * t.grad_accum_steps * min(t.batch_size, train)
        category = kind.split(".")[0]  # "train.secagg" trains; a SecAgg+ key or share stage does no training
        return {MessageType.TRAIN: examples, MessageType.EVALUATE: validation}.get(category, 0)

    log.info("fleet %s on a virtual clock: %s", fleet.name, describe(profiles))
    summary = {
        **asdict(fleet),
        "samples_per_s_per_partition": [p.samples_per_s for p in profiles],
        "partition_of_node": {str(node): p for node, p in sorted(held.items(), key=lambda i: i[1])},
    }
    f = cfg.federation
    needed = 1 if asynchronous else max(f.min_available_nodes, f.min_train_nodes)
    return VirtualClockGrid(grid, profiles, held, work, cfg.seed, min_nodes=needed, regions=regions), summary


def open_ledger(cfg: Config, recorder: RunRecorder, first_round: int) -> Ledger | None:
    """The run's hash chain (ledger=on), cut back to the checkpoint a resumed run starts from."""
    if cfg.ledger.name != "on":
        return None
    try:
        key = load_signing_key(cfg.ledger.signing_key) if cfg.ledger.signing_key else None
        ledger = Ledger(recorder.run_dir, key)  # a resumed run's chain must verify
    except ValueError as err:
        raise ConfigError(str(err)) from None
    ledger.truncate_after(first_round - 1)  # steps past the checkpoint are re-run
    return ledger


def contribution_scores(cfg: Config, test_data: Examples, value_on: Any) -> RoundScores | None:  # noqa: ANN401
    """Per-node contribution scores (ledger.contribution), valued on a fixed sample of the test split."""
    if cfg.ledger.contribution == "none":
        return None
    g = torch.Generator().manual_seed(cfg.seed)
    idx = torch.randperm(len(test_data), generator=g)[: cfg.ledger.validation_examples]
    held = Examples(test_data.x[idx], test_data.y[idx])
    return RoundScores(cfg.ledger, lambda state: value_on(held, state), cfg.seed)


def assemble(grid: Grid, cfg: Config, raw: DictConfig, root: Path) -> Run:
    """Build every part of the run `cfg` describes, in the order they depend on each other, and
    apply the checkpoint it resumes from (if any)."""
    device = resolve_device(cfg.server_device)
    precision = resolve_precision("off", device)
    train_source, test_source = load_splits(cfg.dataset, cfg.seed, cfg.model, cfg.task.type)
    spec = data_spec(train_source, test_source, cfg.task.type == "causal_lm")
    key = partition_key(train_source, cfg.partition)  # what partitions split by: labels, or files
    test_data = materialize(test_source)
    task = Task.from_config(cfg.task, spec)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)  # for user code (a model factory may draw from it); strategies have their own
    module = global_model(cfg, spec, model_inputs(test_data.x[:2], precision))
    model = Model(module, trainable_keys(module, cfg.model.trainable))

    simulated = runs_simulated_nodes(grid)
    # topology=regions on a deployment: the nodes are regional aggregators (app/regions/deployed.py)
    regional = deployed_regions(cfg, grid, simulated)
    f = cfg.federation
    nodes = wait_for_nodes(grid, f.min_available_nodes, f.node_wait_timeout_s, simulated)
    check_partitioning(key, len(nodes), cfg.partition)
    # Simulated nodes report their partition and the first claim binds; a deployed node's claim
    # binds nothing (strategies/partitions.py). Log lines name a simulated node by its bound
    # partition, a deployed one by its node config's name.
    partitions = PartitionBinding(len(nodes), from_claims=simulated)
    names = NodeNames(partitions.partition_of)
    log.info(
        "partition claims: %s",
        "the first binds (simulated nodes)"
        if partitions.from_claims
        else "ignored (a deployment: each node is capped at "
        + (
            "topology.region_max_examples, as a regional aggregator)"
            if cfg.topology.name == "regions"
            else "federation.max_examples_per_node)"
        ),
    )

    ckpt_path = checkpoint_to_resume(cfg, root)
    ckpt = load_checkpoint(ckpt_path) if ckpt_path else None
    if ckpt is not None:
        _check_compatible(ckpt, module, ckpt_path, f.rounds)
    arrays = model.split(ckpt.state_dict if ckpt is not None else module.state_dict())
    first_round = ckpt.round + 1 if ckpt is not None else 1

    dp = central_dp(cfg)
    dim = sum(a.numpy().size for a in arrays.values() if np.issubdtype(a.numpy().dtype, np.floating))
    largest = (
        max(partition_sizes(cfg, key, len(nodes))(i)[0] for i in range(len(nodes)))
        if simulated and cfg.secagg.name != "none"
        else None
    )
    secagg, distributed = secure_aggregation(regional.top(cfg) if regional else cfg, dim, largest)
    privacy = run_privacy(cfg, dp or distributed, partitions, _run_state(ckpt), names)
    node_config = privacy.node_config()
    receipts = Receipts() if cfg.ledger.name == "on" else None
    if receipts is not None:
        node_config = receipts.around(node_config)
    work = work_checks(cfg.ledger) if cfg.ledger.name == "on" else None  # signed work records
    broker = server_broker(cfg.monitoring.mqtt) if cfg.monitoring.mqtt.host else None  # files read now
    if work is not None:
        node_config = with_nonces(work, node_config)
    unpack = uplink_decoder(cfg.compression)
    limits = ReplyLimits(
        message_ttl_s=f.message_ttl_s,
        weight_cap=privacy.screening(regional.weight_cap if regional else example_cap(cfg, key, partitions)),
        unpack=unpack,
        check=reply_check(work) if work is not None else None,
    )
    wiring = TaskWiring(
        frozen=None if cfg.model.name == "hf" else model.frozen,  # hf: every node builds the base; its digest travels
        downlink=downlink_encoder(cfg.compression, cfg.seed),
        node_config=node_config,
        names=names,
    )
    placed = region_of_partitions(cfg.topology, len(nodes)) if simulated and has_regions(cfg.topology) else None
    regions = regional_combine(cfg, partitions.partition_of, placed, device, secagg) if placed is not None else None
    by_region = regions is not None and cfg.strategy.name == "fedbuff"  # FedBuff with regions as its nodes
    if by_region:  # a region's reply weighs its sites' capped weights, each capped already
        site_cap = limits.weight_cap
        limits = replace(limits, weight_cap=lambda n, m, k: MAX_WEIGHT if n < 0 else site_cap(n, m, k))
    strategy = build_strategy(cfg, StrategyParts(device, dp, limits, wiring, secagg, distributed, regions))
    check_cohort(cfg, strategy, max(placed) + 1 if by_region and placed else len(nodes))
    streamed = streams(cfg, strategy, len(nodes), sum(len(a.data) for a in arrays.values()))
    if strategy.asynchronous:  # FedBuff folds its mean buffer itself (`FedBuff.streamed`)
        strategy.streamed = streamed and strategy.streams
    clock, fleet_summary = None, None
    if (fleet := fleet_of(cfg.fleet, cfg.stragglers)) is not None:
        clock, fleet_summary = start_clock(cfg, fleet, grid, nodes, partitions, key, strategy.asynchronous, placed)
    served: Grid = clock if clock is not None else grid
    if by_region and placed is not None and regions is not None:
        held = clock.partitions if clock is not None else discover_partitions(grid, nodes, f.node_wait_timeout_s)
        served = RegionGrid(served, lambda n: placed[held[n]] if n in held else None, regions, limits, names)

    # Nothing above wrote a file: a refused configuration leaves no results directory behind.
    if ckpt is not None and ckpt_path is not None:
        recorder = RunRecorder(ckpt_path.parent, resumed_after=ckpt.round, primary=task.primary)
    else:
        run_dir = new_run_dir(root, cfg.name, cfg.strategy.name, cfg.dataset.name, reuse=cfg.resume == "auto")
        recorder = RunRecorder(run_dir, primary=task.primary)
    recorder.save_config(raw)
    ledger = open_ledger(cfg, recorder, first_round)
    if receipts is not None:
        receipts.ledger = ledger
    if work is not None and ledger is not None:
        open_work(work, ledger, cfg.ledger, recorder.run_dir)

    run = Run(
        cfg=cfg,
        grid=served,
        device=device,
        precision=precision,
        task=task,
        test_data=test_data,
        model=model,
        arrays=arrays,
        nodes=nodes,
        partitions=partitions,
        names=names,
        strategy=strategy,
        unpack=unpack,
        privacy=privacy,
        recorder=recorder,
        monitor=Monitor(task.names, cfg.monitoring.max_node_labels),
        client_config=ConfigRecord(
            {
                **to_client_record(cfg),
                **spec_to_record(spec),
                ROUNDS_KEY: f.rounds,  # local DP plans over all rounds
                **({PROXIMAL_MU: cfg.strategy.proximal_mu} if cfg.strategy.proximal_mu > 0 else {}),  # FedProx
                **({DITTO_LAMBDA: cfg.strategy.ditto_lambda} if cfg.strategy.name == "ditto" else {}),  # Ditto
                **pinned_base(cfg, model),
                **(regional.task_config if regional else {}),  # the regions' sub-run overrides
                **node_settings(cfg.monitoring.mqtt, recorder.run_dir.name),  # the status channel's broker
            }
        ),
        ledger=ledger,
        node_keys=NodeKeys(grid.get_nodes) if ledger is not None else None,
        work=work,
        status=run_status(cfg, broker, recorder.run_dir.name, strategy.unit, task.primary),
        first_round=first_round,
        streams=streamed,
        clock=clock,
        fleet=fleet_summary,
        region_of_partition=placed,
        regions=regions,
    )
    run.scores = contribution_scores(cfg, test_data, lambda data, state: value_on(run, data, state))
    if cfg.attack.name != "none":
        run.attacked = malicious_partitions(cfg.seed, len(nodes), cfg.attack.num_malicious)
    if ckpt is not None:
        resume(run, ckpt, ckpt_path)
    log.info("results: %s", recorder.run_dir)
    strategy.summary()
    log.info(
        "%d nodes, %d train / %d test examples, model %s (%d parameters, %d trained), %s %d..%d",
        len(nodes),
        len(train_source.labels),
        len(test_data),
        model_key(cfg.model),
        sum(p.numel() for p in module.parameters()),
        sum(p.numel() for n, p in module.named_parameters() if n in model.trainable),
        f"{strategy.unit}s",
        first_round,
        f.rounds,
    )
    if run.attacked:
        log.info("attack %s: malicious partitions %s (scale %s)", cfg.attack.name, run.attacked, cfg.attack.scale)
    if dp is not None and dp.delta >= 1 / len(nodes):
        log.warning(
            "privacy.delta=%g >= 1/population = 1/%d: a mechanism that leaks one whole client with "
            "probability delta would satisfy this guarantee; use delta well below %.2g",
            dp.delta,
            len(nodes),
            1 / len(nodes),
        )
    return run


def pinned_base(cfg: Config, model: Model) -> dict[str, str]:
    """model=hf: the digest of the frozen base the nodes must hold (they build it; it never travels)."""
    if cfg.model.name != "hf" or model.frozen is None:
        return {}
    from app.task.hf import base_digest

    digest = base_digest(model.frozen.to_torch_state_dict())
    log.info("model=hf: the base stays on the nodes; each checks its own against digest %s", digest)
    return {BASE_DIGEST: digest}


def resume(run: Run, ckpt: Checkpoint, path: Path) -> None:
    """Apply a checkpoint's state to a run assembled from it: the strategy's state, its sampler,
    the rounds and wall time done, and the virtual clock's time (tasks out at the crash are lost)."""
    try:
        run.strategy.load_state_dict(ckpt.strategy_state)
    except ValueError as err:  # a strategy's state it cannot take: name the file beside the value
        raise ValueError(f"resume={path}: {err}") from err
    restore_rng(ckpt.rng, run.strategy.sampler)
    run.elapsed_before = ckpt.wall_time_s
    if run.clock is not None and run.recorder.rows:
        run.clock.now = float(run.recorder.rows[-1].get("sim_time_s") or 0.0)
    log.info("resuming %s after round %d", path, ckpt.round)


def value_on(run: Run, data: Examples, state: dict[str, torch.Tensor]) -> float:
    """What the trainable tensors `state` (with the frozen ones) are worth on `data`: minus the
    loss, or the primary metric (`ledger.contribution_value`); higher is better either way."""
    frozen = run.model.frozen.to_torch_state_dict() if run.model.frozen is not None else {}
    run.model.module.load_state_dict({**frozen, **state})
    loss, metrics = evaluate(run.model.module.to(run.device), data, run.precision, run.task)
    return -loss if run.cfg.ledger.contribution_value == "loss" else metrics[run.task.primary]


def _run_state(ckpt: Checkpoint | None) -> dict[str, Any]:
    """The run's own checkpointed state (local DP's histories), in today's layout."""
    if ckpt is None:
        return {}
    if "local_dp_history" in ckpt.run_state:  # a checkpoint from before HistoryBook: histories only
        return {"local_dp": {"histories": ckpt.run_state["local_dp_history"]}}
    return ckpt.run_state
