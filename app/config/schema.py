"""The config schema: one dataclass per section of `conf/`, and the allowed values.

OmegaConf checks types against these dataclasses (`app.config.compose`), `app.config.validate`
checks ranges. Nothing here imports Hydra: the ClientApp rebuilds its sections from a
message (`app.protocol`) with these classes alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The robust rules' names and too-few policies belong to the strategies (an import-free module).
from strategies.registry import POLICIES, ROBUST_RULES

STRATEGIES = ("fedavg", *ROBUST_RULES, "fedbuff", "scaffold", "ditto")
BUFFER_AGGREGATORS = ("mean", *ROBUST_RULES)
STRAGGLERS = ("none", "fixed", "lognormal")
FLEET_SPEEDS = ("uniform", "fixed", "lognormal", "devices")  # app/simulation/fleet.py
AVAILABILITY = ("always", "bernoulli", "trace")
PRIVACY = ("none", "central", "central_adaptive", "local", "distributed", "distributed_adaptive")
DISTRIBUTED_PRIVACY = ("distributed", "distributed_adaptive")  # need secagg=plus: each node noises its own update
TOPOLOGIES = ("flat", "regions")  # topology.name (app/regions/)
REGION_RULES = ("mean", *ROBUST_RULES)  # topology.region_rule: how a region combines its members
WAN_CODECS = ("none", "fp16", "bf16", "int8")  # topology.wan_compression: a region's update on the WAN
SECAGGS = ("none", "plus")  # secagg.name (app/secagg/)
SECAGG_POLICIES = ("skip", "stop")  # secagg.on_too_few: an aborted round keeps the model, or ends the run
ROBUST_POLICIES = POLICIES
COMPRESSIONS = ("none", "fp16", "bf16", "int8", "topk")  # app/compression/codecs.py
DOWNLINKS = ("none", "fp16", "delta")  # app/compression/downlink.py
LEDGERS = ("on", "off")  # app/ledger/
CONTRIBUTIONS = ("none", "loo", "shapley")  # app/ledger/contribution.py
AGGREGATIONS = ("auto", "stream", "gather")  # federation.aggregation (app/run/memory.py)
NORM_BOUND_ACTIONS = ("reject", "clip")  # strategy.norm_bound_action (strategies/norm_bound.py)
ATTACKS = ("none", "sign_flip", "gaussian", "scale", "label_flip", "inflate_weight")
DATASETS = ("digits", "cifar10", "mnist", "fashion_mnist", "hf", "npz", "hf_disk", "python", "text")
HUB_DATASETS = ("cifar10", "mnist", "fashion_mnist", "hf")
PARTITIONS = ("iid", "dirichlet", "by_file")  # by_file: dataset=text, one partition per file
MODELS = ("cnn", "resnet18", "torchvision", "custom", "hf")
PEFT_METHODS = ("none", "lora")  # model=hf: model.peft (app/task/hf.py)
# task.type: classification of any inputs (the built-in models, model=custom); with model=hf,
# next-token prediction (causal_lm) or labels of whole texts (sequence_classification)
TASK_TYPES = ("classification", "causal_lm", "sequence_classification")
BUILTIN_METRICS = ("accuracy", "balanced_accuracy", "f1_macro", "auroc")
LM_METRICS = ("token_accuracy", "perplexity")  # task.type=causal_lm (app/task/metrics.py)
OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "cosine")
AMP_PRECISIONS = ("fp16", "bf16", "off")  # what train.amp resolves to on a device (app.task.training)
CHANNELS_LAST_MODES = ("auto", "on", "off")
AMP_MODES = ("auto", *AMP_PRECISIONS)

# Every column a metrics.jsonl row can have besides the task's metrics (one per `task.metrics`
# name): declared here, once, so that the validation refuses a metric named like one (it would be
# overwritten when the row is put together) and the run refuses a row with an undeclared column
# (check_columns, below). Which step writes each: docs/configuration.md.
# Each column says what privacy makes of it. EXACT: computed from the clients' replies or from which
# nodes took part (counts, node ids, their metrics, sums of their bytes); no epsilon covers it, so
# with privacy on it is recorded only with privacy.report_exact=true. PUBLIC: the run's own figures
# and the mechanisms' releases, always recorded. Rows, Prometheus, the status channel and the live
# page keep only PUBLIC columns (and the task's metrics) there: a new column must choose.
PUBLIC, EXACT = "public", "exact"
ROW_COLUMN_PRIVACY: dict[str, str] = {
    # every row (app/run/federation.py: timed_row)
    "round": PUBLIC, "loss": PUBLIC, "wall_time_s": PUBLIC, "round_time_s": PUBLIC, "sim_time_s": PUBLIC,
    # a synchronous round (app/run/rows.py: round_row) or a FedBuff version (version_row)
    "version": PUBLIC, "model_updated": PUBLIC,
    "num_sampled": EXACT, "num_clients": EXACT, "num_rejected": EXACT, "num_missing": EXACT, "num_failed": EXACT,
    "num_discarded_stale": EXACT, "rejected": EXACT, "failed": EXACT, "capped_weights": EXACT, "robust": EXACT,
    "node_partitions": EXACT, "applied": EXACT, "staleness": EXACT, "tasks_sent": EXACT, "train": EXACT,
    "federated_eval": EXACT,
    # strategy.norm_bound_action=clip: the updates clipped to the norm bound (strategies/norm_bound.py)
    "norm_clipped": EXACT,
    # traffic (app/run/rows.py: traffic): the means per task are public, the totals count the replies
    "bytes_down": PUBLIC, "bytes_up": PUBLIC,
    "bytes_down_total": EXACT, "bytes_up_total": EXACT, "unpack_s": EXACT,
    # privacy (app/run/privacy.py: each mode's row); dp_history_rejected only under privacy=local,
    # which takes who took part and n as public
    "epsilon": PUBLIC, "clip_norm": PUBLIC, "releases": PUBLIC, "noised_unclipped_fraction": PUBLIC,
    "clipped_fraction": EXACT,
    "client_epsilon_max": PUBLIC, "client_epsilon_mean": PUBLIC, "dp_history_rejected": PUBLIC,
    # secure aggregation (app/secagg/strategy.py: SecureFedAvg.row): survivors and dropped node ids
    "secagg": EXACT,
    # topology=regions (app/regions/): bytes over the wide-area links, each region's members and weight
    "wan_bytes": EXACT, "regions": EXACT,
    # the MQTT status channel's messages so far: handed over, delivered, dropped (app/status/)
    "status_channel": PUBLIC,
}  # fmt: skip
ROW_COLUMNS = tuple(ROW_COLUMN_PRIVACY)
PUBLIC_COLUMNS = frozenset(c for c, kind in ROW_COLUMN_PRIVACY.items() if kind == PUBLIC)


def check_columns(columns: Iterable[str], metric_names: Iterable[str] = ()) -> None:
    """Refuse a metrics.jsonl column (a row's keys, or the columns a module reads) that is neither
    a task metric nor declared in ROW_COLUMNS: the validation keeps metric names off the declared
    columns, which holds only if the list is whole, and a renamed column must not silently drop
    out of a reader (privacy's filter, the trackers, Prometheus)."""
    undeclared = set(columns) - set(ROW_COLUMNS) - set(metric_names)
    if undeclared:
        raise RuntimeError(
            f"metrics.jsonl columns {sorted(undeclared)} are not declared in app/config/schema.py ROW_COLUMNS"
        )


def metric_name(entry: Any) -> str:  # noqa: ANN401
    """A `task.metrics` entry's name (its metrics.jsonl column): the built-in's, the entry's
    `name`, else its `_target_`'s last part. Here, dependency-free, because the validation,
    the ClientApp's metrics and the reports all name metrics the same way."""
    if isinstance(entry, Mapping):
        return str(entry.get("name") or str(entry.get("_target_", "")).rsplit(".", 1)[-1])
    return str(entry)


class ConfigError(ValueError):
    """A config value is unusable; the message names the key, the value and what is allowed."""


# Sections hash by value so clients can cache their data per setting; dict and list fields
# are left out of the hash (`hash=False`) but not out of equality, so equal settings still
# hash alike.
# `_target_` sections (model=custom, dataset=python, task.loss): app.config.compose moves the
# `_target_` key to `target` and every key the dataclass lacks into `kwargs`, the keyword
# arguments the callable gets (app/task/user_code.py).
@dataclass(unsafe_hash=True)
class StrategyConfig:
    name: str = "fedavg"
    # Byzantine-robust strategies (any rule in strategies/registry.py):
    num_byzantine: int = 0  # f, the Byzantine clients to tolerate
    num_selected: int = 1  # m, Multi-Krum's selected updates
    trim_ratio: float = 0.1  # trimmed mean: fraction trimmed from each end
    on_too_few: str = "skip"  # skip | fallback (to the median) when too few valid replies
    # FedBuff (asynchronous):
    buffer_size: int = 0  # K: updates per server step; 0: half the nodes training at once, <= 10 (FedBuff.size_buffer)
    concurrency: int = 0  # nodes training at once; 0 = every connected node
    max_staleness: int = 10  # updates older than this many versions are discarded
    staleness_fn: str = "polynomial"  # constant | polynomial | hinge
    staleness_a: float = 0.5
    staleness_b: float = 4.0  # hinge: no discount up to b versions
    server_lr: float = 0.0  # η; 0: auto (FedBuff 0.5, else strategies/server_opt.py DEFAULT_LR)
    server_momentum: float = 0.0  # β (FedBuff's step, server_optimizer=momentum)
    buffer_aggregator: str = "mean"  # mean, or a robust rule of strategies/registry.py
    # Server optimizer of synchronous strategies (strategies/server_opt.py): none | sgd | momentum |
    # adam | yogi | adagrad, a step from the current model along the round's aggregate update
    server_optimizer: str = "none"
    server_beta1: float = 0.9  # β₁ of adam, yogi, adagrad
    server_beta2: float = 0.99  # β₂ of adam, yogi
    server_tau: float = 1e-3  # τ
    # FedProx (Li et al. 2020): μ/2 ||w - w_global||² added to every node's loss (any strategy)
    proximal_mu: float = 0.0
    # Ditto (strategy=ditto, Li et al. 2021): each node's personal model, pulled towards the global one
    ditto_lambda: float = 0.0
    # Norm bounding of the plain means (FedAvg, FedBuff's mean buffer, regions' means;
    # strategies/norm_bound.py): an update over norm_bound x the median of the recently accepted
    # update norms is rejected (or clipped); 0 = off
    norm_bound: float = 20.0
    norm_bound_action: str = "reject"  # NORM_BOUND_ACTIONS


@dataclass(unsafe_hash=True)
class DatasetConfig:
    name: str = "digits"
    path: str | None = None
    hf_name: str | None = None
    image_key: str = "image"  # the input column of a Hugging Face dataset
    label_key: str = "label"
    # dataset=text (app/task/text.py): the text field of .jsonl files and saved datasets, the
    # token block (causal_lm) or the longest sequence (sequence_classification), the token cache
    text_key: str = "text"
    block_size: int = 128
    cache_dir: str | None = "~/.cache/fedgpu/tokens"  # null: tokenize again in every process
    test_fraction: float = 0.2
    val_fraction: float = 0.1
    target: str | None = None  # dataset=python: `_target_`, the loader's dotted path
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(unsafe_hash=True)
class PartitionConfig:
    name: str = "iid"
    alpha: float = 0.5
    min_partition_size: int = 10


@dataclass(unsafe_hash=True)
class ModelConfig:
    name: str = "cnn"
    width: int = 32
    arch: str | None = None  # model=torchvision: a name torchvision.models.get_model knows
    target: str | None = None  # model=custom: `_target_`, the dotted path of a callable returning an nn.Module
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    init_weights: str | None = None  # a state_dict file the server starts from (loaded weights-only)
    trainable: list[str] = field(default_factory=list, hash=False)  # key prefixes trained and sent; [] = all
    # model=hf (app/task/hf.py): a local transformers directory, or a config (a dict or a JSON file)
    path: str | None = None
    config: Any = field(default=None, hash=False)
    tokenizer_path: str | None = None  # default: model.path; neither: a byte-level tokenizer (ByT5's)
    peft: str = "none"  # none | lora
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=list, hash=False)  # [] = peft's default for the model
    dtype: str = "float32"  # the base weights: float32 | bfloat16 (halves a frozen base's memory)


@dataclass(unsafe_hash=True)
class LossConfig:
    target: str | None = None  # `_target_`; None: cross-entropy, BCE-with-logits for multi-label targets
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(unsafe_hash=True)
class TaskConfig:
    """The loss and the metrics (app/task/metrics.py); the first metric is the primary one."""

    type: str = "classification"  # TASK_TYPES
    loss: LossConfig = field(default_factory=LossConfig)
    # built-in names (BUILTIN_METRICS) or {_target_: dotted.path, name: ..., **kwargs}
    metrics: list[Any] = field(default_factory=lambda: ["accuracy"], hash=False)


@dataclass(unsafe_hash=True)
class TrainConfig:
    epochs: int = 5
    batch_size: Any = 32  # an int, or "auto": the largest that fits the node's GPU memory (app/task/batch_size.py)
    max_batch_size: int = 1024  # the most `auto` may pick
    gpu_memory_fraction: float = 0.0  # cap on this client's GPU memory; 0 = its simulation share, else none
    local_devices: Any = 1  # DDP inside a node (app/task/distributed.py): 1, auto (every visible GPU), N, [ids]
    lr: float = 0.02
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    amp: str = "auto"
    grad_clip: float = 0.0
    device: str = "auto"
    telemetry_interval_s: float = 0.2
    channels_last: str = "auto"  # auto: on CUDA for models without GroupNorm
    cudnn_benchmark: bool = False  # cuDNN autotuning; every batch shape is warmed up outside the timer
    deterministic: bool = False  # bit-identical reruns on one GPU: deterministic kernels, no autotuning
    # Memory and schedule (app/task/training.py, app/task/checkpointing.py):
    gradient_checkpointing: bool = False  # recompute activations in backward: transformers' switch, or block-wise
    grad_accum_steps: int = 1  # batches whose gradients add up to one optimizer step
    max_steps: int = 0  # optimizer steps per round instead of epochs; 0 = train.epochs passes
    lr_schedule: str = "cosine"  # constant | cosine: the lr of round r, stepped by the node from the round number
    warmup_rounds: int = 0  # cosine: rounds of linear warm-up before the decay
    min_lr_ratio: float = 0.3  # cosine: the last round's lr as a fraction of train.lr


@dataclass(unsafe_hash=True)
class AttackConfig:
    name: str = "none"
    num_malicious: int = 0
    scale: float = 1.0
    claimed_examples: float = 1e9  # inflate_weight: the num-examples a malicious node reports


@dataclass(unsafe_hash=True)
class CompressionConfig:
    """How updates and models cross the link (app/compression/)."""

    name: str = "none"  # none | fp16 | bf16 | int8 | topk: the reply's update (trained - received model)
    ratio: float = 0.01  # topk: the fraction of each tensor's entries sent
    quantize_values: bool = False  # topk: the kept values in int8 (else float32)
    error_feedback: bool = True  # what was not sent is added to the node's next update
    downlink: str = "none"  # none | fp16 | delta (from the node's last copy, with `name`'s codec)
    downlink_nodes: int = 64  # delta: the server keeps the copies of this many nodes (each a model's size)


@dataclass(unsafe_hash=True)
class MqttConfig:
    """The MQTT status channel (app/status/, docs/monitoring.md): run status, alerts and node
    heartbeats published to a broker, never blocking training."""

    host: str | None = None  # the broker; None: no channel
    port: int = 1883  # 8883 is MQTT over TLS's usual port
    ca: str | None = None  # PEM CA certificate: TLS to the broker (nodes are sent its text)
    cert: str | None = None  # the server's client certificate (PEM) and key, for brokers that ask
    key: str | None = None
    username: str | None = None
    password_file: str | None = None  # the server's password, read from this file (never in the config)
    topic_prefix: str = "fedgpu"
    qos: int = 1  # 0 | 1 | 2
    queue: int = 1000  # messages held while the broker is away; more are dropped and counted
    nodes: bool = True  # ClientApps publish per-task heartbeats (their own credentials: docs/monitoring.md)
    flush_s: float = 0.5  # a ClientApp waits at most this long for its last heartbeat to leave
    close_s: float = 10.0  # after the run, the server waits at most this long for its last messages to leave


@dataclass(unsafe_hash=True)
class MonitoringConfig:
    """Live Prometheus metrics served by the ServerApp (app/run/monitoring.py), and the MQTT
    status channel (app/status/)."""

    prometheus_port: int = 0  # > 0: serve /metrics on this port; 0: off
    prometheus_host: str = "127.0.0.1"  # 0.0.0.0 in a container that Prometheus scrapes
    max_node_labels: int = 256  # node label values created at most; further nodes share node="other"
    mqtt: MqttConfig = field(default_factory=MqttConfig)


@dataclass(unsafe_hash=True)
class SecAggConfig:
    """Secure aggregation: SecAgg+ between the ServerApp and the ClientApps (app/secagg/)."""

    name: str = "none"  # none | plus
    threshold: int = 0  # t: shares that rebuild a secret; 0 = floor(2m/3) + 1 of a neighbourhood of m = k + 1
    degree: int = 0  # k: neighbours each node shares with and masks against; 0 = all up to 16 nodes, else ~4 log2 n
    clipping_range: float = 8.0  # each coordinate of a weighted update is clipped to +-this before quantizing
    quantization_range: int = 4_194_304  # 2^22 steps over [-clipping_range, clipping_range]
    modulus_range: int = 4_294_967_296  # the ring Z_M (a power of two; 2^16 or less: 2 bytes a coordinate)
    max_weight: int = 0  # a node's weight is min(examples, this) / this; 0 = federation.max_examples_per_node
    on_too_few: str = "skip"  # skip | stop: a round with fewer than t survivors keeps the model, or ends the run


@dataclass(unsafe_hash=True)
class LedgerConfig:
    """The hash-chained contribution ledger, <run>/ledger.jsonl (app/ledger/)."""

    name: str = "on"  # on | off
    contribution: str = "none"  # none | loo | shapley: a score per node and round (app/ledger/contribution.py)
    # What a coalition's model is worth: loss (minus the validation loss; smooth, tells updates apart
    # from the first round) or metric (task.metrics' primary, coarse on a few hundred examples)
    contribution_value: str = "loss"
    shapley_permutations: int = 20  # shapley: random orders sampled (every order when there are fewer)
    shapley_tolerance: float = 0.0  # shapley: truncate an order once within this of the round's value
    validation_examples: int = 500  # the scores' validation data: this many of the server's evaluation split
    signing_key: str | None = (
        None  # PEM private key: <run>/ledger.sig signs the head (scripts/credentials.py ledger-key)
    )
    # Signed work records (docs/ledger.md#signed-work-records): a directory of the sites' registered
    # public keys, <site>.work.pub (scripts/credentials.py work-keys); each training reply must carry
    # a record signed by one of them (work_required), or may (false: one without earns nothing)
    work_keys: str | None = None
    work_required: bool = True


@dataclass(unsafe_hash=True)
class PrivacyConfig:
    name: str = "none"  # none | central | central_adaptive | local
    noise_multiplier: float = 1.0  # Gaussian noise std / clip (central: per release; local: per step)
    clip_norm: float = 1.0  # central: L2 bound of each client update; local: per-example gradient bound
    delta: float = 1e-5
    max_epsilon: float = 0.0  # central: stop before a release would exceed it; 0 = no budget
    poisson_sampling: bool = False  # central: sample each node with probability federation.fraction_train
    # true: metrics.jsonl (and TensorBoard, MLflow) also get the exact values outside every epsilon
    # (cohorts, clipped fraction, clients' train/eval metrics); false leaves them out (docs/privacy.md)
    report_exact: bool = False
    # central_adaptive (Andrew et al. 2021): the clip follows a quantile of update norms
    target_quantile: float = 0.5
    clip_lr: float = 0.2  # geometric step of the clip norm per release
    count_noise: float = 0.0  # std of the noise on the clipped count; 0 = expected cohort / 20
    # local (DP-SGD in the ClientApp with Opacus)
    target_epsilon: float = 0.0  # > 0: per-client epsilon over the planned local steps (sets the noise)


@dataclass
class StragglersConfig:
    name: str = "none"
    factors: list[float] = field(default_factory=list)  # fixed: slowdown of partition 0, 1, ... (rest 1.0)
    sigma: float = 1.0  # lognormal: slowdown exp(sigma * (z - min z)), z ~ N(0, 1) per node, seeded
    dropout: float = 0.0  # probability that a training task crashes part way


@dataclass
class FleetConfig:
    """Simulated devices, links and availability on a virtual clock (app/simulation/fleet.py).
    Per-partition lists are cycled (partition i takes item i % len)."""

    name: str = "none"  # none: real time (and stragglers=...'s short form); else a profile on a virtual clock
    speed: str = "uniform"  # uniform | fixed | lognormal | devices: each partition's compute speed
    reference_samples_per_s: float = 2000.0  # training examples/s of the reference device (an RTX 4090) on this task
    factors: list[float] = field(default_factory=list)  # fixed: slowdown of partition 0, 1, ... (rest 1.0)
    sigma: float = 1.0  # lognormal: slowdown exp(sigma * (z - min z)), z ~ N(0, 1) per partition, seeded
    devices: list[str] = field(default_factory=list)  # devices: device class of each partition (cycled)
    device_speeds: dict[str, float] = field(default_factory=dict)  # speeds over the reference, beside the built-ins
    downlink_mbps: list[float] = field(default_factory=lambda: [1000.0])
    uplink_mbps: list[float] = field(default_factory=lambda: [1000.0])
    latency_ms: list[float] = field(default_factory=lambda: [0.0])  # one way
    link_sigma: float = 0.0  # > 0: each partition's rates times exp(sigma z), latency over it, z ~ N(0, 1) seeded
    availability: str = "always"  # always | bernoulli | trace
    completion_p: float = 1.0  # bernoulli: probability that a task completes (else the node drops out mid-task)
    trace: str = ""  # trace: CSV of offline intervals, columns partition,offline_from_s,offline_until_s
    # Wide-area links, per region (topology.regions; cycled): a region's aggregator to the server, or
    # under topology=flat the region's egress its sites share; empty: no wide-area leg
    wan_downlink_mbps: list[float] = field(default_factory=list)
    wan_uplink_mbps: list[float] = field(default_factory=list)
    wan_latency_ms: list[float] = field(default_factory=list)  # one way


@dataclass(unsafe_hash=True)
class TopologyConfig:
    """Where a round's replies are combined (app/regions/, docs/fleet.md#regions). flat: every node
    to the server. regions: each region combines its members' replies first and one update per
    region crosses the wide-area link. The regions are given by exactly one of `regions`,
    `assignment` or `csv`; under flat they place the sites behind their region's WAN link (fleet)."""

    name: str = "flat"  # flat | regions
    regions: int = 0  # a count: partition i is in region i % regions
    assignment: list[int] = field(default_factory=list)  # the region of partition 0, 1, ... (every partition)
    csv: str = ""  # a CSV with the columns partition,region
    region_rule: str = "mean"  # REGION_RULES: inside each region, the sample-weighted mean or a robust rule
    region_byzantine: int = 0  # f inside one region, for a robust region_rule
    wan_compression: str = "none"  # WAN_CODECS: a region's update re-encoded for the WAN, with error feedback
    # A deployment (app/regions/deployed.py): the most examples one regional aggregator's reply may
    # count for, its sites' capped counts summed; 0: federation.max_examples_per_node
    region_max_examples: int = 0


@dataclass(unsafe_hash=True)
class FederationConfig:
    rounds: int = 10
    fraction_train: float = 1.0
    min_train_nodes: int = 2
    fraction_evaluate: float = 0.0
    min_evaluate_nodes: int = 2
    eval_every: int = 1  # central evaluation every N rounds (FedBuff: versions), and always at the end
    min_available_nodes: int = 2
    round_timeout_s: float = 600.0
    message_ttl_s: float = 3600.0
    node_wait_timeout_s: float = 600.0
    round_wait_timeout_s: float = 300.0  # the longest a round (FedBuff: an update) waits for nodes during the run
    max_wall_time_s: float = 0.0  # stop after this many seconds of training; 0 = no limit
    target_metric: str | None = None  # the metric target_value refers to; None = task's primary metric
    target_value: float = 0.0  # stop once the central target_metric reaches this; 0 = never
    target_accuracy: float = 0.0  # older spelling of target_metric=accuracy target_value=...
    max_examples_per_node: int = 100_000  # cap on a reply's claimed num-examples (its FedAvg weight)
    aggregation: str = "auto"  # AGGREGATIONS: fold training replies as they arrive, or gather them (app/run/memory.py)
    server_memory_gb: float = 0.0  # the most the replies a strategy holds at once may take; 0 = no cap
    stall_rounds: int = 5  # stop after this many rounds (FedBuff: versions' worth) without an update; 0 = never


@dataclass(unsafe_hash=True)
class SimulationConfig:
    """Simulated federation size for `python -m app.sweep` (its --federation-config); the ServerApp ignores it."""

    num_supernodes: int = 5
    client_cpus: int = 1  # Ray CPUs per ClientApp (Flower 1.42 takes whole CPUs)
    client_gpus: float = 0.0  # GPU share per ClientApp


@dataclass(unsafe_hash=True)
class TrackingConfig:
    """Experiment trackers fed with every metrics.jsonl row (app/run/tracking.py)."""

    tensorboard: bool = True
    mlflow: bool = False
    mlflow_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite in the results root
    mlflow_experiment: str = "fedgpu"


@dataclass(unsafe_hash=True)
class SweepConfig:
    """Where and how `python -m app.sweep` runs its jobs; the ServerApp ignores it."""

    root: str = "~/fedgpu-runs/sweeps"
    name: str = "default"
    timeout_s: float = 3600.0  # per job; 0 = no limit
    trial: int | None = None  # set by hydra/sweeper=optuna: the job's Optuna trial (app/tools/study.py)


@dataclass
class Config:
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    seed: int = 42
    name: str | None = None
    resume: str | None = None
    server_device: str = "auto"
