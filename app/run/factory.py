"""From the config to the objects a run is made of: the strategy (with its central-DP
mechanism or robust rule), the cap on each reply's weight, the privacy book-keeping, and
the start-up checks that the cohort can ever satisfy them."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, MessageType, MetricRecord

from app.compression.downlink import Downlink
from app.compression.packing import NodeModel, unpack
from app.config.registry import Registry
from app.config.schema import (
    DISTRIBUTED_PRIVACY,
    PRIVACY,
    ROBUST_RULES,
    STRATEGIES,
    CompressionConfig,
    Config,
    ConfigError,
    StrategyConfig,
)
from app.privacy.accounting import Prescription
from app.protocol import PARTITION_ID
from app.regions.wan import WanCodec
from app.run.privacy import CentralPrivacy, DistributedPrivacy, LocalPrivacy, NoPrivacy, RunPrivacy
from app.secagg.dp import DistributedDP
from app.secagg.ring import Ring
from app.secagg.strategy import SecAggSettings, SecureFedAvg
from app.task.data import DataSpec, partition_indices, validation_size
from app.task.models import build_model, check_fits, freeze, load_init_weights
from strategies.central_dp import AdaptiveClip, CentralDP, DPFedAvg, DPFedBuff, cohort_sensitivity
from strategies.fedavg import FedAvg
from strategies.fedbuff import FEDBUFF_SERVER_LR, FedBuff
from strategies.interface import ServerStrategy
from strategies.node_names import NodeNames
from strategies.norm_bound import NormBound
from strategies.partitions import PartitionBinding
from strategies.regional import RegionalCombine
from strategies.registry import rule_class
from strategies.replies import WeightCap
from strategies.robust import RobustRule, RobustStrategy
from strategies.scaffold import Scaffold
from strategies.server_opt import DEFAULT_LR, ServerOptimizer
from strategies.settings import ReplyLimits, Sampling, TaskWiring
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
    """The robust rule registered as `name` (strategies/registry.py), built from strategy.*."""
    return rule_class(name).from_config(st, device)


def regional_combine(
    cfg: Config,
    partition_of: Callable[[int], int | None],
    region_of_partition: list[int],
    device: torch.device,
    secagg: SecAggSettings | None = None,
) -> RegionalCombine | None:
    """topology=regions in simulation, without central DP (whose one sum needs no grouping): the
    regions' combine, with the inner rule (`topology.region_rule`, f = `topology.region_byzantine`)
    and the WAN codec (`topology.wan_compression`); with `secagg` (SecAgg+ inside each region)
    every region must be able to run a secure round with all its sites."""
    t = cfg.topology
    if t.name != "regions" or cfg.privacy.name.startswith("central"):
        return None
    inner = replace(cfg.strategy, num_byzantine=t.region_byzantine)
    regions = max(region_of_partition) + 1
    combine = RegionalCombine(
        lambda node: region_of_partition[p] if (p := partition_of(node)) is not None else None,
        regions,
        rule=None if t.region_rule == "mean" else robust_rule(t.region_rule, inner, device),
        wan=None if t.wan_compression == "none" else WanCodec(t.wan_compression, cfg.seed),
        device=device,
    )
    sizes = {r: region_of_partition.count(r) for r in range(regions)}
    if secagg is not None and (
        problems := [f"region {r} ({m} sites): {why}" for r, m in sizes.items() if (why := secagg.group_problem(m))]
    ):
        raise ConfigError(
            "secagg=plus runs inside each region, whose aggregator must learn only a sum of its sites' updates: "
            + "; ".join(problems)
            + ": put at least 2 sites (and secagg.threshold of them) in each region"
        )
    if problems := combine.problems(sizes):
        raise ConfigError(
            f"topology.region_rule={t.region_rule} with topology.region_byzantine={t.region_byzantine}: "
            + "; ".join(problems)
            + ": put more sites in each region, tolerate fewer faulty ones, or use topology.region_rule=mean"
        )
    return combine


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


def secure_aggregation(
    cfg: Config, dim: int, largest_partition: int | None
) -> tuple[SecAggSettings | None, DistributedDP | None]:
    """secagg=plus's settings and, with privacy=distributed*, its DP plan (None, None: secagg=none).
    The weights' cap: secagg.max_weight, else the largest simulated partition (the server knows
    them: no weight is cut, and the smallest keep their precision in the ring), else
    federation.max_examples_per_node."""
    sa = cfg.secagg
    if sa.name == "none":
        return None, None
    ring = Ring(sa.clipping_range, sa.quantization_range, sa.modulus_range)
    cap = sa.max_weight or largest_partition or cfg.federation.max_examples_per_node
    settings = SecAggSettings(ring, sa.threshold, sa.degree, float(cap), sa.on_too_few, cfg.compression.name == "int8")
    p = cfg.privacy
    if p.name not in DISTRIBUTED_PRIVACY:
        return settings, None
    dp = DistributedDP(
        noise_multiplier=p.noise_multiplier,
        clip_norm=p.clip_norm,
        delta=p.delta,
        ring=ring,
        dim=dim,
        max_epsilon=p.max_epsilon,
        adaptive=p.name == "distributed_adaptive",
        target_quantile=p.target_quantile,
        clip_lr=p.clip_lr,
        count_noise=p.count_noise,
    )
    return settings, dp


def sampling_of(cfg: Config) -> Sampling:
    """Who a round asks, how long it waits for them, and the strategy sampler's seed."""
    f = cfg.federation
    return Sampling(
        fraction_train=f.fraction_train,
        min_train_nodes=f.min_train_nodes,
        fraction_evaluate=f.fraction_evaluate,
        min_evaluate_nodes=f.min_evaluate_nodes,
        min_available_nodes=f.min_available_nodes,
        round_wait_timeout_s=f.round_wait_timeout_s,
        seed=cfg.seed,
    )


@dataclass(frozen=True)
class StrategyParts:
    """What `build_strategy` hands every strategy besides its own config section."""

    device: torch.device
    dp: CentralDP | None
    limits: ReplyLimits
    wiring: TaskWiring
    secagg: SecAggSettings | None = None  # secagg=plus
    distributed: DistributedDP | None = None  # privacy=distributed*: each node's noise and the accountant
    regions: RegionalCombine | None = None  # topology=regions in simulation: the regions' combine


def _fedavg(cfg: Config, parts: StrategyParts) -> FedAvg:
    common: dict[str, Any] = {
        "sampling": sampling_of(cfg),
        "limits": parts.limits,
        "wiring": parts.wiring,
        "server_opt": server_optimizer(cfg),
    }
    if parts.secagg is not None:
        return SecureFedAvg(
            secagg=parts.secagg, dp=parts.distributed, device=parts.device, regions=parts.regions, **common
        )
    if parts.dp is None:
        return FedAvg(device=parts.device, regions=parts.regions, norm_bound=norm_bound(cfg), **common)
    # Central DP with regions: every client's update clipped, summed and noised once, computed as one
    # sum; the regions' sums of clipped updates add up to the same release (docs/fleet.md#regions).
    return DPFedAvg(dp=parts.dp, poisson=cfg.privacy.poisson_sampling, device=parts.device, **common)


def norm_bound(cfg: Config) -> NormBound | None:
    """strategy.norm_bound for a plain mean (None: 0, off). Central DP clips every update itself,
    SecAgg+ shows the server no update, and a robust rule is its own defence: none of them has one."""
    st = cfg.strategy
    return NormBound(st.norm_bound, clip=st.norm_bound_action == "clip") if st.norm_bound else None


def server_optimizer(cfg: Config) -> ServerOptimizer | None:
    """strategy.server_optimizer of a synchronous strategy (None: the aggregate is the new model);
    strategy.server_lr 0 takes the optimizer's default η."""
    st = cfg.strategy
    if st.server_optimizer == "none":
        return None
    return ServerOptimizer(
        st.server_optimizer,
        lr=st.server_lr or DEFAULT_LR[st.server_optimizer],
        momentum=st.server_momentum,
        beta1=st.server_beta1,
        beta2=st.server_beta2,
        tau=st.server_tau,
    )


def _scaffold(cfg: Config, parts: StrategyParts) -> Scaffold:
    return Scaffold(
        sampling=sampling_of(cfg),
        limits=parts.limits,
        wiring=parts.wiring,
        device=parts.device,
        server_opt=server_optimizer(cfg),
        norm_bound=norm_bound(cfg),
    )


def _robust(cfg: Config, parts: StrategyParts) -> RobustStrategy:
    return RobustStrategy(
        rule=robust_rule(cfg.strategy.name, cfg.strategy, parts.device),
        sampling=sampling_of(cfg),
        limits=parts.limits,
        wiring=parts.wiring,
        device=parts.device,
        regions=parts.regions,
        server_opt=server_optimizer(cfg),
    )


def _fedbuff(cfg: Config, parts: StrategyParts) -> FedBuff:
    st = cfg.strategy
    buffer: dict[str, Any] = {
        "buffer_size": st.buffer_size,
        "concurrency": st.concurrency,
        "max_staleness": st.max_staleness,
        "staleness": staleness_fn(st.staleness_fn, st.staleness_a, st.staleness_b),
        "staleness_name": st.staleness_fn,
        "server_lr": st.server_lr or FEDBUFF_SERVER_LR,
        "server_momentum": st.server_momentum,
        "sampling": sampling_of(cfg),
        # One training task may take round_timeout_s; its message lives no longer.
        "limits": replace(parts.limits, message_ttl_s=cfg.federation.round_timeout_s),
        "wiring": parts.wiring,
        "device": parts.device,
        "stall_versions": cfg.federation.stall_rounds,
    }
    if parts.dp is not None:  # validation allows central DP only with the mean buffer, no server optimizer
        return DPFedBuff(dp=parts.dp, **buffer)
    buffer["server_opt"] = server_optimizer(cfg)
    rule = None if st.buffer_aggregator == "mean" else robust_rule(st.buffer_aggregator, st, parts.device)
    if rule is not None and st.buffer_size and (problem := rule.too_few(st.buffer_size)):
        raise ConfigError(f"strategy.buffer_size={st.buffer_size} is too small for the robust buffer: {problem}")
    return FedBuff(buffer_rule=rule, norm_bound=norm_bound(cfg) if rule is None else None, **buffer)


_STRATEGIES: Registry[Callable[[Config, StrategyParts], ServerStrategy]] = Registry(
    "strategy.name",
    STRATEGIES,
    {
        "fedavg": _fedavg,
        "ditto": _fedavg,
        "fedbuff": _fedbuff,
        "scaffold": _scaffold,
        **dict.fromkeys(ROBUST_RULES, _robust),
    },
)


def build_strategy(cfg: Config, parts: StrategyParts) -> ServerStrategy:
    """The configured strategy, built once with everything it needs: robust ones get their rule
    from the registry, central DP its mechanism (`parts.dp`)."""
    return _STRATEGIES[cfg.strategy.name](cfg, parts)


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
    """`packing.unpack` for the strategy (an `Unpack`), timing itself: the server's cost of checking
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


def check_cohort(cfg: Config, strategy: ServerStrategy, num_nodes: int) -> None:
    """Before the first round: can the connected nodes ever satisfy the strategy and the attack?
    (FedBuff's K is chosen here when strategy.buffer_size=0: it depends on the nodes.)"""
    if strategy.asynchronous:
        strategy.size_buffer(num_nodes)  # type: ignore[attr-defined] - a BufferStrategy
    if problem := strategy.node_count_problem(num_nodes):
        raise ConfigError(problem)
    if cfg.attack.num_malicious > num_nodes:
        raise ConfigError(f"attack.num_malicious={cfg.attack.num_malicious} is invalid: only {num_nodes} nodes")


def _no_privacy(
    cfg: Config, dp: CentralDP | None, partitions: PartitionBinding, state: dict, names: NodeNames
) -> RunPrivacy:
    return NoPrivacy()


def _local_privacy(
    cfg: Config, dp: CentralDP | None, partitions: PartitionBinding, state: dict, names: NodeNames
) -> RunPrivacy:
    return LocalPrivacy(cfg.privacy, partitions, state.get("local_dp"), Prescription.of(cfg), names)


def _central_privacy(
    cfg: Config, dp: CentralDP | None, partitions: PartitionBinding, state: dict, names: NodeNames
) -> RunPrivacy:
    assert dp is not None  # central_dp(cfg) for a central privacy.name
    return CentralPrivacy(dp, cfg.privacy.report_exact)


def _distributed_privacy(
    cfg: Config, dp: CentralDP | DistributedDP | None, partitions: PartitionBinding, state: dict, names: NodeNames
) -> RunPrivacy:
    assert isinstance(dp, DistributedDP)  # secure_aggregation(cfg, ...) for a distributed privacy.name
    return DistributedPrivacy(dp)


_PRIVACY: Registry[Callable[..., RunPrivacy]] = Registry(
    "privacy.name",
    PRIVACY,
    {
        "none": _no_privacy,
        "local": _local_privacy,
        "central": _central_privacy,
        "central_adaptive": _central_privacy,
        **dict.fromkeys(DISTRIBUTED_PRIVACY, _distributed_privacy),
    },
)


def run_privacy(
    cfg: Config,
    dp: CentralDP | DistributedDP | None,
    partitions: PartitionBinding,
    state: dict[str, Any],
    names: NodeNames,
) -> RunPrivacy:
    """The run's privacy book-keeping for `privacy.name`, chosen once: the loops, the strategy's
    weight cap (`screening`) and its per-node task keys (`node_config`) ask it, never the name."""
    return _PRIVACY[cfg.privacy.name](cfg, dp, partitions, state, names)
