"""Everything that crosses the wire between the ServerApp and the ClientApps.

The ClientApp imports this module and the schema's dataclasses, never Hydra or torch: its
settings travel as flat keys in each message's ConfigRecord (`to_client_record` on the server,
`ClientSettings.from_record` on the client). Every key a reply's MetricRecord may carry is
declared below (`REPLY_METRICS`, `REPLY_METRIC_PREFIXES`; tests/test_protocol_keys.py holds the
ClientApp to it): writers and readers import the constants, never retype the strings, which
are what results files and checkpoints hold and must not change.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any

from app.config.schema import (
    AttackConfig,
    CompressionConfig,
    Config,
    DatasetConfig,
    ModelConfig,
    PartitionConfig,
    PrivacyConfig,
    TaskConfig,
    TrainConfig,
)
from strategies.keys import (  # noqa: F401 - re-exported: the ClientApp imports every wire key from here
    ARRAYS,
    CONFIG,
    FROZEN,
    METRICS,
    NAME,
    NODE,
    NUM_EXAMPLES,
    PARTITION_ID,
    SCAFFOLD_C,
    SCAFFOLD_DELTA,
    SERVER_ROUND,
    TASK,
)

# --- Record names and keys of the messages -------------------------------------------------
# The ones the strategies read are defined in strategies/keys.py (the lowest layer); imported above.
# node_config of a SuperNode: a simulated partition (PARTITION_ID of NUM_PARTITIONS), or a deployed node's own data
NUM_PARTITIONS = "num-partitions"
DATA_PATH = "data-path"
STATE_DIR = "state-dir"  # node_config: where a node keeps what must outlive a restart (error feedback's residual, SCAFFOLD's c_i)
# a training task's ConfigRecord with compression.downlink (app/compression/downlink.py); absent: the model as it is
# model=hf: the server's digest of the frozen base, which every node builds itself and checks (app/task/hf.py)
BASE_DIGEST = "model.base-digest"
DOWNLINK = "downlink"  # "fp16", "full" (the model, and the start of a delta chain) or "delta"
DOWNLINK_BASE = "downlink-base"  # delta: the id of the copy the node must hold
DOWNLINK_ID = "downlink-id"  # full and delta: the id of the copy the node holds after this task
# a training task's ConfigRecord with the ledger on (docs/ledger.md#receipts): LEDGER_ON, and the receipt
# of this node's last recorded reply: the step and hash of the ledger entry that recorded it, and the
# reply's sha256 as recorded there (strategies.replies.arrays_digest, which the node computes too)
LEDGER_ON = "ledger"
RECEIPT_STEP = "ledger-receipt-step"
RECEIPT_HASH = "ledger-receipt-hash"
RECEIPT_REPLY = "ledger-receipt-reply-sha256"
# signed work records (ledger.work_keys, app/ledger/work.py): a node's key (node_config, a PEM path; in
# simulation the FEDGPU_WORK_KEY environment variable), the task's run and nonce, the reply's record
WORK_KEY = "work-key"
WORK_KEY_ENV = "FEDGPU_WORK_KEY"
WORK_RUN = "work-run"
WORK_NONCE = "work-nonce"
WORK = "work"  # a training reply's ConfigRecord: record (canonical JSON) and signature
# the MQTT status channel (monitoring.mqtt, app/status/node.py): where a node publishes its
# heartbeats, in every task's ConfigRecord when the server has a broker and monitoring.mqtt.nodes
STATUS_HOST = "status.host"
STATUS_PORT = "status.port"
STATUS_CA_PEM = "status.ca-pem"  # the CA certificate's text ("" without TLS)
STATUS_PREFIX = "status.prefix"
STATUS_QOS = "status.qos"
STATUS_RUN = "status.run"  # the run's results directory name, as the server's topics have it
STATUS_FLUSH_S = "status.flush-s"

# secagg=plus (app/secagg/): the ConfigRecord of each stage's task and reply, and the four message
# types (`<category>.<action>`, routed by the ClientApp's named handlers). A training task's record
# also carries the ring and what the node adds to its vector: SECAGG_* below.
SECAGG = "secagg"
SECAGG_KEYS = "query.secagg_keys"
SECAGG_SHARES = "query.secagg_shares"
SECAGG_TRAIN = "train.secagg"
SECAGG_UNMASK = "query.secagg_unmask"
SECAGG_MASKED = "masked"  # the ArrayRecord key of a node's masked vector
SECAGG_MODULUS = "modulus"
SECAGG_QUANTIZATION = "quantization"
SECAGG_CLIPPING = "clipping"
SECAGG_EXTRAS = "extras"  # the ring vector's extra coordinates (app/secagg/ring.py)
SECAGG_MAX_WEIGHT = "max-weight"  # a node's weight is min(examples, this) / this
SECAGG_CLIP_NORM = "clip-norm"  # distributed DP: the L2 bound of the update (0: none)
SECAGG_NOISE = "noise-variance"  # distributed DP: this node's Skellam variance, in ring units squared (0: none)
SECAGG_COUNT_NOISE = "count-noise-variance"  # distributed adaptive DP: the same for the unclipped count

# topology=regions on a deployment (app/regions/aggregator.py, docs/deployment.md#regions-two-level-deployment):
# the global run's nodes are regional aggregators. A training task's ConfigRecord carries the Hydra
# overrides of the region's one-round sub-run, composed by the global server (app/regions/deployed.py);
# the aggregator SuperNode's node config names its regional SuperLink. An aggregator is a node whose
# node config has REGION_SUPERLINK.
REGION_RUN_OVERRIDES = "region-run-overrides"
REGION_SUPERLINK = "region-superlink"  # node config: the regional SuperLink's connection in REGION_FLWR_HOME
REGION_FLWR_HOME = "region-flwr-home"  # node config: the FLWR_HOME whose config.toml names it (its own CA)
REGION_OUTPUT_DIR = "region-output-dir"  # node config: the sub-runs' output-dir, shared with the regional executor
REGION_OVERRIDES = "region-overrides"  # node config: the region's own overrides, after the global run's
REGION_TIMEOUT_S = "region-timeout-s"  # node config: the longest a sub-run may take (also bounded by the task's TTL)

# --- Reply metrics: the keys of a reply's MetricRecord (METRICS) ---------------------------------
# Every key a ClientApp reply may carry. The server averages them into a row's `train` and
# `federated_eval` sections (strategies/replies.py: weighted_metrics), so each is also a key there.
# Any reply: NUM_EXAMPLES (the weight claim) and, on a simulated node, PARTITION_ID (strategies/keys.py).
# training (app/client_app.py: train_handler), from the TrainStats of the round
TRAIN_LOSS = "train-loss"  # mean training loss
TRAIN_ACCURACY = "train-accuracy"  # the task's training accuracy (app/task/metrics.py: task_accuracy)
SAMPLES_PER_S = "samples-per-s"  # training throughput
TRAIN_METRICS = (TRAIN_LOSS, TRAIN_ACCURACY, SAMPLES_PER_S)  # left out under local DP unless report_exact
WALL_TIME_S = "wall-time-s"  # the node's training time (the ledger's reported compute)
STEPS = "steps"  # optimizer steps taken
# seconds the device was busy training: NVML's mean utilisation x the training time on a GPU, else the
# process's CPU seconds while it trained (what a signed work record states: app/ledger/work.py)
DEVICE_S = "device-s"
BATCH_SIZE = "batch-size"  # train.batch_size, `auto` resolved for this node
OOM_RETRIES = "oom-retries"  # batches redone in micro-batches after an out-of-memory error
MICRO_BATCH_SIZE = "micro-batch-size"  # the micro-batch the loop ended with: only when OOM_RETRIES > 0
PEAK_GPU_MEM_MB = "peak-gpu-mem-mb"  # CUDA only: the allocator's peak, MiB
AMP_SKIPPED_STEPS = "amp-skipped-steps"  # fp16 only: steps the GradScaler skipped
ENCODE_S = "encode-s"  # a compressed uplink or a downlink: seconds encoding the update (app/compression/)
# a share of a GPU (app/task/gpu_memory.py: MemoryCap.metrics)
GPU_MEM_SHARE = "gpu-mem-share"  # of the device's memory, as reserved or configured
GPU_MEM_CAP_MB = "gpu-mem-cap-mb"  # what PyTorch's allocator may hold, MiB
# NVML telemetry (app/task/telemetry.py: GpuTelemetry.metrics), device-wide: GPU_TELEMETRY always,
# the GPU_DEVICE_PREFIX family only with telemetry, each only when NVML could read its quantity
GPU_TELEMETRY = "gpu-telemetry"  # 1.0 with telemetry, 0.0 without (MetricRecord has no null)
GPU_DEVICE_PREFIX = "gpu-device-"
GPU_UTIL_MEAN_PCT = GPU_DEVICE_PREFIX + "util-mean-pct"
GPU_UTIL_MAX_PCT = GPU_DEVICE_PREFIX + "util-max-pct"
GPU_MEM_USED_MAX_MB = GPU_DEVICE_PREFIX + "mem-used-max-mb"  # MiB (NVML bytes / 2**20)
GPU_TEMP_MAX_C = GPU_DEVICE_PREFIX + "temp-max-c"
GPU_POWER_MEAN_W = GPU_DEVICE_PREFIX + "power-mean-w"  # mean board power (the ledger's reported energy)
GPU_DEVICE_METRICS = (GPU_UTIL_MEAN_PCT, GPU_UTIL_MAX_PCT, GPU_MEM_USED_MAX_MB, GPU_TEMP_MAX_C, GPU_POWER_MEAN_W)
# local DP (app/privacy/dp_sgd.py: train_private; app/privacy/accounting.py: history_metrics)
DP_EPSILON = "dp-epsilon"  # this node's ε so far, at privacy.delta
DP_NOISE_MULTIPLIER = "dp-noise-multiplier"  # σ this round
DP_STEPS = "dp-steps"  # DP-SGD steps so far
HISTORY_METRICS = ("dp-history-sigma", "dp-history-q", "dp-history-steps")  # the merged accountant history (lists)
# federated evaluation (app/client_app.py: evaluate_handler)
EVAL_PREFIX = "eval-"  # eval-<metric name> for each of task.metrics
EVAL_LOSS = EVAL_PREFIX + "loss"
# a regional aggregator's reply (app/regions/aggregator.py), from its sub-run's row; NUM_EXAMPLES is
# the region's summed (capped) weight
REGION_SAMPLED = "region-sampled"  # the sites the sub-run asked
REGION_NODES = "region-nodes"  # the sites whose updates are in the region's aggregate

REPLY_METRICS = frozenset(
    {
        NUM_EXAMPLES,
        PARTITION_ID,
        *TRAIN_METRICS,
        WALL_TIME_S,
        STEPS,
        DEVICE_S,
        BATCH_SIZE,
        OOM_RETRIES,
        MICRO_BATCH_SIZE,
        PEAK_GPU_MEM_MB,
        AMP_SKIPPED_STEPS,
        ENCODE_S,
        GPU_MEM_SHARE,
        GPU_MEM_CAP_MB,
        GPU_TELEMETRY,
        *GPU_DEVICE_METRICS,
        DP_EPSILON,
        DP_NOISE_MULTIPLIER,
        DP_STEPS,
        *HISTORY_METRICS,
        EVAL_LOSS,
        REGION_SAMPLED,
        REGION_NODES,
    }
)
REPLY_METRIC_PREFIXES = (EVAL_PREFIX,)  # families named after the task's metrics
# secagg=plus: the only reply metrics a masked reply carries in the clear (app/client_app.py:
# secagg_train_handler; the heartbeat is built from the reply). The device's own state and the
# config, never a figure of the work done: with the public epochs and batch size, time,
# throughput, steps, batches and memory peaks each give the example count (samples-per-s x
# wall-time-s was exactly count x epochs), which travels only inside the masked vector. Under
# privacy=local, also the accountant's history the server needs for ε: its q = batch / n gives n,
# which local DP takes as public (docs/privacy.md). And a simulated node's partition id.
SECAGG_CLEAR = frozenset(
    {
        PARTITION_ID,
        GPU_TELEMETRY,
        GPU_UTIL_MEAN_PCT,
        GPU_UTIL_MAX_PCT,
        GPU_TEMP_MAX_C,
        GPU_POWER_MEAN_W,
        GPU_MEM_SHARE,
        GPU_MEM_CAP_MB,
        DP_EPSILON,
        DP_NOISE_MULTIPLIER,
        DP_STEPS,
        *HISTORY_METRICS,
    }
)


def is_reply_metric(key: str) -> bool:
    """Whether `key` is declared here as a reply metric: one of REPLY_METRICS or a REPLY_METRIC_PREFIXES family."""
    return key in REPLY_METRICS or any(key.startswith(p) and len(key) > len(p) for p in REPLY_METRIC_PREFIXES)


CLIENT_SECTIONS = {
    "dataset": DatasetConfig,
    "partition": PartitionConfig,
    "model": ModelConfig,
    "task": TaskConfig,
    "train": TrainConfig,
    "attack": AttackConfig,
    "privacy": PrivacyConfig,
    "compression": CompressionConfig,
}


@dataclass(unsafe_hash=True)
class ClientSettings:
    """The part of the config a ClientApp needs, rebuilt from a ConfigRecord."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    seed: int = 42

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ClientSettings:
        sections = {}
        for section, kind in CLIENT_SECTIONS.items():
            values = {
                f.name: _decode(f, record[f"{section}.{f.name}"])
                for f in fields(kind)
                if f"{section}.{f.name}" in record
            }
            sections[section] = kind(**values)
        return cls(**sections, seed=int(record.get("seed", 42)))


def _structured(value: Any) -> bool:  # noqa: ANN401
    return isinstance(value, dict | list)


def _decode(f: Any, value: Any) -> Any:  # noqa: ANN401
    """A field's value from the record: JSON text for dicts, lists and nested sections."""
    default = f.default_factory() if f.default_factory is not MISSING else f.default
    if f.type == "Any" and isinstance(value, str) and value[:1] in "[{":  # e.g. train.local_devices=[0, 1]
        return json.loads(value)
    if not (_structured(default) or is_dataclass(default)) or not isinstance(value, str):
        return value
    decoded = json.loads(value)
    return type(default)(**decoded) if is_dataclass(default) else decoded


def to_client_record(cfg: Config | ClientSettings) -> dict[str, Any]:
    """Flatten the client-side sections into ConfigRecord-compatible values: scalars as they
    are, dicts, lists and nested sections (keyword arguments, metric lists, `task.loss`) as
    JSON text, since a ConfigRecord holds no nested or mixed values."""
    flat: dict[str, Any] = {"seed": cfg.seed}
    for section in CLIENT_SECTIONS:
        for key, value in asdict(getattr(cfg, section)).items():
            if value is not None:
                flat[f"{section}.{key}"] = json.dumps(value, sort_keys=True) if _structured(value) else value
    return flat


# --- local DP (app.privacy): each client's accountant history crosses the wire both ways ----------

PRIOR_KEY = "dp-prior-history"  # message config: JSON {history key: [[σ, q, steps], ...]} (HistoryBook.prior)
ROUNDS_KEY = "federation.rounds"  # message config: the rounds the server plans (needed by privacy.target_epsilon)
DITTO_LAMBDA = (
    "ditto-lambda"  # message config (train and evaluate): Ditto's lambda (strategy=ditto); absent: no personal model
)
PROXIMAL_MU = "proximal-mu"  # message config: FedProx's mu (strategy.proximal_mu), Flower's FedProx key; absent: 0
# the reply's metrics of local DP: see "Reply metrics" above (DP_* and HISTORY_METRICS)
