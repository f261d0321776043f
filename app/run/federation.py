"""The run behind the ServerApp: set-up, the synchronous round loop or FedBuff's
asynchronous one, results, checkpoints and stopping rules.

Flower's `Strategy.start` cannot resume from a round, write a checkpoint between
rounds or stop at a target accuracy, so the loops live here; the synchronous one
drives any strategy through the same configure/aggregate calls, the asynchronous one
hands FedBuff a callback for every server update.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from omegaconf import DictConfig

from app.config.schema import Config, ConfigError, FleetConfig
from app.ledger.chain import Ledger, model_digest
from app.ledger.nodes import NodeKeys
from app.ledger.signing import load_signing_key
from app.protocol import LEDGER_ON, RECEIPT_HASH, RECEIPT_REPLY, RECEIPT_STEP, ROUNDS_KEY, to_client_record
from app.run.checkpoint import Checkpoint, capture_rng, load_checkpoint, restore_rng, save_checkpoint
from app.run.contributions import RoundScores
from app.run.factory import (
    build_strategy,
    check_cohort,
    downlink_encoder,
    example_cap,
    global_model,
    partition_sizes,
    run_privacy,
    uplink_decoder,
)
from app.run.ledger_entries import attach_scores, round_nodes, version_nodes
from app.run.monitoring import Monitor
from app.run.results import RunRecorder, new_run_dir, read_summary
from app.run.rows import check_columns, reply_metrics, reported, round_row, traffic, version_row
from app.simulation.attacks import malicious_partitions
from app.simulation.fleet import describe, fleet_of, fleet_profiles
from app.simulation.local_grid import InProcessGrid
from app.simulation.virtual_clock import VirtualClockGrid, discover_partitions
from app.task.data import Examples, check_partitioning, data_spec, load_splits, materialize, spec_to_record
from app.task.metrics import Task
from app.task.models import model_key, trainable_keys
from app.task.training import evaluate, model_inputs, resolve_device, resolve_precision
from strategies.central_dp import PrivacyBudgetExhausted
from strategies.fedbuff import VersionReport
from strategies.node_names import NodeNames, labels
from strategies.node_wait import TooFewNodes
from strategies.partitions import PartitionBinding
from strategies.replies import payload_bytes
from strategies.tensor_ops import record_to_tensors

log = logging.getLogger("flwr.fedgpu." + __name__)

NodeConfig = Callable[[int, Collection[int]], dict[str, Any]]  # as the strategies' node_config


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


def _check_compatible(ckpt: Checkpoint, model: torch.nn.Module, path: str) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ckpt.state_dict.items()}
    if expected != got:
        raise ConfigError(
            f"resume={path}: the checkpoint's model does not match model={type(model).__name__} for this dataset"
        )


def send_and_receive(
    grid: Grid, messages: Iterable[Message], timeout: float | None, max_poll_s: float = 0.2
) -> list[Message]:
    """Push `messages` and pull their replies until all are in or `timeout` passes; the
    replies in the order their messages were sent.

    Flower's own `Grid.send_and_receive` under `flwr run` (HttpGrid) polls every 3 s: a round
    whose replies arrive after 0.9 s ends at 3 s, which at small tasks was most of a round
    (docs/benchmarks.md, "Simulation at scale"). Here the poll interval starts at 10 ms and
    doubles up to `max_poll_s`, so a round ends within a few polls of its last reply while a
    long round costs the SuperLink a handful of requests a second.
    """
    order = {mid: i for i, mid in enumerate(grid.push_messages(messages))}
    pending = dict(order)
    deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[Message] = []
    interval = 0.01
    while pending:
        got = list(grid.pull_messages(list(pending)))
        replies += got
        for reply in got:
            pending.pop(reply.metadata.reply_to_message_id, None)
        if not pending or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))
        interval = min(2 * interval, max_poll_s)
    # In the order sent, not the order of arrival: the aggregate's floating-point sum, and so
    # the run, is then the same however the replies were timed.
    return sorted(replies, key=lambda m: order.get(m.metadata.reply_to_message_id, len(order)))


SIMULATION_SETTLE_S = 2.0  # Flower registers a simulation's nodes in one loop, right after the ServerApp starts


def _wait_for_nodes(grid: Grid, minimum: int, timeout_s: float, simulated: bool = False) -> list[int]:
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


class FederatedRun:
    """One run: the global model, its strategy, central evaluation, results and checkpoints."""

    def __init__(self, grid: Grid, cfg: Config, raw: DictConfig, root: Path) -> None:
        self.started = time.time()
        self.grid, self.cfg = grid, cfg
        self.device = resolve_device(cfg.server_device)
        self.precision = resolve_precision("off", self.device)
        train_source, test_source = load_splits(cfg.dataset, cfg.seed)
        spec = data_spec(train_source, test_source)
        self.test_data = materialize(test_source)
        self.task = Task.from_config(cfg.task, spec)  # the loss and metrics of central evaluation

        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)  # for user code (a model factory may draw from it); strategies have their own
        self.model = global_model(cfg, spec, model_inputs(self.test_data.x[:2], self.precision))
        # The strategy aggregates the trainable tensors only (`self.arrays`); the frozen ones
        # travel with every task (`strategy.frozen`) and are never aggregated.
        self.trainable = trainable_keys(self.model, cfg.model.trainable)
        self.arrays, self.frozen = self.split(self.model.state_dict())
        self.strategy = build_strategy(cfg, self.device)
        self.strategy.sampler.seed(cfg.seed)
        self.strategy.frozen = self.frozen
        self.strategy.round_wait_timeout_s = cfg.federation.round_wait_timeout_s
        self.strategy.unpack = self.unpack = uplink_decoder(cfg.compression)
        self.strategy.downlink = downlink_encoder(cfg.compression, cfg.seed)
        self.first_round, self.elapsed_before = 1, 0.0
        self.nodes = _wait_for_nodes(
            grid, cfg.federation.min_available_nodes, cfg.federation.node_wait_timeout_s, runs_simulated_nodes(grid)
        )
        check_partitioning(len(train_source.labels), len(self.nodes), cfg.partition)
        check_cohort(cfg, self.strategy, len(self.nodes))
        # Simulated nodes report their partition and the first claim binds; a deployed node's claim
        # binds nothing (strategies/partitions.py).
        self.partitions = PartitionBinding(len(self.nodes), from_claims=runs_simulated_nodes(grid))
        # Log lines name a simulated node by its bound partition, a deployed one by its node config's name.
        self.strategy.names = NodeNames(self.partitions.partition_of)
        log.info(
            "partition claims: %s",
            "the first binds (simulated nodes)"
            if self.partitions.from_claims
            else "ignored (a deployment: each node is capped at federation.max_examples_per_node)",
        )
        self.strategy.weight_cap = example_cap(cfg, train_source.labels, self.partitions)
        self.clock: VirtualClockGrid | None = None
        self.fleet: dict[str, Any] | None = None
        if (fleet := fleet_of(cfg.fleet, cfg.stragglers)) is not None:
            self.grid = self.clock = self.start_clock(fleet, train_source.labels)
        run_state: dict[str, Any] = {}
        if resume := checkpoint_to_resume(cfg, root):
            ckpt = load_checkpoint(resume)
            _check_compatible(ckpt, self.model, str(resume))
            if ckpt.round >= cfg.federation.rounds:
                raise ConfigError(
                    f"resume={resume}: round {ckpt.round} already reached federation.rounds={cfg.federation.rounds}"
                )
            self.arrays, self.frozen = self.split(ckpt.state_dict)
            self.strategy.frozen = self.frozen
            self.strategy.load_state_dict(ckpt.strategy_state)
            restore_rng(ckpt.rng, self.strategy.sampler)
            self.first_round, self.elapsed_before = ckpt.round + 1, ckpt.wall_time_s
            run_state = ckpt.run_state
            if "local_dp_history" in run_state:  # a checkpoint from before HistoryLedger: histories only
                run_state = {"local_dp": {"histories": run_state["local_dp_history"]}}
            self.recorder = RunRecorder(resume.parent, resumed_after=ckpt.round, primary=self.task.primary)
            if self.clock is not None and self.recorder.rows:  # tasks out at the crash are lost
                self.clock.now = float(self.recorder.rows[-1].get("sim_time_s") or 0.0)
            log.info("resuming %s after round %d", resume, ckpt.round)
        else:
            run_dir = new_run_dir(root, cfg.name, cfg.strategy.name, cfg.dataset.name, reuse=cfg.resume == "auto")
            self.recorder = RunRecorder(run_dir, primary=self.task.primary)
        self.recorder.save_config(raw)
        self.monitor = Monitor(self.task.names, cfg.monitoring.max_node_labels)
        self.scores: RoundScores | None = None
        if cfg.ledger.contribution != "none":
            g = torch.Generator().manual_seed(cfg.seed)
            idx = torch.randperm(len(self.test_data), generator=g)[: cfg.ledger.validation_examples]
            held = Examples(self.test_data.x[idx], self.test_data.y[idx])
            self.scores = RoundScores(cfg.ledger, lambda state: self.value_on(held, state), cfg.seed)
        self.ledger: Ledger | None = None
        if cfg.ledger.name == "on":
            try:
                key = load_signing_key(cfg.ledger.signing_key) if cfg.ledger.signing_key else None
                self.ledger = Ledger(self.recorder.run_dir, key)  # a resumed run's chain must verify
            except ValueError as err:
                raise ConfigError(str(err)) from None
            self.ledger.truncate_after(self.first_round - 1)  # steps past the checkpoint are re-run
            self.model_digest = model_digest(self.full_state(self.arrays))
            self.node_keys = NodeKeys(grid.get_nodes)
        log.info("results: %s", self.recorder.run_dir)
        self.strategy.summary()
        log.info(
            "%d nodes, %d train / %d test examples, model %s (%d parameters, %d trained), %s %d..%d",
            len(self.nodes),
            len(train_source.labels),
            len(self.test_data),
            model_key(cfg.model),
            sum(p.numel() for p in self.model.parameters()),
            sum(p.numel() for n, p in self.model.named_parameters() if n in self.trainable),
            f"{self.strategy.unit}s",
            self.first_round,
            cfg.federation.rounds,
        )
        self.attacked = (
            malicious_partitions(cfg.seed, len(self.nodes), cfg.attack.num_malicious)
            if cfg.attack.name != "none"
            else []
        )
        if self.attacked:
            log.info("attack %s: malicious partitions %s (scale %s)", cfg.attack.name, self.attacked, cfg.attack.scale)
        self.named_attackers: set[int] = set()  # malicious partitions whose node the log has named
        # One live record: FedBuff copies it into every task (per-node additions: strategy.node_config).
        self.client_config = ConfigRecord(
            {
                **to_client_record(cfg),
                **spec_to_record(spec),
                ROUNDS_KEY: cfg.federation.rounds,  # local DP plans its noise over all rounds
            }
        )
        self.stop_reason = "rounds"
        self.privacy = run_privacy(cfg, self.strategy, self.partitions, run_state)
        self.privacy.names = self.strategy.names
        if self.ledger is not None:
            self.strategy.node_config = with_receipts(self.strategy.node_config, self.ledger)
        dp = getattr(self.strategy, "dp", None)
        if dp is not None and dp.delta >= 1 / len(self.nodes):
            log.warning(
                "privacy.delta=%g >= 1/population = 1/%d: a mechanism that leaks one whole client with "
                "probability delta would satisfy this guarantee; use delta well below %.2g",
                dp.delta,
                len(self.nodes),
                1 / len(self.nodes),
            )

    def split(self, state: dict[str, torch.Tensor]) -> tuple[ArrayRecord, ArrayRecord | None]:
        """(the trainable tensors, the frozen ones or None when everything trains)."""
        trainable = set(self.trainable)
        frozen = {k: v for k, v in state.items() if k not in trainable}
        return ArrayRecord({k: state[k] for k in self.trainable}), (ArrayRecord(frozen) if frozen else None)

    def full_state(self, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
        """The whole model: the strategy's trainable tensors and the frozen ones."""
        frozen = self.frozen.to_torch_state_dict() if self.frozen is not None else {}
        return {**frozen, **arrays.to_torch_state_dict()}

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.started

    def budget_spent(self) -> str:
        """The stop reason once federation.max_wall_time_s is spent, on the run's clock."""
        kind = "simulated" if self.clock is not None else "wall-clock"
        return f"{kind} budget {self.cfg.federation.max_wall_time_s:.0f} s spent"

    def budget_time(self) -> float:
        """What federation.max_wall_time_s counts: simulated seconds on a virtual clock, else wall time."""
        return self.clock.now if self.clock is not None else self.elapsed()

    def start_clock(self, fleet: FleetConfig, labels: Any) -> VirtualClockGrid:  # noqa: ANN401 - label array
        """The virtual clock over the grid: each node's partition (asked once), its profile, and
        the work each task means (its partition's training examples x epochs; evaluation: its
        validation examples)."""
        cfg = self.cfg
        if not self.partitions.from_claims:
            raise ConfigError(
                f"fleet={fleet.name}: fleet profiles and stragglers simulate nodes under `flwr run` simulation; "
                "this is a deployment, which runs in real time (fleet=none stragglers=none)"
            )
        partitions = discover_partitions(self.grid, self.nodes, cfg.federation.node_wait_timeout_s)
        for node, partition in partitions.items():
            if self.partitions.bind(node, partition) is None:
                raise ConfigError(f"fleet: node {node} claims partition {partition} of {len(self.nodes)}")
        profiles = fleet_profiles(fleet, len(self.nodes), cfg.seed)
        sizes = partition_sizes(cfg, labels, len(self.nodes))

        def work(partition: int, kind: str) -> float:
            train, validation = sizes(partition)
            return {MessageType.TRAIN: train * cfg.train.epochs, MessageType.EVALUATE: validation}.get(kind, 0)

        log.info("fleet %s on a virtual clock: %s", fleet.name, describe(profiles))
        self.fleet = {
            **asdict(fleet),
            "samples_per_s_per_partition": [p.samples_per_s for p in profiles],
            "partition_of_node": {str(node): p for node, p in sorted(partitions.items(), key=lambda i: i[1])},
        }
        f = cfg.federation
        needed = 1 if self.strategy.asynchronous else max(f.min_available_nodes, f.min_train_nodes)
        return VirtualClockGrid(self.grid, profiles, partitions, work, cfg.seed, min_nodes=needed)

    def central_eval(self, arrays: ArrayRecord) -> tuple[float, dict[str, float]]:
        """(loss, {metric: value}) of the model on the server's test split."""
        self.model.load_state_dict(self.full_state(arrays))
        return evaluate(self.model.to(self.device), self.test_data, self.precision, self.task)

    def value_on(self, data: Examples, state: dict[str, torch.Tensor]) -> float:
        """What the trainable tensors `state` (with the frozen ones) are worth on `data`: minus the
        loss, or the primary metric (`ledger.contribution_value`); higher is better either way."""
        frozen = self.frozen.to_torch_state_dict() if self.frozen is not None else {}
        self.model.load_state_dict({**frozen, **state})
        loss, metrics = evaluate(self.model.to(self.device), data, self.precision, self.task)
        return -loss if self.cfg.ledger.contribution_value == "loss" else metrics[self.task.primary]

    def record_scores(self, nodes: list[dict], scores: dict[int, float]) -> None:
        """Put the step's contribution scores into its ledger records, the totals into the metrics."""
        attach_scores(nodes, scores)
        assert self.scores is not None
        for node, total in self.scores.totals.items():
            self.monitor.contribution(node, total)

    @staticmethod
    def sim_note(row: dict[str, Any]) -> str:
        """The simulated time for a log line, on a virtual clock."""
        return f"  (simulated t={row['sim_time_s']:.1f}s)" if "sim_time_s" in row else ""

    def describe(self, loss: float | None, metrics: dict[str, float] | None) -> str:
        """The evaluation for a log line: the metrics, then the loss."""
        if metrics is None or loss is None:
            return "(not evaluated)"
        return "  ".join([*(f"{k} {v:.4f}" for k, v in metrics.items()), f"loss {loss:.4f}"])

    def evaluates(self, step: int) -> bool:
        """Whether `step` (a round, or a FedBuff version) is evaluated centrally: every
        federation.eval_every, the last, and the one that spends the wall-clock budget."""
        f = self.cfg.federation
        return (
            step % f.eval_every == 0
            or step >= f.rounds
            or bool(f.max_wall_time_s and self.budget_time() >= f.max_wall_time_s)
        )

    def should_stop(self, rnd: int, metrics: dict[str, float] | None) -> bool:
        """Rounds done, the target metric reached or wall-clock budget spent (sets stop_reason).
        validate() has resolved the target (federation.target_accuracy included)."""
        f = self.cfg.federation
        value = (metrics or {}).get(str(f.target_metric))
        if f.target_value and value is not None and value >= f.target_value:
            self.stop_reason = f"target {f.target_metric} {f.target_value} reached"
        elif f.max_wall_time_s and self.budget_time() >= f.max_wall_time_s:
            self.stop_reason = self.budget_spent()
        elif rnd >= f.rounds:
            self.stop_reason = "rounds"
        else:
            return False
        if self.stop_reason != "rounds":
            log.info("stopping after round %d: %s", rnd, self.stop_reason)
        return True

    def save_state(self, rnd: int, wall_time_s: float, state: dict[str, torch.Tensor] | None = None) -> None:
        """Checkpoint the model after `rnd` (`state`: the whole model, when the caller has built it)
        with the privacy spent so far: central DP's accountant is in the strategy's state, local
        DP's histories in the run's."""
        save_checkpoint(
            self.recorder.checkpoint_path,
            Checkpoint(
                state if state is not None else self.full_state(self.arrays),
                rnd,
                self.strategy.state_dict(),
                capture_rng(self.strategy.sampler),
                wall_time_s,
                run_state=self.privacy.state(),
            ),
        )

    def finish_round(
        self, rnd: int, row: dict[str, Any], nodes: list[dict[str, Any]], client_metrics: list[tuple[int, Any]]
    ) -> None:
        """Record step `rnd`: its ledger entry (`nodes`: who took part and how), the checkpoint, its
        row, and the live metrics (per node from `client_metrics` only where the row may be exact)."""
        row.update(self.privacy.row())
        check_columns(row, self.task.names)
        self.name_attackers()
        if (described := self.privacy.describe(row)) is not None:
            log.info("[%s %d] privacy: %s", self.strategy.unit, rnd, described)
        state = self.full_state(self.arrays)  # hashed for the ledger and checkpointed: built once
        if self.ledger is not None:  # before the checkpoint: a resume drops entries past it
            self.node_keys.name(nodes)
            before, self.model_digest = self.model_digest, model_digest(state)
            entry = {"step": rnd, "unit": self.strategy.unit, "wall_time_s": row["wall_time_s"]}
            self.ledger.append({**entry, "model_before": before, "model_after": self.model_digest, "nodes": nodes})
        # Checkpoint first: a row in metrics.jsonl then always means a resumable round.
        self.save_state(rnd, row["wall_time_s"], state)
        recorded = reported(row, self.cfg.privacy)
        self.recorder.log_round(recorded)
        exact = self.cfg.privacy.name == "none" or self.cfg.privacy.report_exact
        self.monitor.observe(recorded, client_metrics if exact else [])

    def name_attackers(self) -> None:
        """Which nodes hold the malicious partitions, once their first claims have bound them
        (simulation; a deployment binds none), each named once."""
        holders = {p: self.partitions.holder(p) for p in self.attacked if p not in self.named_attackers}
        found = {p: node for p, node in holders.items() if node is not None}
        if found:
            self.named_attackers |= found.keys()
            log.info("attack %s: malicious nodes %s", self.cfg.attack.name, labels(found.values(), self.strategy.names))

    @staticmethod
    def cohort(row: dict[str, Any]) -> str:
        """A round line's counts. A plain mean uses every reply it accepts: `clients` (accepted, and
        used) and `rejected`. A robust rule uses the ones it selects among them, so its line counts
        the replies received, accepted, selected (0 when the round was skipped) and rejected apart.
        `missing`: tasks sent without a reply, when there are any."""
        rejected, missing = row["num_rejected"], row["num_missing"]
        tail = f"  rejected {rejected}" + (f"  missing {missing}" if missing else "")
        if row["robust"] is None:
            return f"clients {row['num_clients']}{tail}"
        replies = row["num_sampled"] - missing
        selected = row["num_clients"] if row["model_updated"] else 0
        return f"replies {replies}  accepted {replies - rejected}  selected {selected}{tail}"

    def timed_row(
        self, rnd: int, metrics: dict[str, float] | None, loss: float | None, step_s: float
    ) -> dict[str, Any]:
        """The columns every row starts with: each metric by its name (None when not evaluated)."""
        return {
            "round": rnd,
            **(metrics if metrics is not None else dict.fromkeys(self.task.names)),
            "loss": loss,
            "wall_time_s": self.elapsed(),
            "round_time_s": step_s,
            **({"sim_time_s": self.clock.now} if self.clock is not None else {}),
        }

    # --- synchronous rounds ------------------------------------------------------
    def exchange(self, messages: list[Message], timeout: float | None) -> list[Message]:
        """Send a round's tasks and collect the replies within the round timeout (simulated
        seconds on a virtual clock, where a late reply is dropped as missing)."""
        if self.clock is not None:
            return self.clock.send_and_receive(messages, timeout=timeout)
        return send_and_receive(self.grid, messages, timeout)

    def run_rounds(self) -> None:
        strategy, grid, cfg = self.strategy, self.grid, self.cfg
        timeout = cfg.federation.round_timeout_s
        federated_eval = cfg.federation.fraction_evaluate > 0
        for rnd in range(self.first_round, cfg.federation.rounds + 1):
            t0 = time.time()
            config = ConfigRecord(self.client_config)
            messages = list(strategy.configure_train(rnd, self.arrays, config, grid))
            replies = self.exchange(messages, timeout)
            previous = self.arrays
            new_arrays, train_metrics = strategy.aggregate_train(rnd, replies)
            client_metrics = reply_metrics(replies)
            self.privacy.record_spending(client_metrics)
            if self.privacy.spent_before_release(federated_eval):
                # Spending that has left the server goes on record before anything else can crash:
                # the previous model with this round's spending, so a crash before the round's own
                # checkpoint re-runs the round, charged twice, never zero times.
                self.save_state(rnd - 1, self.elapsed())
            report = strategy.train_report
            if new_arrays is not None:
                self.arrays = new_arrays
            fed_eval: MetricRecord | None = None
            tasks = list(messages)
            if federated_eval:
                eval_msgs = list(strategy.configure_evaluate(rnd, self.arrays, ConfigRecord(self.client_config), grid))
                fed_eval = strategy.aggregate_evaluate(rnd, self.exchange(eval_msgs, timeout))
                tasks += eval_msgs
            loss, metrics = self.central_eval(self.arrays) if self.evaluates(rnd) else (None, None)
            row = {
                **self.timed_row(rnd, metrics, loss, time.time() - t0),
                **round_row(
                    rnd,
                    report,
                    len(replies),
                    client_metrics,
                    strategy.robust_row(),
                    new_arrays is not None,
                    train_metrics,
                    fed_eval,
                ),
                **traffic(
                    [payload_bytes(m.content) for m in tasks],
                    [payload_bytes(r.content) for r in replies if not r.has_error()],
                    self.unpack.take() if self.unpack is not None else None,
                ),
            }
            nodes = round_nodes(messages, replies, report, cfg.strategy.name)
            if self.scores is not None:
                self.record_scores(
                    nodes, self.scores.score(record_to_tensors(previous), strategy.last_valid, strategy.robust_row())
                )
            self.finish_round(rnd, row, nodes, client_metrics)
            log.info(
                "[round %d/%d] %s  %.1fs%s  %s",
                rnd,
                cfg.federation.rounds,
                self.describe(loss, metrics),
                row["round_time_s"],
                self.sim_note(row),
                self.cohort(row),
            )
            if self.should_stop(rnd, metrics):
                break

    # --- asynchronous versions (FedBuff) ---------------------------------------------
    def run_versions(self) -> None:
        strategy, cfg = self.strategy, self.cfg
        budget = cfg.federation.max_wall_time_s
        last = time.time()

        def on_version(report: VersionReport, arrays: ArrayRecord) -> bool:
            nonlocal last
            self.privacy.record_spending(report.client_metrics)
            self.arrays = arrays
            v = report.version
            loss, metrics = self.central_eval(arrays) if self.evaluates(v) else (None, None)
            now = time.time()
            row = {
                **self.timed_row(v, metrics, loss, now - last),
                **version_row(report, strategy.tasks_sent),
                **traffic(report.bytes_down, report.bytes_up, self.unpack.take() if self.unpack is not None else None),
            }
            last = now
            nodes = version_nodes(report, cfg.strategy.buffer_aggregator)
            if self.scores is not None:
                scores = self.scores.score_buffer(
                    strategy.last_base, strategy.last_buffer, strategy.server_lr, report.robust
                )
                self.record_scores(nodes, scores)
            self.finish_round(v, row, nodes, report.client_metrics)
            log.info(
                "[version %d/%d] %s  %.1fs%s  staleness %s  discarded %d  rejected %d  failed %d",
                v,
                cfg.federation.rounds,
                self.describe(loss, metrics),
                row["round_time_s"],
                self.sim_note(row),
                row["staleness"],
                report.discarded_stale,
                len(report.rejected),
                len(report.failed),
            )
            return self.should_stop(v, metrics)

        clock = (lambda: self.clock.now) if self.clock is not None else time.monotonic
        deadline = clock() + budget - self.budget_time() if budget else None
        self.arrays = strategy.run(
            self.grid,
            self.arrays,
            self.client_config,
            on_version,
            first_version=self.first_round - 1,
            deadline=deadline,
            drain=self.privacy.drain,
            clock=clock,
        )
        if self.privacy.drain and strategy.report.client_metrics:
            # Replies after the last version (and the tasks still out at the stop, drained) spent their
            # steps too: on record and checkpointed.
            self.privacy.record_spending(strategy.report.client_metrics)
            self.save_state(strategy.version, self.elapsed())
        if deadline is not None and clock() >= deadline:
            self.stop_reason = self.budget_spent()

    def final_evaluation(self) -> dict[str, Any]:
        """The final model's metrics when the last row did not evaluate it.

        A run can stop between evaluations (`federation.eval_every` > 1, e.g. at a
        wall-clock budget) or, with FedBuff, before its first version (a budget spent on
        the first tasks); it still reports the model it ends with, the initial one if
        nothing was applied.
        """
        rows, primary = self.recorder.rows, self.task.primary
        if rows and rows[-1].get(primary) is not None:
            return {}
        loss, metrics = self.central_eval(self.arrays)
        log.info("final model, not evaluated by the last recorded step: %s", self.describe(loss, metrics))
        accuracy = {"final_accuracy": metrics["accuracy"]} if "accuracy" in metrics else {}
        return {"final_metric": metrics[primary], **accuracy, "final_loss": loss}

    def serve_metrics(self) -> None:
        """Start the Prometheus endpoint (monitoring.prometheus_port > 0) before the first step."""
        m = self.cfg.monitoring
        if not m.prometheus_port:
            return
        try:
            port = self.monitor.start(m.prometheus_port, m.prometheus_host)
        except OSError as err:
            raise ConfigError(
                f"monitoring.prometheus_port={m.prometheus_port}: cannot serve on {m.prometheus_host} ({err}); "
                "pick a free port"
            ) from None
        log.info("Prometheus metrics: http://%s:%d/metrics", m.prometheus_host, port)

    def run(self) -> dict[str, Any]:
        status = "failed"
        try:
            try:
                self.serve_metrics()
                self.run_versions() if self.strategy.asynchronous else self.run_rounds()
            except PrivacyBudgetExhausted as err:
                self.stop_reason = str(err)
                log.warning("stopping: %s; the saved model is the last one released within the budget", err)
            except TooFewNodes as err:  # resumable: the summary says stopped, not completed
                status, self.stop_reason = "stopped", str(err)
                raise
            status = "completed"
        finally:
            self.monitor.close()
            torch.save(self.full_state(self.arrays), self.recorder.final_model_path)
            cfg = self.cfg
            extra: dict[str, Any] = {
                "strategy": cfg.strategy.name,
                "dataset": cfg.dataset.name,
                "model": cfg.model.name,
                "num_nodes": len(self.nodes),
                "stop_reason": self.stop_reason if status in ("completed", "stopped") else None,
                "attack": {**asdict(cfg.attack), "malicious_partitions": self.attacked},
                **({"fleet": self.fleet} if self.fleet is not None else {}),
                "privacy": self.privacy.summary(),
                "final_model": str(self.recorder.final_model_path),
                "checkpoint": str(self.recorder.checkpoint_path),
                **self.strategy.run_summary(),
            }
            if self.ledger is not None:
                self.ledger.seal(status)  # the signature now says the run ended here (app/ledger/signing.py)
                extra["ledger"] = {
                    "file": str(self.ledger.path),
                    "entries": self.ledger.length,
                    "head": self.ledger.head,
                }
                log.info("ledger: %d entries, head %s", self.ledger.length, self.ledger.head)
            if status == "completed":
                extra.update(self.final_evaluation())
            summary = self.recorder.finish(status, self.elapsed(), extra)
            log.info(
                "run %s: final %s %s, results: %s",
                status,
                summary["primary_metric"],
                summary["final_metric"],
                self.recorder.run_dir,
            )
        return summary


def with_receipts(prior: NodeConfig | None, ledger: Ledger) -> NodeConfig:
    """The per-node task config (`strategy.node_config`, e.g. local DP's) plus the node's receipt:
    the step and hash of the ledger entry that recorded its previous reply, and that reply's hash
    as recorded (the node compares it with its own: docs/ledger.md#receipts)."""

    def per_node(node: int, connected: Collection[int]) -> dict[str, Any]:
        extra = {**(prior(node, connected) if prior is not None else {}), LEDGER_ON: True}
        if (receipt := ledger.receipts.get(node)) is not None:
            extra |= {RECEIPT_STEP: receipt[0], RECEIPT_HASH: receipt[1], RECEIPT_REPLY: receipt[2]}
        return extra

    return per_node


def completed_run(cfg: Config, root: Path) -> dict[str, Any] | None:
    """With `resume=auto`, the named run's summary when it has already finished what this config
    asks (its rounds, or its target or budget): re-running the same command is then a no-op."""
    if cfg.resume != "auto":
        return None
    summary = read_summary(root / str(cfg.name))
    if not summary or summary.get("status") != "completed":
        return None
    done = (
        summary.get("stop_reason") not in (None, "rounds")
        or summary.get("rounds_completed", 0) >= cfg.federation.rounds
    )
    return summary if done else None


def run_federation(grid: Grid, cfg: Config, raw: DictConfig, root: Path) -> dict[str, Any]:
    """Train for `federation.rounds` rounds or versions (or the rest of them after `resume`);
    with `resume=auto` and the run already complete, say so and return its summary."""
    if (summary := completed_run(cfg, root)) is not None:
        log.info(
            "run %r already complete (stop reason: %s, %s steps): nothing to do; results: %s",
            cfg.name,
            summary.get("stop_reason"),
            summary.get("rounds_completed"),
            root / str(cfg.name),
        )
        return summary
    return FederatedRun(grid, cfg, raw, root).run()
