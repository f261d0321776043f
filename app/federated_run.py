"""The synchronous round loop behind the ServerApp, with results and checkpoints.

Flower's `Strategy.start` cannot resume from a round or write a checkpoint between
rounds, so the loop lives here; it drives any strategy through the same
configure/aggregate calls.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from omegaconf import DictConfig

from app.attacks import malicious_partitions
from app.checkpoint import Checkpoint, capture_rng, load_checkpoint, restore_rng, save_checkpoint
from app.config import STRATEGIES, Config, ConfigError, to_client_record
from app.data import check_partitioning, data_spec, load_splits, materialize, spec_to_record
from app.models import build_model
from app.results import RunRecorder, new_run_dir
from app.training import evaluate, resolve_device, resolve_precision
from strategies.coordinatewise import CoordinateMedian, TrimmedMean
from strategies.fedavg import FedAvg
from strategies.krum import Krum, MultiKrum
from strategies.robust import RobustStrategy

log = logging.getLogger("flwr.fedgpu." + __name__)


def build_strategy(cfg: Config, device: torch.device) -> FedAvg:
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
    robust = {**common, "num_byzantine": st.num_byzantine, "on_too_few": st.on_too_few}
    if st.name == "fedavg":
        return FedAvg(**common)
    if st.name == "krum":
        return Krum(**robust)
    if st.name == "multikrum":
        return MultiKrum(num_selected=st.num_selected, **robust)
    if st.name == "median":
        return CoordinateMedian(**robust)
    if st.name == "trimmed_mean":
        return TrimmedMean(trim_ratio=st.trim_ratio, **robust)
    raise ConfigError(f"strategy.name={st.name!r} is invalid: allowed: {', '.join(STRATEGIES)}")


def check_cohort(cfg: Config, strategy: FedAvg, num_nodes: int) -> int:
    """Before the first round: can the rounds' cohort ever satisfy the strategy and attack?"""
    f = cfg.federation
    cohort = min(num_nodes, max(int(num_nodes * f.fraction_train), f.min_train_nodes))
    if isinstance(strategy, RobustStrategy) and (problem := strategy.cohort_problem(cohort)):
        raise ConfigError(
            f"{problem} ({num_nodes} nodes, federation.fraction_train={f.fraction_train}, "
            f"federation.min_train_nodes={f.min_train_nodes}); use more nodes or tolerate fewer Byzantine clients"
        )
    if cfg.attack.num_malicious > num_nodes:
        raise ConfigError(f"attack.num_malicious={cfg.attack.num_malicious} is invalid: only {num_nodes} nodes")
    return cohort


def node_partitions(replies: list[Message]) -> dict[str, int]:
    """node id -> partition id, as simulated nodes report it (for reading attack results)."""
    out = {}
    for msg in replies:
        if not msg.has_error():
            for record in msg.content.metric_records.values():
                if isinstance(record.get("partition-id"), int):
                    out[str(msg.metadata.src_node_id)] = record["partition-id"]
    return out


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


def run_federation(grid: Grid, cfg: Config, raw: DictConfig, root: Path) -> dict[str, Any]:
    """Train for `federation.rounds` rounds (or the rest of them after `resume`)."""
    started = time.time()
    device = resolve_device(cfg.server_device)
    precision = resolve_precision("off", device)
    train_source, test_source = load_splits(cfg.dataset, cfg.seed)
    spec = data_spec(train_source, test_source)
    test_data = materialize(test_source)

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)  # Flower's node sampling draws from Python's `random`
    model = build_model(cfg.model, spec)
    arrays = ArrayRecord(model.state_dict())
    strategy = build_strategy(cfg, device)
    first_round, elapsed_before = 1, 0.0
    nodes = _wait_for_nodes(grid, cfg.federation.min_available_nodes, cfg.federation.node_wait_timeout_s)
    check_partitioning(len(train_source.labels), len(nodes), cfg.partition)
    check_cohort(cfg, strategy, len(nodes))
    if cfg.resume:
        ckpt = load_checkpoint(cfg.resume)
        _check_compatible(ckpt, model, cfg.resume)
        if ckpt.round >= cfg.federation.rounds:
            raise ConfigError(
                f"resume={cfg.resume}: round {ckpt.round} already reached federation.rounds={cfg.federation.rounds}"
            )
        arrays = ArrayRecord(ckpt.state_dict)
        strategy.load_state_dict(ckpt.strategy_state)
        restore_rng(ckpt.rng)
        first_round, elapsed_before = ckpt.round + 1, ckpt.wall_time_s
        recorder = RunRecorder(Path(cfg.resume).parent, resumed_after=ckpt.round)
    else:
        recorder = RunRecorder(new_run_dir(root, cfg.name, cfg.strategy.name, cfg.dataset.name))
    recorder.save_config(raw)
    log.info("results: %s", recorder.run_dir)
    strategy.summary()
    log.info(
        "%d nodes, %d train / %d test examples, model %s (%d parameters), rounds %d..%d",
        len(nodes),
        len(train_source.labels),
        len(test_data),
        cfg.model.name,
        sum(p.numel() for p in model.parameters()),
        first_round,
        cfg.federation.rounds,
    )
    attacked = malicious_partitions(cfg.seed, len(nodes), cfg.attack.num_malicious) if cfg.attack.name != "none" else []
    if attacked:
        log.info("attack %s: malicious partitions %s (scale %s)", cfg.attack.name, attacked, cfg.attack.scale)
    client_config = {**to_client_record(cfg), **spec_to_record(spec)}
    timeout = cfg.federation.round_timeout_s

    def central_eval(current: ArrayRecord) -> tuple[float, float]:
        model.load_state_dict(current.to_torch_state_dict())
        return evaluate(model.to(device), test_data, precision)

    status = "failed"
    try:
        for rnd in range(first_round, cfg.federation.rounds + 1):
            t0 = time.time()
            replies = list(
                grid.send_and_receive(
                    strategy.configure_train(rnd, arrays, ConfigRecord(client_config), grid), timeout=timeout
                )
            )
            new_arrays, train_metrics = strategy.aggregate_train(rnd, replies)
            report = strategy.train_report
            if new_arrays is not None:
                arrays = new_arrays
            fed_eval: MetricRecord | None = None
            if cfg.federation.fraction_evaluate > 0:
                eval_msgs = strategy.configure_evaluate(rnd, arrays, ConfigRecord(client_config), grid)
                fed_eval = strategy.aggregate_evaluate(rnd, grid.send_and_receive(eval_msgs, timeout=timeout))
            loss, acc = central_eval(arrays)
            now = time.time()
            row = {
                "round": rnd,
                "accuracy": acc,
                "loss": loss,
                "wall_time_s": elapsed_before + now - started,
                "round_time_s": now - t0,
                "num_sampled": report.sampled,
                "num_clients": len(report.accepted),
                "num_rejected": len(report.rejected),
                "num_missing": report.sampled - len(replies),
                "model_updated": new_arrays is not None,
                "rejected": [{"node_id": r.node_id, "reason": r.reason} for r in report.rejected],
                "robust": report.robust_row() if isinstance(strategy, RobustStrategy) else None,
                "node_partitions": node_partitions(replies),
                "train": dict(train_metrics) if train_metrics else {},
                "federated_eval": dict(fed_eval) if fed_eval else {},
            }
            recorder.log_round(row)
            save_checkpoint(
                recorder.checkpoint_path,
                Checkpoint(arrays.to_torch_state_dict(), rnd, strategy.state_dict(), capture_rng(), row["wall_time_s"]),
            )
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
        status = "completed"
    finally:
        torch.save(arrays.to_torch_state_dict(), recorder.final_model_path)
        summary = recorder.finish(
            status,
            elapsed_before + time.time() - started,
            {
                "strategy": cfg.strategy.name,
                "dataset": cfg.dataset.name,
                "model": cfg.model.name,
                "num_nodes": len(nodes),
                "attack": {**asdict(cfg.attack), "malicious_partitions": attacked},
                "final_model": str(recorder.final_model_path),
                "checkpoint": str(recorder.checkpoint_path),
            },
        )
        log.info("run %s: final accuracy %s, results: %s", status, summary["final_accuracy"], recorder.run_dir)
    return summary
