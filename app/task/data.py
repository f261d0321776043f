"""Datasets, splits and partitions.

Every dataset becomes a `Source`: labels that are cheap to read (partitioners only
need those) and images decoded on demand for a set of indices (a client decodes only
its own partition). Partitions come from Flower Datasets partitioners applied to a
seeded shuffle of the label column, so every node computes the same split by itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from app.config.registry import Registry
from app.config.schema import DATASETS, HUB_DATASETS, PARTITIONS, ConfigError, DatasetConfig, PartitionConfig

if TYPE_CHECKING:
    from flwr_datasets.partitioner import Partitioner


class DatasetUnavailableError(RuntimeError):
    """A dataset could not be loaded (offline, missing file); says what to do."""


@dataclass(frozen=True)
class DataSpec:
    """What the model needs to know about the data; the server sends it to clients."""

    channels: int
    height: int
    width: int
    num_classes: int


SPEC_KEYS = ("data.channels", "data.height", "data.width", "data.num_classes")


def spec_to_record(spec: DataSpec) -> dict[str, int]:
    """The data spec as ConfigRecord keys (the server sends it with every message)."""
    return dict(zip(SPEC_KEYS, (spec.channels, spec.height, spec.width, spec.num_classes), strict=True))


def spec_from_record(record: dict) -> DataSpec:
    missing = [k for k in SPEC_KEYS if k not in record]
    if missing:
        raise ValueError(f"message config lacks {missing}; is the ServerApp from this app?")
    return DataSpec(*(int(record[k]) for k in SPEC_KEYS))


@dataclass
class ImageTensors:
    """Images as N x C x H x W (uint8 0-255, or float32 0-1) and int64 labels."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


class Source(Protocol):
    labels: np.ndarray

    def images(self, idx: np.ndarray) -> np.ndarray: ...


def to_nchw(x: np.ndarray) -> np.ndarray:
    """Accept N x H x W, N x C x H x W or N x H x W x C images; return N x C x H x W."""
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4:
        channels_first = x.shape[1] in (1, 3, 4)
        channels_last = x.shape[-1] in (1, 3, 4)
        if channels_last and not channels_first:
            x = x.transpose(0, 3, 1, 2)
        elif not channels_first:
            raise DatasetUnavailableError(f"cannot tell the channel axis of images shaped {x.shape}")
    else:
        raise DatasetUnavailableError(f"images must be N x H x W or N x C x H x W, got shape {x.shape}")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if np.issubdtype(x.dtype, np.floating):
        return np.ascontiguousarray(x, dtype=np.float32)
    if np.issubdtype(x.dtype, np.integer) and x.size and x.min() >= 0 and x.max() <= 255:
        return np.ascontiguousarray(x, dtype=np.uint8)
    raise DatasetUnavailableError(f"image values must be uint8 0-255 or float 0-1, got dtype {x.dtype}")


@dataclass
class ArraySource:
    """Images held in memory (digits, .npz files)."""

    x: np.ndarray
    labels: np.ndarray

    def images(self, idx: np.ndarray) -> np.ndarray:
        return self.x[idx]


class HFSource:
    """A Hugging Face `datasets.Dataset`; images are decoded only when asked for."""

    def __init__(self, ds, image_key: str, label_key: str) -> None:  # noqa: ANN001
        for key in (image_key, label_key):
            if key not in ds.column_names:
                raise DatasetUnavailableError(
                    f"column {key!r} not in dataset columns {ds.column_names}; "
                    "set dataset.image_key / dataset.label_key"
                )
        self.ds, self.image_key = ds, image_key
        self.labels = np.asarray(ds.select_columns([label_key]).with_format("numpy")[label_key], dtype=np.int64)

    def images(self, idx: np.ndarray) -> np.ndarray:
        rows = self.ds.select(idx.tolist()).select_columns([self.image_key])
        return to_nchw(np.stack([np.asarray(img) for img in rows[self.image_key]]))


def holdout_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (train, held-out) index split."""
    order = np.random.default_rng(seed).permutation(n)
    cut = max(1, math.ceil(n * fraction))
    return np.sort(order[cut:]), np.sort(order[:cut])


@dataclass
class SubsetSource:
    base: Source
    idx: np.ndarray

    def __post_init__(self) -> None:
        self.labels = self.base.labels[self.idx]

    def images(self, idx: np.ndarray) -> np.ndarray:
        return self.base.images(self.idx[idx])


def _split_pair(full: Source, cfg: DatasetConfig, seed: int) -> tuple[Source, Source]:
    train_idx, test_idx = holdout_split(len(full.labels), cfg.test_fraction, seed)
    return SubsetSource(full, train_idx), SubsetSource(full, test_idx)


def _load_digits() -> ArraySource:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # Pixel values are 0..16; store them as 0..255 like every other image source.
    x = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)
    return ArraySource(to_nchw(x), bunch.target.astype(np.int64))


def _load_npz(path: str) -> tuple[ArraySource, ArraySource | None]:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as err:
        raise DatasetUnavailableError(f"cannot read npz file {path}: {err}") from err
    for key in ("x", "y"):
        if key not in arrays:
            raise DatasetUnavailableError(f"{path} has no array {key!r} (found {sorted(arrays)})")

    def pair(xk: str, yk: str) -> ArraySource:
        x, y = to_nchw(arrays[xk]), np.asarray(arrays[yk]).astype(np.int64).reshape(-1)
        if len(x) != len(y):
            raise DatasetUnavailableError(f"{path}: {xk} has {len(x)} rows but {yk} has {len(y)}")
        return ArraySource(x, y)

    test = pair("x_test", "y_test") if "x_test" in arrays and "y_test" in arrays else None
    return pair("x", "y"), test


def _load_disk(cfg: DatasetConfig, path: str) -> tuple[HFSource, HFSource | None]:
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as err:
        raise DatasetUnavailableError(f"cannot load a save_to_disk dataset from {path}: {err}") from err
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DatasetUnavailableError(f"{path} has splits {list(loaded)}, needs 'train'")
        test = loaded["test"] if "test" in loaded else None
        loaded = loaded["train"]
    else:
        test = None
    make = lambda ds: HFSource(ds, cfg.image_key, cfg.label_key)  # noqa: E731
    return make(loaded), (make(test) if test is not None else None)


def _load_hub(cfg: DatasetConfig, seed: int) -> tuple[HFSource, HFSource]:
    from flwr_datasets import FederatedDataset

    try:
        # Partitioning happens in `partition_indices` (the same for every source), so
        # the FederatedDataset is used for loading and its seeded shuffle only.
        fds = FederatedDataset(dataset=cfg.hf_name, partitioners={"train": 1}, shuffle=True, seed=seed)
        train, test = fds.load_split("train"), fds.load_split("test")
    except Exception as err:  # noqa: BLE001 - hub failures come in many types
        raise DatasetUnavailableError(
            f"dataset={cfg.name} could not be loaded from the Hugging Face Hub "
            f"({cfg.hf_name}): {type(err).__name__}: {err}. This machine is probably "
            "offline. Run once with network access to fill the Hugging Face cache, or "
            "save the dataset with `save_to_disk` elsewhere and use dataset=hf_disk "
            "dataset.path=<dir>, or use dataset=npz / dataset=digits."
        ) from err
    return HFSource(train, cfg.image_key, cfg.label_key), HFSource(test, cfg.image_key, cfg.label_key)


def _own_test_split(pair: tuple[Source, Source | None], cfg: DatasetConfig, seed: int) -> tuple[Source, Source]:
    """A file's own test split, else a seeded hold-out of its training data."""
    train, test = pair
    return (train, test) if test is not None else _split_pair(train, cfg, seed)


_LOADERS: Registry[Callable[[DatasetConfig, int], tuple[Source, Source]]] = Registry(
    "dataset.name",
    DATASETS,
    {
        "digits": lambda cfg, seed: _split_pair(_load_digits(), cfg, seed),
        **dict.fromkeys(HUB_DATASETS, _load_hub),
        "npz": lambda cfg, seed: _own_test_split(_load_npz(cfg.path), cfg, seed),
        "hf_disk": lambda cfg, seed: _own_test_split(_load_disk(cfg, cfg.path), cfg, seed),
    },
)


@lru_cache(maxsize=4)
def load_splits(cfg: DatasetConfig, seed: int) -> tuple[Source, Source]:
    """(train, test) sources of the configured dataset; cached per process."""
    return _LOADERS[cfg.name](cfg, seed)


def load_local_data(cfg: DatasetConfig, path: str, seed: int) -> Source:
    """A SuperNode's own training data (deployment): a .npz file or a save_to_disk dir."""
    if Path(path).is_dir():
        return _load_disk(cfg, path)[0]
    if Path(path).is_file():
        return _load_npz(path)[0]
    raise DatasetUnavailableError(f"node config data-path={path!r} is neither a .npz file nor a directory")


def data_spec(train: Source, test: Source) -> DataSpec:
    """Channels, image size and class count, read off the data."""
    sample = train.images(np.arange(1))
    num_classes = int(max(train.labels.max(), test.labels.max())) + 1
    return DataSpec(channels=sample.shape[1], height=sample.shape[2], width=sample.shape[3], num_classes=num_classes)


def check_partitioning(num_samples: int, num_partitions: int, cfg: PartitionConfig) -> None:
    """Reject partition counts the data cannot fill, before any training."""
    if num_partitions < 1:
        raise ConfigError(f"num-partitions={num_partitions} is invalid: must be >= 1")
    if num_partitions > num_samples:
        raise ConfigError(
            f"num-partitions={num_partitions} is invalid: more partitions than the "
            f"{num_samples} training examples; use fewer nodes or a larger dataset"
        )
    if cfg.name == "dirichlet" and num_partitions * cfg.min_partition_size > num_samples:
        raise ConfigError(
            f"partition.min_partition_size={cfg.min_partition_size} is invalid: "
            f"{num_partitions} partitions x {cfg.min_partition_size} > {num_samples} examples"
        )


def _iid(num_partitions: int, cfg: PartitionConfig, seed: int) -> Partitioner:
    from flwr_datasets.partitioner import IidPartitioner

    return IidPartitioner(num_partitions=num_partitions)


def _dirichlet(num_partitions: int, cfg: PartitionConfig, seed: int) -> Partitioner:
    from flwr_datasets.partitioner import DirichletPartitioner

    return DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        alpha=cfg.alpha,
        min_partition_size=cfg.min_partition_size,
        self_balancing=False,
        shuffle=True,
        seed=seed,
    )


# Flower Datasets is imported on first use (it pulls in Hugging Face datasets).
_PARTITIONERS: Registry[Callable[[int, PartitionConfig, int], Partitioner]] = Registry(
    "partition.name", PARTITIONS, {"iid": _iid, "dirichlet": _dirichlet}
)


def partition_indices(
    labels: np.ndarray, num_partitions: int, partition_id: int, cfg: PartitionConfig, seed: int
) -> np.ndarray:
    """Row indices of one partition, via Flower Datasets partitioners (seeded)."""
    import datasets

    datasets.disable_progress_bars()

    check_partitioning(len(labels), num_partitions, cfg)
    if not 0 <= partition_id < num_partitions:
        raise ConfigError(f"partition-id={partition_id} is invalid: must be in [0, {num_partitions})")
    table = datasets.Dataset.from_dict({"label": labels, "row": np.arange(len(labels))})
    table = table.shuffle(seed=seed).flatten_indices()
    partitioner = _PARTITIONERS[cfg.name](num_partitions, cfg, seed)
    partitioner.dataset = table
    try:
        part = partitioner.load_partition(partition_id)
    except ValueError as err:
        raise ConfigError(
            f"partition.alpha={cfg.alpha} / partition.min_partition_size="
            f"{cfg.min_partition_size} cannot be met with {num_partitions} partitions: {err}"
        ) from err
    return np.sort(np.asarray(part["row"], dtype=np.int64))


def materialize(source: Source, idx: np.ndarray | None = None) -> ImageTensors:
    """Decode images and labels into tensors (the whole source when idx is None)."""
    idx = np.arange(len(source.labels)) if idx is None else idx
    x = torch.from_numpy(source.images(idx))
    return ImageTensors(x=x, y=torch.from_numpy(source.labels[idx].astype(np.int64)))


def check_spec(data: ImageTensors, spec: DataSpec, where: str) -> None:
    """A node's data must fit the global model (shape and label range)."""
    got = tuple(data.x.shape[1:])
    if got != (spec.channels, spec.height, spec.width):
        raise DatasetUnavailableError(
            f"{where}: images are {got}, the global model expects {(spec.channels, spec.height, spec.width)}"
        )
    if len(data) and (int(data.y.min()) < 0 or int(data.y.max()) >= spec.num_classes):
        raise DatasetUnavailableError(f"{where}: labels outside [0, {spec.num_classes})")


def validation_size(n: int, fraction: float) -> int:
    """How many of a partition's n examples `split_validation` keeps for validation
    (the server caps a node's claimed counts with it)."""
    return 0 if fraction <= 0 or n < 2 else max(1, math.ceil(n * fraction))


def split_validation(data: ImageTensors, fraction: float, seed: int) -> tuple[ImageTensors, ImageTensors]:
    """Keep `fraction` of a client's partition for its local (federated) evaluation."""
    if validation_size(len(data), fraction) == 0:
        return data, ImageTensors(data.x[:0], data.y[:0])
    train_idx, val_idx = holdout_split(len(data), fraction, seed)
    t, v = torch.from_numpy(train_idx), torch.from_numpy(val_idx)
    return ImageTensors(data.x[t], data.y[t]), ImageTensors(data.x[v], data.y[v])
