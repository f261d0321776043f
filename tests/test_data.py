"""Datasets, partitions and the user's own data."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from app.config.schema import DatasetConfig, PartitionConfig
from app.run.results import read_rows
from app.task.data import (
    DatasetUnavailableError,
    DataSpec,
    data_spec,
    load_local_data,
    load_splits,
    materialize,
    partition_indices,
    to_nchw,
)

DIRICHLET = PartitionConfig(name="dirichlet", alpha=0.1, min_partition_size=5)


def _all_partitions(labels, n, cfg, seed):
    return [partition_indices(labels, n, i, cfg, seed) for i in range(n)]


def test_digits_ship_offline_and_split_deterministically():
    train, test = load_splits(DatasetConfig(), seed=1)
    assert len(train.labels) + len(test.labels) == 1797
    assert len(test.labels) == 360  # ceil(0.2 * 1797)
    spec = data_spec(train, test)
    assert spec == DataSpec((1, 8, 8), 10)
    data = materialize(test)
    assert data.x.dtype.is_floating_point is False and int(data.x.max()) == 255


@pytest.mark.parametrize("cfg", [PartitionConfig(), DIRICHLET], ids=["iid", "dirichlet"])
def test_partitions_are_deterministic_per_seed_and_disjoint(cfg):
    labels = load_splits(DatasetConfig(), seed=0)[0].labels
    first = _all_partitions(labels, 6, cfg, seed=3)
    again = _all_partitions(labels, 6, cfg, seed=3)
    other = _all_partitions(labels, 6, cfg, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))
    joined = np.concatenate(first)
    assert len(joined) == len(np.unique(joined)) == len(labels)  # disjoint and complete


def test_dirichlet_with_small_alpha_is_visibly_skewed():
    labels = load_splits(DatasetConfig(), seed=0)[0].labels

    def majority_share(cfg):
        parts = _all_partitions(labels, 8, cfg, seed=0)
        return np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])

    iid, skewed = majority_share(PartitionConfig()), majority_share(DIRICHLET)
    assert iid < 0.2  # about 1/10 of each partition is its most common digit
    assert skewed > 0.4 and skewed > 2 * iid


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((5, 8, 8), (5, 1, 8, 8)), ((5, 3, 16, 16), (5, 3, 16, 16)), ((5, 16, 16, 3), (5, 3, 16, 16))],
)
def test_npz_images_in_any_layout(tmp_path, shape, expected):
    path = tmp_path / "mine.npz"
    np.savez(path, x=np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8), y=np.arange(5) % 2)
    source = load_local_data(DatasetConfig(name="npz"), str(path), seed=0)
    assert materialize(source).x.shape == expected


def test_npz_with_own_test_split_and_float_images(tmp_path):
    path = tmp_path / "mine.npz"
    rng = np.random.default_rng(0)
    np.savez(
        path,
        x=rng.random((40, 1, 6, 6)),
        y=rng.integers(0, 3, 40),
        x_test=rng.random((9, 1, 6, 6)),
        y_test=rng.integers(0, 3, 9),
    )
    train, test = load_splits(DatasetConfig(name="npz", path=str(path)), seed=0)
    assert len(train.labels) == 40 and len(test.labels) == 9
    assert materialize(train).x.dtype.is_floating_point


def test_npz_errors_are_actionable(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, images=np.zeros((3, 4, 4)))
    with pytest.raises(DatasetUnavailableError, match="no array 'x'"):
        load_local_data(DatasetConfig(name="npz"), str(path), seed=0)
    with pytest.raises(DatasetUnavailableError, match=r"N x H x W or N x C x H x W"):
        to_nchw(np.zeros((3, 4)))
    with pytest.raises(DatasetUnavailableError, match=r"data-path='.*missing.npz' does not exist on this node"):
        load_local_data(DatasetConfig(name="npz"), str(tmp_path / "missing.npz"), seed=0)
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)
    with pytest.raises(DatasetUnavailableError, match="neither a .npz file nor a directory"):
        load_local_data(DatasetConfig(name="npz"), str(fifo), seed=0)


def test_a_missing_data_path_fails_the_nodes_first_task_naming_the_node(tmp_path):
    """A deployed node whose data-path does not exist: its first task comes back as an error
    reply that names the node and says the file does not exist."""
    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid
    from app.tools.in_process import run_in_process

    grid = InProcessGrid(client_app, 3)
    grid.contexts[1002].node_config = {"data-path": str(tmp_path / "lab-c.npz")}
    summary, _ = run_in_process("federation.rounds=1 train.epochs=1", tmp_path, grid=grid)
    (rejected,) = read_rows(summary["run_dir"])[0]["rejected"]
    assert rejected["node_id"] == 1002 and "node 1002: node config data-path=" in rejected["reason"]
    assert "lab-c.npz' does not exist on this node" in rejected["reason"]


def _image_dataset(n: int, seed: int):
    import datasets
    from PIL import Image

    rng = np.random.default_rng(seed)
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    images = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(n)]
    return datasets.Dataset.from_dict({"img": images, "label": (np.arange(n) % 10).tolist()}, features=features)


def test_hf_save_to_disk_directory(tmp_path):
    import datasets

    datasets.DatasetDict({"train": _image_dataset(30, 0), "test": _image_dataset(10, 1)}).save_to_disk(tmp_path / "ds")
    cfg = DatasetConfig(name="hf_disk", path=str(tmp_path / "ds"), image_key="img")
    train, test = load_splits(cfg, seed=0)
    assert (len(train.labels), len(test.labels)) == (30, 10)
    data = materialize(train, partition_indices(train.labels, 3, 1, PartitionConfig(), seed=0))
    assert data.x.shape == (10, 3, 32, 32)
    with pytest.raises(DatasetUnavailableError, match="column 'image' not in"):
        load_splits(DatasetConfig(name="hf_disk", path=str(tmp_path / "ds")), seed=0)


def test_hub_loader_on_a_local_dataset(tmp_path):
    """The CIFAR-10 path (Flower Datasets' FederatedDataset) on a dataset the test builds."""
    (tmp_path / "data").mkdir()
    _image_dataset(40, 0).to_parquet(tmp_path / "data" / "train-00000.parquet")
    _image_dataset(12, 1).to_parquet(tmp_path / "data" / "test-00000.parquet")
    cfg = DatasetConfig(name="cifar10", hf_name=str(tmp_path), image_key="img")
    train, test = load_splits(cfg, seed=0)
    assert (len(train.labels), len(test.labels)) == (40, 12)
    spec = data_spec(train, test)
    assert spec == DataSpec((3, 32, 32), 10)


def test_any_hub_dataset_without_a_test_split_holds_one_out(tmp_path):
    """dataset=hf: a tabular dataset (a list column, not images) with a train split only."""
    import datasets

    (tmp_path / "data").mkdir()
    rows = {"features": [[float(i), 1.0] for i in range(50)], "label": [i % 2 for i in range(50)]}
    datasets.Dataset.from_dict(rows).to_parquet(tmp_path / "data" / "train-00000.parquet")
    cfg = DatasetConfig(name="hf", hf_name=str(tmp_path), image_key="features", test_fraction=0.2)
    train, test = load_splits(cfg, seed=0)
    assert (len(train.labels), len(test.labels)) == (40, 10)
    assert data_spec(train, test) == DataSpec((2,), 2)


@pytest.mark.parametrize(("name", "hf_name"), [("cifar10", "uoft-cs/cifar10"), ("hf", "someone/some-dataset")])
def test_hub_dataset_offline_fails_with_what_to_do(name, hf_name):
    code = (
        "from app.config.schema import DatasetConfig\nfrom app.task.data import load_splits\n"
        f"load_splits(DatasetConfig(name={name!r}, hf_name={hf_name!r}, image_key='img'), 0)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": "/nonexistent-hf-home"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert f"DatasetUnavailableError: dataset={name} could not be loaded from the Hugging Face Hub ({hf_name})" in (
        proc.stderr
    )
    assert "HF_HUB_OFFLINE is set: offline mode" in proc.stderr and "dataset=hf_disk" in proc.stderr


def test_a_process_builds_a_partitioner_once_and_serves_every_partition_from_it(monkeypatch):
    """A simulation worker serves many nodes: the partitioner (seconds to build on large data)
    is kept per labels, partition count, config and seed; other labels of the same length get
    their own, and only the newest few are kept."""
    import app.task.data as data_module

    built = []
    real = data_module._PARTITIONERS["iid"]

    def counting(num_partitions, cfg, seed):
        built.append(num_partitions)
        return real(num_partitions, cfg, seed)

    monkeypatch.setitem(data_module._PARTITIONERS._table, "iid", counting)
    monkeypatch.setattr(data_module, "_BUILT", type(data_module._BUILT)({("older",): None}))
    monkeypatch.setattr(data_module, "_KEEP", 2)
    labels, cfg = np.arange(1000) % 10, PartitionConfig()
    parts = [partition_indices(labels, 50, i, cfg, seed=3) for i in range(50)]
    assert built == [50]
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))  # every row in exactly one partition
    assert partition_indices(labels.copy(), 50, 7, cfg, seed=3).tolist() == parts[7].tolist()  # same labels: kept
    partition_indices(np.roll(labels, 1), 50, 0, cfg, seed=3)
    assert built == [50, 50] and list(data_module._BUILT)[0] != ("older",) and len(data_module._BUILT) == 2


def test_export_partitions_shows_the_quoted_node_config_flower_needs(tmp_path, capsys):
    from tests.helpers import load_script

    script = load_script("export_partitions")
    with pytest.raises(SystemExit):
        script.main(["--help"])
    assert "--node-config 'data-path=\"/abs/path/data/partition-0.npz\"'" in capsys.readouterr().out
    script.main(["--num-partitions", "2", "--out", str(tmp_path / "data")])
    printed = capsys.readouterr().out
    assert f"--node-config 'data-path=\"{(tmp_path / 'data' / 'partition-1.npz').resolve()}\"'" in printed
