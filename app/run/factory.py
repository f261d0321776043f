"""From the config to the objects a run is made of: the strategy (with its central-DP
mechanism or robust rule), the cap on each reply's weight, the privacy book-keeping, and
the start-up checks that the cohort can ever satisfy them."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, MessageType, MetricRecord

from app.compression.downlink import Downlink
from app.compression.wire import NodeModel, unpack
from app.config.schema import ROBUST_RULES, STRATEGIES, CompressionConfig, Config, ConfigError, StrategyConfig
from app.privacy.accounting import Prescription
from app.protocol import PARTITION_ID
from app.run.privacy import CentralPrivacy, LocalPrivacy, NoPrivacy, RunPrivacy
from app.task.data import DataSpec, partition_indices, validation_size
from app.task.models import build_model, check_fits, freeze, load_init_weights
from strategies.central_dp import AdaptiveClip, CentralDP, DPFedAvg, DPFedBuff, cohort_sensitivity
from strategies.coordinatewise import CoordinateMedian, MedianRule, TrimmedMean, TrimmedMeanRule
from strategies.fedavg import FedAvg
from strategies.fedbuff import FedBuff
from strategies.krum import Krum, KrumRule, MultiKrum, MultiKrumRule
from strategies.partitions import PartitionBinding
from strategies.replies import WeightCap
from strategies.robust import RobustRule, RobustStrategy
from strategies.staleness import staleness_fn


def global_model(cfg: Config, spec: DataSpec, probe: torch.Tensor) -> torch.nn.Module:
    """The model the server holds, checked before round 1: `model.init_weights` loaded into it,
    and a forward pass on `probe` (two of the data's examples, as the training loop feeds
    them) that must give one row of `num_classes` outputs each. Under local DP the clients
    train the Opacus-compatible variant (`make_private_compatible`, after the weights are
    loaded: a BatchNorm it replaces loses them), so the server's has the same keys."""
    model = build_model(cfg.model, spec)
    if cfg.model.init_weights:
        load_init_weights(model, cfg.model.init_weights)
    freeze(model, cfg.model.trainable)  # Opacus checks and fixes only the layers that train
    if cfg.privacy.name == "local":
        from app.privacy.dp_sgd import make_private_compatible  # Opacus: only where local DP needs it

        model = make_private_compatible(model)
    check_fits(model, cfg.model, spec, probe)
    return model


def robust_rule(name: str, st: StrategyConfig, device: torch.device) -> RobustRule:
    """The robust rule `name` with f, m, the trim ratio and the too-few policy from the config."""
    common: dict[str, Any] = {"num_byzantine": st.num_byzantine, "on_too_few": st.on_too_few, "device": device}
    if name == "krum":
        return KrumRule(**common)
    if name == "multikrum":
        return MultiKrumRule(num_selected=st.num_selected, **common)
    if name == "median":
        return MedianRule(**common)
    return TrimmedMeanRule(trim_ratio=st.trim_ratio, **common)


def robust_strategy(name: str, st: StrategyConfig, sampling: dict[str, Any]) -> RobustStrategy:
    """The synchronous strategy of the robust rule `name` (its class name shows in logs and summary)."""
    common: dict[str, Any] = {"num_byzantine": st.num_byzantine, "on_too_few": st.on_too_few, **sampling}
    if name == "krum":
        return Krum(**common)
    if name == "multikrum":
        return MultiKrum(num_selected=st.num_selected, **common)
    if name == "median":
        return CoordinateMedian(**common)
    return TrimmedMean(trim_ratio=st.trim_ratio, **common)


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
    """The configured strategy; robust ones get their rule, central DP its mechanism."""
    f, st = cfg.federation, cfg.strategy
    sampling: dict[str, Any] = {
        "fraction_train": f.fraction_train,
        "min_train_nodes": f.min_train_nodes,
        "fraction_evaluate": f.fraction_evaluate,
        "min_evaluate_nodes": f.min_evaluate_nodes,
        "min_available_nodes": f.min_available_nodes,
        "message_ttl_s": f.message_ttl_s,
        "device": device,
    }
    dp = central_dp(cfg)
    if st.name == "fedavg":
        return FedAvg(**sampling) if dp is None else DPFedAvg(dp=dp, poisson=cfg.privacy.poisson_sampling, **sampling)
    if st.name in ROBUST_RULES:
        return robust_strategy(st.name, st, sampling)
    if st.name != "fedbuff":
        raise ConfigError(f"strategy.name={st.name!r} is invalid: allowed: {', '.join(STRATEGIES)}")
    buffer: dict[str, Any] = {
        "buffer_size": st.buffer_size,
        "concurrency": st.concurrency,
        "max_staleness": st.max_staleness,
        "staleness": staleness_fn(st.staleness_fn, st.staleness_a, st.staleness_b),
        "staleness_name": st.staleness_fn,
        "server_lr": st.server_lr,
        "server_momentum": st.server_momentum,
        # One training task may take round_timeout_s; its message lives no longer.
        "message_ttl_s": f.round_timeout_s,
        "device": device,
    }
    if dp is not None:  # validation allows central DP only with the mean buffer
        return DPFedBuff(dp=dp, **buffer)
    rule = None if st.buffer_aggregator == "mean" else robust_rule(st.buffer_aggregator, st, device)
    if rule is not None and st.buffer_size and (problem := rule.too_few(st.buffer_size)):
        raise ConfigError(f"strategy.buffer_size={st.buffer_size} is too small for the robust buffer: {problem}")
    return FedBuff(buffer_rule=rule, **buffer)


def partition_sizes(cfg: Config, labels: np.ndarray, num_partitions: int) -> Callable[[int], tuple[int, int]]:
    """partition -> (training, validation) examples of a simulated node, computed the way the
    ClientApp splits its data (`partition_indices`, `validation_size`), once per partition."""

    @functools.cache
    def train_and_validation(partition: int) -> tuple[int, int]:
        n = len(partition_indices(labels, num_partitions, partition, cfg.partition, cfg.seed))
        held_out = validation_size(n, cfg.dataset.val_fraction)
        return n - held_out, held_out

    return train_and_validation


def example_cap(cfg: Config, labels: np.ndarray, binding: PartitionBinding) -> WeightCap:
    """The most examples a node's reply may count for (its FedAvg / FedBuff weight).

    `federation.max_examples_per_node` for every node; a node bound to a simulated
    partition is held to what that partition really has: its training part for
    training replies, its validation part for evaluation replies. Sizes are computed
    by `partition_sizes`, when a node first claims it.
    """
    limit = cfg.federation.max_examples_per_node
    train_and_validation = partition_sizes(cfg, labels, binding.num_partitions)

    def cap(node_id: int, metrics: MetricRecord, kind: str) -> float:
        partition = binding.bind(node_id, metrics.get(PARTITION_ID))
        if partition is None:
            return limit
        train, validation = train_and_validation(partition)
        return min(limit, train if kind == MessageType.TRAIN else validation)

    return cap


class TimedUnpack:
    """`wire.unpack` for the strategy (an `Unpack`), timing itself: the server's cost of checking
    and unpacking compressed replies, for the step's row (`take`). Building dense tensors from
    them, or FedAvg's adds into its mean, happens later and counts as aggregation."""

    def __init__(self, cfg: CompressionConfig) -> None:
        self.cfg, self.seconds = cfg, 0.0

    def __call__(self, record: ArrayRecord, base: dict[str, torch.Tensor]) -> NodeModel:
        started = time.perf_counter()
        try:
            return unpack(record, base, self.cfg)
        finally:
            self.seconds += time.perf_counter() - started

    def take(self) -> float:
        """The seconds since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def uplink_decoder(cfg: CompressionConfig) -> TimedUnpack | None:
    """How the strategy gets a node's model from a compressed reply (None: replies carry the model).
    With a compressed downlink replies are updates even when `name` is none (sent exactly)."""
    if cfg.name == "none" and cfg.downlink == "none":
        return None
    return TimedUnpack(cfg)


def downlink_encoder(cfg: CompressionConfig, seed: int) -> Downlink | None:
    """How the strategy's training tasks carry the global model (None: as it is)."""
    return Downlink(cfg, seed) if cfg.downlink != "none" else None


def check_cohort(cfg: Config, strategy: FedAvg | FedBuff, num_nodes: int) -> None:
    """Before the first round: can the connected nodes ever satisfy the strategy and the attack?
    (FedBuff's K is chosen here when strategy.buffer_size=0: it depends on the nodes.)"""
    if isinstance(strategy, FedBuff):
        strategy.size_buffer(num_nodes)
    if problem := strategy.node_count_problem(num_nodes):
        raise ConfigError(problem)
    if cfg.attack.num_malicious > num_nodes:
        raise ConfigError(f"attack.num_malicious={cfg.attack.num_malicious} is invalid: only {num_nodes} nodes")


def run_privacy(
    cfg: Config, strategy: FedAvg | FedBuff, partitions: PartitionBinding, state: dict[str, Any]
) -> RunPrivacy:
    """The run's privacy book-keeping for `privacy.name`; local DP also gives the strategy each
    node's own accountant history to send (`strategy.node_config`) and, around its weight cap
    (set before this), the check that rejects a reply whose history the server would refuse."""
    p = cfg.privacy
    if p.name == "local":
        local = LocalPrivacy(p, partitions, state.get("local_dp"), Prescription.of(cfg))
        strategy.node_config = local.prior
        strategy.weight_cap = local.screening(strategy.weight_cap)
        return local
    dp: CentralDP | None = getattr(strategy, "dp", None)
    return NoPrivacy() if dp is None else CentralPrivacy(dp, p.report_exact)
