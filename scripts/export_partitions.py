"""Write each partition of a dataset to its own .npz file: one site's data for a demo
deployment, where every SuperNode reads only its own file. Give it to the SuperNode as a
quoted TOML string, with an absolute path (Flower rejects the unquoted form):

    flower-supernode ... --node-config 'data-path="/abs/path/data/partition-0.npz"'

    python scripts/export_partitions.py --num-partitions 3 --out data
    python scripts/export_partitions.py --num-partitions 3 --out data \
        --overrides "partition=dirichlet partition.alpha=0.3"

Partitions are cut exactly as in simulation (the Hydra config's dataset, partitioner and
seed; `--overrides` as in the run config), from the training split only: the ServerApp
keeps the test split for central evaluation. Files hold `x` and `y` as the dataset holds
them (uint8 images stay uint8 0-255: a node scales them as the server does; any input shape
of `dataset=python`; class indices, or N x K targets), the format `data-path` reads.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from app.config.compose import load_config  # noqa: E402
from app.config.schema import ConfigError
from app.task.data import check_partitioning, load_splits, materialize, partition_indices, partition_key  # noqa: E402


def export_partitions(out: Path, num_partitions: int, overrides: str = "") -> list[Path]:
    """Write partition-<i>.npz for i in [0, num_partitions) (dataset=text: partition-<i>.jsonl, its
    examples as text again, which a node tokenizes itself); return the paths."""
    cfg, _ = load_config(overrides)
    train, _ = load_splits(cfg.dataset, cfg.seed, cfg.model, cfg.task.type)
    key = partition_key(train, cfg.partition)
    check_partitioning(key, num_partitions, cfg.partition)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(num_partitions):
        part = materialize(train, partition_indices(key, num_partitions, i, cfg.partition, cfg.seed))
        if cfg.dataset.name == "text":
            from app.task.text import write_jsonl

            path = out / f"partition-{i}.jsonl"
            write_jsonl(path, part.x.numpy(), part.y.numpy(), cfg.model, cfg.dataset, cfg.task.type == "causal_lm")
        else:
            path = out / f"partition-{i}.npz"
            np.savez_compressed(path, x=part.x.numpy(), y=part.y.numpy())
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-partitions", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--overrides", default="", help="Hydra overrides for conf/ (dataset, partition, seed)")
    args = parser.parse_args(argv)
    try:
        for path in export_partitions(args.out, args.num_partitions, args.overrides):
            print(f"{path}: SuperNode: --node-config 'data-path=\"{path.resolve()}\"'")
    except ConfigError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
