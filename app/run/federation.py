"""The run behind the ServerApp: set-up, the synchronous round loop or FedBuff's
asynchronous one, results, checkpoints and stopping rules.

Flower's `Strategy.start` cannot resume from a round, write a checkpoint between
rounds or stop at a target accuracy, so the loops live here; the synchronous one
drives any strategy through the same configure/aggregate calls, the asynchronous one
hands FedBuff a callback for every server update.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from omegaconf import DictConfig

from app.config.schema import ROBUST_RULES, STRATEGIES, Config, ConfigError, StrategyConfig
from app.protocol import to_client_record
from app.run.checkpoint import Checkpoint, capture_rng, load_checkpoint, restore_rng, save_checkpoint
from app.run.results import RunRecorder, new_run_dir
from app.simulation.attacks import malicious_partitions
from app.simulation.stragglers import client_record, straggler_factors
from app.task.data import (
    check_partitioning,
    data_spec,
    load_splits,
    materialize,
    partition_indices,
    spec_to_record,
    validation_size,
)
from app.task.models import build_model
from app.task.training import evaluate, resolve_device, resolve_precision
from strategies.central_dp import (
    AdaptiveClip,
    CentralDP,
    DPFedAvg,
    DPFedBuff,
    PrivacyBudgetExhausted,
    cohort_sensitivity,
)
from strategies.coordinatewise import CoordinateMedian, TrimmedMean
from strategies.fedavg import FedAvg
from strategies.fedbuff import FedBuff, VersionReport
from strategies.krum import Krum, MultiKrum
from strategies.partitions import PartitionBinding
from strategies.replies import InvalidReply, WeightCap
from strategies.robust import RobustStrategy
from strategies.staleness import staleness_fn

if TYPE_CHECKING:
    from app.privacy.local_dp import HistoryLedger

log = logging.getLogger("flwr.fedgpu." + __name__)

# Row values computed from the clients' replies or from which nodes took part: no epsilon
# covers them, so with privacy on they are recorded only with privacy.report_exact=true.
EXACT_ROW_KEYS = (
    "num_sampled",
    "num_clients",
    "num_rejected",
    "num_missing",
    "num_failed",
    "num_discarded_stale",
    "rejected",
    "failed",
    "node_partitions",
    "applied",
    "staleness",
    "tasks_sent",
    "robust",
    "capped_weights",
    "train",
    "federated_eval",
)


def _robust_rule(name: str, st: StrategyConfig, common: dict[str, Any]) -> RobustStrategy:
    robust = {**common, "num_byzantine": st.num_byzantine, "on_too_few": st.on_too_few}
    if name == "krum":
        return Krum(**robust)
    if name == "multikrum":
        return MultiKrum(num_selected=st.num_selected, **robust)
    if name == "median":
        return CoordinateMedian(**robust)
    return TrimmedMean(trim_ratio=st.trim_ratio, **robust)


def central_dp(cfg: Config) -> CentralDP | None:
    """The central-DP mechanism the privacy settings ask for (None without central DP)."""
    p = cfg.privacy
    if not p.name.startswith("central"):
        return None
    adaptive = AdaptiveClip(p.target_quantile, p.clip_lr, p.count_noise) if p.name == "central_adaptive" else None
    fraction = cfg.federation.fraction_train
    return CentralDP(
        noise_multiplier=p.noise_multiplier,
        clip_norm=p.clip_norm,
        delta=p.delta,
        sample_rate=fraction if p.poisson_sampling else 1.0,
        sensitivity=cohort_sensitivity(
            fedbuff=cfg.strategy.name == "fedbuff", poisson=p.poisson_sampling, fraction_train=fraction
        ),
        max_epsilon=p.max_epsilon,
        adaptive=adaptive,
    )


def build_strategy(cfg: Config, device: torch.device) -> FedAvg | FedBuff:
    """The configured strategy; robust ones get f, m, the trim ratio and the too-few policy."""
    f, st = cfg.federation, cfg.strategy
    common = {
        "fraction_train": f.fraction_train,
        "min_train_nodes": f.min_train_nodes,
        "fraction_evaluate": f.fraction_evaluate,
        "min_evaluate_nodes": f.min_evaluate_nodes,
        "min_available_nodes": f.min_available_nodes,
        "message_ttl_s": f.message_ttl_s,
        "device": device,
    }
    dp = central_dp(cfg)
    if st.name == "fedavg" and dp is not None:
        return DPFedAvg(dp=dp, poisson=cfg.privacy.poisson_sampling, **common)
    if st.name == "fedavg":
        return FedAvg(**common)
    if st.name in ROBUST_RULES:
        return _robust_rule(st.name, st, common)
    if st.name == "fedbuff":
        rule = None if st.buffer_aggregator == "mean" else _robust_rule(st.buffer_aggregator, st, common)
        if rule is not None and (problem := rule.too_few(st.buffer_size)):
            raise ConfigError(f"strategy.buffer_size={st.buffer_size} is too small for the robust buffer: {problem}")
        kind, extra = (FedBuff, {}) if dp is None else (DPFedBuff, {"dp": dp})
        return kind(
            **extra,
            buffer_size=st.buffer_size,
            concurrency=st.concurrency,
            max_staleness=st.max_staleness,
            staleness=staleness_fn(st.staleness_fn, st.staleness_a, st.staleness_b),
            staleness_name=st.staleness_fn,
            server_lr=st.server_lr,
            server_momentum=st.server_momentum,
            buffer_rule=rule,
            # One training task may take round_timeout_s; its message lives no longer.
            message_ttl_s=f.round_timeout_s,
            device=device,
        )
    raise ConfigError(f"strategy.name={st.name!r} is invalid: allowed: {', '.join(STRATEGIES)}")


def example_cap(cfg: Config, labels: np.ndarray, binding: PartitionBinding) -> WeightCap:
    """The most examples a node's reply may count for (its FedAvg / FedBuff weight).

    `federation.max_examples_per_node` for every node; a node bound to a simulated
    partition is held to what that partition really has: its training part for
    training replies, its validation part for evaluation replies. Sizes are computed
    the way the ClientApp splits its data (`partition_indices`, `validation_size`),
    once per partition, when a node first claims it.
    """
    limit = cfg.federation.max_examples_per_node

    @functools.cache
    def train_and_validation(partition: int) -> tuple[int, int]:
        n = len(partition_indices(labels, binding.num_partitions, partition, cfg.partition, cfg.seed))
        held_out = validation_size(n, cfg.dataset.val_fraction)
        return n - held_out, held_out

    def cap(node_id: int, metrics: MetricRecord, kind: str) -> float:
        partition = binding.bind(node_id, metrics.get("partition-id"))
        if partition is None:
            return limit
        train, validation = train_and_validation(partition)
        return min(limit, train if kind == MessageType.TRAIN else validation)

    return cap


def check_cohort(cfg: Config, strategy: FedAvg | FedBuff, num_nodes: int) -> int:
    """Before the first round: can the rounds' cohort ever satisfy the strategy and attack?"""
    f = cfg.federation
    if isinstance(strategy, FedBuff):
        cohort = min(num_nodes, strategy.concurrency or num_nodes)
        # Both a robust buffer and a central-DP one take at most one update per node.
        kind = "robust" if strategy.buffer_rule is not None else "central-DP" if isinstance(strategy, DPFedBuff) else ""
        if kind and cohort < strategy.buffer_size:
            raise ConfigError(
                f"strategy.buffer_size={strategy.buffer_size}: a {kind} buffer takes one update per node, but only "
                f"{cohort} nodes train at once ({num_nodes} nodes, strategy.concurrency={strategy.concurrency})"
            )
    else:
        cohort = min(num_nodes, max(int(num_nodes * f.fraction_train), f.min_train_nodes))
    if isinstance(strategy, RobustStrategy) and (problem := strategy.cohort_problem(cohort)):
        raise ConfigError(
            f"{problem} ({num_nodes} nodes, federation.fraction_train={f.fraction_train}, "
            f"federation.min_train_nodes={f.min_train_nodes}); use more nodes or tolerate fewer Byzantine clients"
        )
    if cfg.attack.num_malicious > num_nodes:
        raise ConfigError(f"attack.num_malicious={cfg.attack.num_malicious} is invalid: only {num_nodes} nodes")
    return cohort


def node_partitions(metrics: list[tuple[int, MetricRecord]]) -> dict[str, int]:
    """node id -> partition id, as simulated nodes report it (for reading attack results)."""
    return {str(node): m["partition-id"] for node, m in metrics if isinstance(m.get("partition-id"), int)}


def reply_metrics(replies: list[Message]) -> list[tuple[int, MetricRecord]]:
    """(node id, metrics) of every successful reply."""
    return [
        (msg.metadata.src_node_id, record)
        for msg in replies
        if not msg.has_error()
        for record in msg.content.metric_records.values()
    ]


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


def _wait_for_nodes(grid: Grid, minimum: int, timeout_s: float) -> list[int]:
    """The connected nodes once `minimum` are there; a clear error after `timeout_s`."""
    deadline, next_log = time.monotonic() + timeout_s, 0.0
    while len(nodes := list(grid.get_node_ids())) < minimum:
        now = time.monotonic()
        if now >= deadline:
            raise ConfigError(
                f"federation.min_available_nodes={minimum}: only {len(nodes)} node(s) connected after "
                f"{timeout_s:.0f} s; start more SuperNodes (or num-supernodes in simulation), lower "
                "federation.min_available_nodes, or raise federation.node_wait_timeout_s"
            )
        if now >= next_log:
            log.info("waiting for nodes: %d connected, %d needed", len(nodes), minimum)
            next_log = now + 10.0
        time.sleep(0.5)
    return nodes


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

        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)  # Flower's node sampling (and FedBuff's) draws from Python's `random`
        self.model = build_model(cfg.model, spec)
        if cfg.privacy.name == "local":  # the clients train the Opacus-compatible model: same keys here
            from app.privacy.local_dp import make_private_compatible

            self.model = make_private_compatible(self.model)
        self.arrays = ArrayRecord(self.model.state_dict())
        self.strategy = build_strategy(cfg, self.device)
        self.first_round, self.elapsed_before = 1, 0.0
        self.nodes = _wait_for_nodes(grid, cfg.federation.min_available_nodes, cfg.federation.node_wait_timeout_s)
        check_partitioning(len(train_source.labels), len(self.nodes), cfg.partition)
        check_cohort(cfg, self.strategy, len(self.nodes))
        # Simulated nodes report their partition; the first claim binds (strategies/partitions.py).
        self.partitions = PartitionBinding(len(self.nodes))
        self.strategy.weight_cap = example_cap(cfg, train_source.labels, self.partitions)
        run_state: dict[str, Any] = {}
        if resume := checkpoint_to_resume(cfg, root):
            ckpt = load_checkpoint(resume)
            _check_compatible(ckpt, self.model, str(resume))
            if ckpt.round >= cfg.federation.rounds:
                raise ConfigError(
                    f"resume={resume}: round {ckpt.round} already reached federation.rounds={cfg.federation.rounds}"
                )
            self.arrays = ArrayRecord(ckpt.state_dict)
            self.strategy.load_state_dict(ckpt.strategy_state)
            restore_rng(ckpt.rng)
            self.first_round, self.elapsed_before = ckpt.round + 1, ckpt.wall_time_s
            run_state = ckpt.run_state
            if "local_dp_history" in run_state:  # a checkpoint from before HistoryLedger: histories only
                run_state = {"local_dp": {"histories": run_state["local_dp_history"]}}
            self.recorder = RunRecorder(resume.parent, resumed_after=ckpt.round)
            log.info("resuming %s after round %d", resume, ckpt.round)
        else:
            run_dir = new_run_dir(root, cfg.name, cfg.strategy.name, cfg.dataset.name, reuse=cfg.resume == "auto")
            self.recorder = RunRecorder(run_dir)
        self.recorder.save_config(raw)
        log.info("results: %s", self.recorder.run_dir)
        self.strategy.summary()
        log.info(
            "%d nodes, %d train / %d test examples, model %s (%d parameters), %s %d..%d",
            len(self.nodes),
            len(train_source.labels),
            len(self.test_data),
            cfg.model.name,
            sum(p.numel() for p in self.model.parameters()),
            "versions" if isinstance(self.strategy, FedBuff) else "rounds",
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
        self.slowdowns = straggler_factors(cfg.stragglers, len(self.nodes), cfg.seed)
        if cfg.stragglers.name != "none":
            log.info(
                "stragglers %s: slowdown per partition %s, dropout %g",
                cfg.stragglers.name,
                [round(x, 2) for x in self.slowdowns],
                cfg.stragglers.dropout,
            )
        # One live record: FedBuff copies it into every task (per-node additions: strategy.node_config).
        self.client_config = ConfigRecord(
            {
                **to_client_record(cfg),
                **spec_to_record(spec),
                **client_record(cfg.stragglers, len(self.nodes), cfg.seed),
                "federation.rounds": cfg.federation.rounds,  # local DP plans its noise over all rounds
            }
        )
        self.stop_reason = "rounds"
        self.dp: CentralDP | None = getattr(self.strategy, "dp", None)
        # Local DP: every client's accountant history under the server's name for it (app/privacy/local_dp.py);
        # each training message carries only the history that can be its node's own.
        self.local_dp: HistoryLedger | None = None
        self.dp_rejections: list[dict[str, Any]] = []  # refused histories since the last row
        if cfg.privacy.name == "local":
            from app.privacy.local_dp import HistoryLedger

            self.local_dp = HistoryLedger(cfg.privacy.delta, run_state.get("local_dp"))
            self.strategy.node_config = self.local_dp_prior
        if self.dp is not None and self.dp.delta >= 1 / len(self.nodes):
            log.warning(
                "privacy.delta=%g >= 1/population = 1/%d: a mechanism that leaks one whole client with "
                "probability delta would satisfy this guarantee; use delta well below %.2g",
                self.dp.delta,
                len(self.nodes),
                1 / len(self.nodes),
            )

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.started

    def central_eval(self, arrays: ArrayRecord) -> tuple[float, float]:
        self.model.load_state_dict(arrays.to_torch_state_dict())
        return evaluate(self.model.to(self.device), self.test_data, self.precision)

    def should_stop(self, rnd: int, accuracy: float | None) -> bool:
        """Rounds done, target accuracy reached or wall-clock budget spent (sets stop_reason)."""
        f = self.cfg.federation
        if f.target_accuracy and accuracy is not None and accuracy >= f.target_accuracy:
            self.stop_reason = f"target accuracy {f.target_accuracy} reached"
        elif f.max_wall_time_s and self.elapsed() >= f.max_wall_time_s:
            self.stop_reason = f"wall-clock budget {f.max_wall_time_s:.0f} s spent"
        elif rnd >= f.rounds:
            self.stop_reason = "rounds"
        else:
            return False
        if self.stop_reason != "rounds":
            log.info("stopping after round %d: %s", rnd, self.stop_reason)
        return True

    def reported(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row as recorded: with privacy on, without EXACT_ROW_KEYS unless privacy.report_exact
        (the log keeps them: it is the operator's, who sees every reply anyway)."""
        p = self.cfg.privacy
        if p.name == "none" or p.report_exact:
            return row
        return {k: v for k, v in row.items() if k not in EXACT_ROW_KEYS}

    def privacy_row(self) -> dict[str, Any]:
        """This round's privacy numbers: central epsilon and clip, or local DP epsilons per client."""
        if self.dp is not None:
            dp = self.dp
            row: dict[str, Any] = {"epsilon": dp.epsilon(), "clip_norm": dp.clip_norm, "releases": dp.releases}
            if dp.adaptive is not None:  # b̃ was released (noised, accounted): covered by epsilon
                row["noised_unclipped_fraction"] = dp.last_noised_unclipped_fraction
            if self.cfg.privacy.report_exact:
                row["clipped_fraction"] = dp.last_clipped_fraction
            return row
        if self.local_dp is None:
            return {}
        # Over every client on record (this run's and, after a resume, earlier ones), by the server's accountant.
        eps = list(self.local_dp.epsilons().values())
        row = {"client_epsilon_max": max(eps), "client_epsilon_mean": sum(eps) / len(eps)} if eps else {}
        if self.dp_rejections:
            row["dp_history_rejected"], self.dp_rejections = self.dp_rejections, []
        return row

    def local_dp_prior(self, node_id: int) -> dict[str, str]:
        """Local DP: what a training message to `node_id` adds to its config (strategy.node_config)."""
        assert self.local_dp is not None
        partition, connected = self.partitions.partition_of(node_id), set(self.grid.get_node_ids())
        return self.local_dp.prior(node_id, partition, self.partitions.unbound(), connected)

    def record_spending(self, client_metrics: list[tuple[int, MetricRecord]]) -> None:
        """Local DP: keep every reply's accountant history, whatever becomes of its update (the steps
        were taken either way), under the node's bound partition or its node id, never the reply's
        claim alone. A malformed or shrinking history is logged and listed in the next row
        (`dp_history_rejected`); the one on record stays."""
        if self.local_dp is None:
            return
        from app.privacy.local_dp import MalformedHistory, history_key

        for node, metrics in client_metrics:
            try:
                partition = self.partitions.bind(node, metrics.get("partition-id"))
            except InvalidReply:  # a contested claim: the screening rejects the reply; the history is the node's
                partition = self.partitions.partition_of(node)
            key = history_key(partition, node)
            try:
                self.local_dp.record(key, node, metrics)
            except MalformedHistory as err:
                log.warning("node %s: local-DP accountant history for %s refused: %s", node, key, err)
                self.dp_rejections.append({"node_id": node, "key": key, "reason": str(err)})

    def privacy_summary(self) -> dict[str, Any]:
        p = self.cfg.privacy
        if self.dp is not None:
            return self.dp.summary()
        if self.local_dp is not None:
            per_client = self.local_dp.epsilons()  # bound partition or node id -> epsilon
            eps = list(per_client.values())
            return {
                "mechanism": "local DP-SGD (Opacus), sample-level per client",
                "client_epsilon_max": max(eps) if eps else None,
                "client_epsilon_mean": sum(eps) / len(eps) if eps else None,
                "client_epsilon": per_client,
                "delta": p.delta,
                "noise_multiplier": p.noise_multiplier,
                "target_epsilon": p.target_epsilon or None,
                "clip_norm": p.clip_norm,
            }
        return {"mechanism": "none"}

    def save_state(self, rnd: int, wall_time_s: float) -> None:
        """Checkpoint the model after `rnd` with the privacy spent so far: central DP's accountant is
        in the strategy's state, local DP's histories in the run's."""
        save_checkpoint(
            self.recorder.checkpoint_path,
            Checkpoint(
                self.arrays.to_torch_state_dict(),
                rnd,
                self.strategy.state_dict(),
                capture_rng(),
                wall_time_s,
                run_state={"local_dp": self.local_dp.state()} if self.local_dp is not None else {},
            ),
        )

    def finish_round(self, rnd: int, row: dict[str, Any]) -> None:
        row.update(self.privacy_row())
        if "epsilon" in row or "client_epsilon_max" in row:
            log.info(
                "[%s %d] privacy: %s",
                "version" if "version" in row else "round",
                rnd,
                f"epsilon {row['epsilon']:.3f} (delta {self.dp.delta:g}), clip {row['clip_norm']:.4g}"
                if self.dp is not None
                else f"client epsilon max {row['client_epsilon_max']:.3f}, mean {row['client_epsilon_mean']:.3f}",
            )
        # Checkpoint first: a row in metrics.jsonl then always means a resumable round.
        self.save_state(rnd, row["wall_time_s"])
        self.recorder.log_round(row)

    # --- synchronous rounds ------------------------------------------------------
    def run_rounds(self) -> None:
        strategy, grid, cfg = self.strategy, self.grid, self.cfg
        assert isinstance(strategy, FedAvg)
        timeout = cfg.federation.round_timeout_s
        for rnd in range(self.first_round, cfg.federation.rounds + 1):
            t0 = time.time()
            config = ConfigRecord(self.client_config)
            replies = list(
                grid.send_and_receive(strategy.configure_train(rnd, self.arrays, config, grid), timeout=timeout)
            )
            new_arrays, train_metrics = strategy.aggregate_train(rnd, replies)
            client_metrics = reply_metrics(replies)
            self.record_spending(client_metrics)
            if self.local_dp is not None or (self.dp is not None and cfg.federation.fraction_evaluate > 0):
                # Spending that has left the server (local DP: the clients' steps; central DP: the release,
                # once federated evaluation sends it out) goes on record before anything else can crash:
                # the previous model with this round's spending, so a crash before the round's own
                # checkpoint re-runs the round, charged twice, never zero times. A central release that
                # nobody has seen yet needs no such record: re-running its round releases it afresh.
                self.save_state(rnd - 1, self.elapsed())
            report = strategy.train_report
            if new_arrays is not None:
                self.arrays = new_arrays
            fed_eval: MetricRecord | None = None
            if cfg.federation.fraction_evaluate > 0:
                eval_msgs = strategy.configure_evaluate(rnd, self.arrays, ConfigRecord(self.client_config), grid)
                fed_eval = strategy.aggregate_evaluate(rnd, grid.send_and_receive(eval_msgs, timeout=timeout))
            loss, acc = self.central_eval(self.arrays)
            row = {
                "round": rnd,
                "accuracy": acc,
                "loss": loss,
                "wall_time_s": self.elapsed(),
                "round_time_s": time.time() - t0,
                "num_sampled": report.sampled,
                "num_clients": len(report.accepted),
                "num_rejected": len(report.rejected),
                "num_missing": report.sampled - len(replies),
                "model_updated": new_arrays is not None,
                "rejected": [{"node_id": r.node_id, "reason": r.reason} for r in report.rejected],
                "capped_weights": report.capped,
                "robust": report.robust_row() if isinstance(strategy, RobustStrategy) else None,
                "node_partitions": node_partitions(client_metrics),
                "train": dict(train_metrics) if train_metrics else {},
                "federated_eval": dict(fed_eval) if fed_eval else {},
            }
            self.finish_round(rnd, self.reported(row))
            log.info(
                "[round %d/%d] accuracy %.4f  loss %.4f  %.1fs  clients %d  rejected %d%s",
                rnd,
                cfg.federation.rounds,
                acc,
                loss,
                row["round_time_s"],
                row["num_clients"],
                row["num_rejected"],
                f"  missing {row['num_missing']}" if row["num_missing"] else "",
            )
            if self.should_stop(rnd, acc):
                break

    # --- asynchronous versions (FedBuff) ---------------------------------------------
    def run_versions(self) -> None:
        strategy, cfg = self.strategy, self.cfg
        assert isinstance(strategy, FedBuff)
        budget = cfg.federation.max_wall_time_s
        last = time.time()

        def on_version(report: VersionReport, arrays: ArrayRecord) -> bool:
            nonlocal last
            self.record_spending(report.client_metrics)
            self.arrays = arrays
            v = report.version
            evaluate_now = (
                v % cfg.strategy.eval_every == 0
                or v >= cfg.federation.rounds
                or bool(budget and self.elapsed() >= budget)
            )
            loss, acc = self.central_eval(arrays) if evaluate_now else (None, None)
            now = time.time()
            row = {
                "round": v,
                "version": v,
                "accuracy": acc,
                "loss": loss,
                "wall_time_s": self.elapsed(),
                "round_time_s": now - last,
                "num_clients": len(report.applied),
                "staleness": [u["staleness"] for u in report.applied],
                "applied": report.applied,
                "num_discarded_stale": report.discarded_stale,
                "num_rejected": len(report.rejected),
                "num_failed": len(report.failed),
                "rejected": [{"node_id": r.node_id, "reason": r.reason} for r in report.rejected],
                "failed": [{"node_id": r.node_id, "reason": r.reason} for r in report.failed],
                "robust": report.robust,
                "tasks_sent": strategy.tasks_sent,
                "train": dict(report.metrics) if report.metrics else {},
            }
            last = now
            self.finish_round(v, self.reported(row))
            log.info(
                "[version %d/%d] %s  %.1fs  staleness %s  discarded %d  rejected %d  failed %d",
                v,
                cfg.federation.rounds,
                f"accuracy {acc:.4f}  loss {loss:.4f}" if acc is not None else "(not evaluated)",
                row["round_time_s"],
                row["staleness"],
                report.discarded_stale,
                len(report.rejected),
                len(report.failed),
            )
            return self.should_stop(v, acc)

        deadline = time.monotonic() + budget - self.elapsed() if budget else None
        self.arrays = strategy.run(
            self.grid,
            self.arrays,
            self.client_config,
            on_version,
            first_version=self.first_round - 1,
            deadline=deadline,
            drain=self.local_dp is not None,
        )
        if self.local_dp is not None and strategy.report.client_metrics:
            # Replies after the last version (and the tasks still out at the stop, drained) spent their
            # steps too: on record and checkpointed.
            self.record_spending(strategy.report.client_metrics)
            self.save_state(strategy.version, self.elapsed())
        if deadline is not None and time.monotonic() >= deadline:
            self.stop_reason = f"wall-clock budget {budget:.0f} s spent"

    def final_evaluation(self) -> dict[str, Any]:
        """The final model's accuracy when the last row did not evaluate it.

        A FedBuff run can stop between evaluations (`strategy.eval_every` > 1) or before
        its first version (a wall-clock budget spent on the first tasks); it still reports
        the model it ends with, the initial one if nothing was applied.
        """
        rows = self.recorder.rows
        if rows and rows[-1].get("accuracy") is not None:
            return {}
        loss, acc = self.central_eval(self.arrays)
        log.info("final model, not evaluated by the last recorded step: accuracy %.4f, loss %.4f", acc, loss)
        return {"final_accuracy": acc, "final_loss": loss}

    def run(self) -> dict[str, Any]:
        status = "failed"
        try:
            try:
                if isinstance(self.strategy, FedBuff):
                    self.run_versions()
                else:
                    self.run_rounds()
            except PrivacyBudgetExhausted as err:
                self.stop_reason = str(err)
                log.warning("stopping: %s; the saved model is the last one released within the budget", err)
            status = "completed"
        finally:
            torch.save(self.arrays.to_torch_state_dict(), self.recorder.final_model_path)
            cfg = self.cfg
            extra: dict[str, Any] = {
                "strategy": cfg.strategy.name,
                "dataset": cfg.dataset.name,
                "model": cfg.model.name,
                "num_nodes": len(self.nodes),
                "stop_reason": self.stop_reason if status == "completed" else None,
                "attack": {**asdict(cfg.attack), "malicious_partitions": self.attacked},
                "stragglers": {**asdict(cfg.stragglers), "slowdown_per_partition": self.slowdowns},
                "privacy": self.privacy_summary(),
                "final_model": str(self.recorder.final_model_path),
                "checkpoint": str(self.recorder.checkpoint_path),
            }
            if isinstance(self.strategy, FedBuff):
                extra["fedbuff"] = {
                    "versions": self.strategy.version,
                    "tasks_sent": self.strategy.tasks_sent,
                    "discarded_stale": self.strategy.discarded_total,
                }
            if status == "completed":
                extra.update(self.final_evaluation())
            summary = self.recorder.finish(status, self.elapsed(), extra)
            log.info("run %s: final accuracy %s, results: %s", status, summary["final_accuracy"], self.recorder.run_dir)
        return summary


def run_federation(grid: Grid, cfg: Config, raw: DictConfig, root: Path) -> dict[str, Any]:
    """Train for `federation.rounds` rounds or versions (or the rest of them after `resume`)."""
    return FederatedRun(grid, cfg, raw, root).run()
