"""Everything that crosses the wire between the ServerApp and the ClientApps.

The ClientApp imports this module and the schema's dataclasses, never Hydra: its settings
travel as flat keys in each message's ConfigRecord (`to_client_record` on the server,
`ClientSettings.from_record` on the client).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from app.config.schema import (
    AttackConfig,
    Config,
    DatasetConfig,
    ModelConfig,
    PartitionConfig,
    PrivacyConfig,
    TrainConfig,
)
from strategies.wire import (  # noqa: F401 - re-exported: the ClientApp imports every wire key from here
    ARRAYS,
    CONFIG,
    METRICS,
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
# reply metrics
TRAIN_METRICS = ("train-loss", "train-accuracy", "samples-per-s")  # left out under local DP unless report_exact
EVAL_LOSS, EVAL_ACCURACY = "eval-loss", "eval-accuracy"


CLIENT_SECTIONS = {
    "dataset": DatasetConfig,
    "partition": PartitionConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "attack": AttackConfig,
    "privacy": PrivacyConfig,
}


@dataclass(unsafe_hash=True)
class ClientSettings:
    """The part of the config a ClientApp needs, rebuilt from a ConfigRecord."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    seed: int = 42

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ClientSettings:
        sections = {}
        for section, kind in CLIENT_SECTIONS.items():
            values = {f.name: record[f"{section}.{f.name}"] for f in fields(kind) if f"{section}.{f.name}" in record}
            sections[section] = kind(**values)
        return cls(**sections, seed=int(record.get("seed", 42)))


def to_client_record(cfg: Config | ClientSettings) -> dict[str, Any]:
    """Flatten the client-side sections into ConfigRecord-compatible scalars."""
    flat: dict[str, Any] = {"seed": cfg.seed}
    for section in CLIENT_SECTIONS:
        for key, value in asdict(getattr(cfg, section)).items():
            if value is not None:
                flat[f"{section}.{key}"] = value
    return flat


# --- local DP (app.privacy): each client's accountant history crosses the wire both ways ----------

PRIOR_KEY = "dp-prior-history"  # message config: JSON {history key: [[σ, q, steps], ...]} (HistoryLedger.prior)
HISTORY_METRICS = ("dp-history-sigma", "dp-history-q", "dp-history-steps")  # reply: the merged history
ROUNDS_KEY = "federation.rounds"  # message config: the rounds the server plans (needed by privacy.target_epsilon)
