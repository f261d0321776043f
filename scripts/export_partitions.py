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
from app.task.data import check_partitioning, load_splits, materialize, partition_indices  # noqa: E402


def export_partitions(out: Path, num_partitions: int, overrides: str = "") -> list[Path]:
    """Write partition-<i>.npz for i in [0, num_partitions); return the paths."""
    cfg, _ = load_config(overrides)
    train, _ = load_splits(cfg.dataset, cfg.seed)
    check_partitioning(len(train.labels), num_partitions, cfg.partition)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(num_partitions):
        part = materialize(train, partition_indices(train.labels, num_partitions, i, cfg.partition, cfg.seed))
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
            with np.load(path) as f:
                print(f"{path}: {len(f['y'])} examples; SuperNode: --node-config 'data-path=\"{path.resolve()}\"'")
    except ConfigError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
