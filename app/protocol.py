"""Everything that crosses the wire between the ServerApp and the ClientApps.

The ClientApp imports this module and the schema's dataclasses, never Hydra: its settings
travel as flat keys in each message's ConfigRecord (`to_client_record` on the server,
`ClientSettings.from_record` on the client).
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
from strategies.wire import (  # noqa: F401 - re-exported: the ClientApp imports every wire key from here
    ARRAYS,
    CONFIG,
    FROZEN,
    METRICS,
    NAME,
    NODE,
    NUM_EXAMPLES,
    PARTITION_ID,
    SERVER_ROUND,
    TASK,
)

# --- Record names and keys of the messages -------------------------------------------------
# The ones the strategies read are defined in strategies/wire.py (the lowest layer); imported above.
# node_config of a SuperNode: a simulated partition (PARTITION_ID of NUM_PARTITIONS), or a deployed node's own data
NUM_PARTITIONS = "num-partitions"
DATA_PATH = "data-path"
STATE_DIR = "state-dir"  # node_config: where a node keeps what must outlive a restart (error feedback's residual)
# reply metrics
TRAIN_METRICS = ("train-loss", "train-accuracy", "samples-per-s")  # left out under local DP unless report_exact
EVAL_LOSS = "eval-loss"
EVAL_PREFIX = "eval-"  # federated evaluation: eval-<metric name> for each of task.metrics
# a training task's ConfigRecord with compression.downlink (app/compression/downlink.py); absent: the model as it is
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

PRIOR_KEY = "dp-prior-history"  # message config: JSON {history key: [[σ, q, steps], ...]} (HistoryLedger.prior)
HISTORY_METRICS = ("dp-history-sigma", "dp-history-q", "dp-history-steps")  # reply: the merged history
ROUNDS_KEY = "federation.rounds"  # message config: the rounds the server plans (needed by privacy.target_epsilon)
