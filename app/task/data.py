"""Datasets, splits and partitions.

Every dataset becomes a `Source`: labels that are cheap to read (partitioners only
need those) and images decoded on demand for a set of indices (a client decodes only
its own partition). Partitions come from Flower Datasets partitioners applied to a
seeded shuffle of the label column, so every node computes the same split by itself.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from app.config.registry import Registry
from app.config.schema import (
    DATASETS,
    HUB_DATASETS,
    PARTITIONS,
    ConfigError,
    DatasetConfig,
    ModelConfig,
    PartitionConfig,
)
from app.task.user_code import call, call_parameters

if TYPE_CHECKING:
    import datasets
    from flwr_datasets.partitioner import Partitioner


class DatasetUnavailableError(RuntimeError):
    """A dataset could not be loaded (offline, missing file); says what to do."""


@dataclass(frozen=True)
class DataSpec:
    """What the model needs to know about the data; the server sends it to clients."""

    input_shape: tuple[int, ...]  # one example: C x H x W images, F features, T x F sequences, ...
    num_classes: int  # the model's outputs: classes, or targets per example when multilabel
    multilabel: bool = False  # targets are N x K 0/1 values (multi-label; binary when K = 1)
    causal_lm: bool = False  # inputs are N x T token ids, targets their N x T next tokens; num_classes: tokens used

    def image_shape(self, model: str) -> tuple[int, int, int]:
        """(C, H, W) for an image model; a ConfigError naming the model for other data."""
        if len(self.input_shape) != 3:
            raise ConfigError(
                f"model.name={model} takes images (C x H x W per example), but this data's examples are "
                f"shaped {self.input_shape}; use model=custom with a model for this data (docs/own-task.md)"
            )
        c, h, w = self.input_shape
        return c, h, w


SPEC_KEYS = ("data.input_shape", "data.num_classes", "data.multilabel", "data.causal_lm")


def spec_to_record(spec: DataSpec) -> dict[str, Any]:
    """The data spec as ConfigRecord keys (the server sends it with every message)."""
    values = (list(spec.input_shape), spec.num_classes, spec.multilabel, spec.causal_lm)
    return dict(zip(SPEC_KEYS, values, strict=True))


def spec_from_record(record: dict) -> DataSpec:
    missing = [k for k in SPEC_KEYS if k not in record]
    if missing:
        raise ValueError(f"message config lacks {missing}; is the ServerApp from this app?")
    shape, classes, multilabel, causal_lm = (record[k] for k in SPEC_KEYS)
    return DataSpec(tuple(int(d) for d in shape), int(classes), bool(multilabel), bool(causal_lm))


@dataclass
class Examples:
    """Inputs (N x ...: uint8 0-255 images, float32, or int64 such as token ids) and targets
    (int64 class indices N, or float32 0/1 N x K)."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


class Source(Protocol):
    labels: np.ndarray  # N class indices, or N x K 0/1 targets

    def inputs(self, idx: np.ndarray) -> np.ndarray: ...


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


def any_inputs(x: Any, where: str) -> np.ndarray:  # noqa: ANN401
    """Inputs of any shape as they are: uint8 stays (scaled to 0-1 on the device), other
    integers become int64 (token ids), bool and floats float32."""
    x = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if x.ndim < 2:
        raise DatasetUnavailableError(f"{where}: inputs must be N x ... (one row per example), got shape {x.shape}")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if np.issubdtype(x.dtype, np.integer):
        return np.ascontiguousarray(x, dtype=np.int64)
    if x.dtype == np.bool_ or np.issubdtype(x.dtype, np.floating):
        return np.ascontiguousarray(x, dtype=np.float32)
    raise DatasetUnavailableError(f"{where}: inputs must be numbers, got dtype {x.dtype}")


def targets(y: Any, where: str) -> np.ndarray:  # noqa: ANN401
    """N class indices (int64), or N x K 0/1 targets (float32: multi-label, binary with K = 1)."""
    y = y.numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    if y.ndim == 2 and y.shape[1] > 0:
        if y.size and not np.isin(y, (0, 1)).all():
            raise DatasetUnavailableError(f"{where}: N x K targets must be 0 or 1 (multi-label), got other values")
        return y.astype(np.float32)
    if y.ndim != 1:
        raise DatasetUnavailableError(f"{where}: labels must be N class indices or N x K 0/1 targets, got {y.shape}")
    if y.size and np.issubdtype(y.dtype, np.floating) and not np.equal(np.mod(y, 1), 0).all():
        raise DatasetUnavailableError(f"{where}: class labels must be whole numbers, got {y.dtype} fractions")
    if y.size and y.min() < 0:
        raise DatasetUnavailableError(f"{where}: class labels must be >= 0, got {y.min()}")
    return y.astype(np.int64)


@dataclass
class ArraySource:
    """Inputs held in memory (digits, .npz files, a loader's arrays)."""

    x: np.ndarray
    labels: np.ndarray

    def inputs(self, idx: np.ndarray) -> np.ndarray:
        return self.x[idx]


class HFSource:
    """A Hugging Face `datasets.Dataset`; inputs are decoded only when asked for. An `Image`
    column becomes N x C x H x W images; any other column is taken as it is."""

    def __init__(self, ds, image_key: str, label_key: str) -> None:  # noqa: ANN001
        import datasets

        for key in (image_key, label_key):
            if key not in ds.column_names:
                raise DatasetUnavailableError(
                    f"column {key!r} not in dataset columns {ds.column_names}; "
                    "set dataset.image_key (the input column) / dataset.label_key"
                )
        self.ds, self.image_key = ds, image_key
        self.is_image = isinstance(ds.features.get(image_key), datasets.Image)
        self.labels = targets(ds.select_columns([label_key]).with_format("numpy")[label_key], f"column {label_key!r}")

    def inputs(self, idx: np.ndarray) -> np.ndarray:
        rows = self.ds.select(idx.tolist()).select_columns([self.image_key])
        values = np.stack([np.asarray(v) for v in rows[self.image_key]])
        return to_nchw(values) if self.is_image else any_inputs(values, f"column {self.image_key!r}")


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

    def inputs(self, idx: np.ndarray) -> np.ndarray:
        return self.base.inputs(self.idx[idx])


def _split_pair(full: Source, cfg: DatasetConfig, seed: int) -> tuple[Source, Source]:
    train_idx, test_idx = holdout_split(len(full.labels), cfg.test_fraction, seed)
    return SubsetSource(full, train_idx), SubsetSource(full, test_idx)


def _load_digits() -> ArraySource:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # Pixel values are 0..16; store them as 0..255 like every other image source.
    x = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)
    return ArraySource(to_nchw(x), bunch.target.astype(np.int64))


def _load_npz(path: str, images: bool = True) -> tuple[ArraySource, ArraySource | None]:
    """x, y (and x_test, y_test) from a .npz file; `images`: x holds images (dataset=npz),
    else inputs of any shape (a node's own data under dataset=python)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as err:
        raise DatasetUnavailableError(f"cannot read npz file {path}: {err}") from err
    for key in ("x", "y"):
        if key not in arrays:
            raise DatasetUnavailableError(f"{path} has no array {key!r} (found {sorted(arrays)})")

    def pair(xk: str, yk: str) -> ArraySource:
        x = to_nchw(arrays[xk]) if images else any_inputs(arrays[xk], f"{path}: {xk}")
        y = np.asarray(arrays[yk])
        if images and y.ndim == 2 and y.shape[1] == 1:
            y = y.reshape(-1)  # dataset=npz as before: an N x 1 column of class labels
        y = targets(y, f"{path}: {yk}")
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
        train = fds.load_split("train")
    except Exception as err:  # noqa: BLE001 - hub failures come in many types
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        raise DatasetUnavailableError(
            f"dataset={cfg.name} could not be loaded from the Hugging Face Hub "
            f"({cfg.hf_name}): {type(err).__name__}: {err}. "
            + (
                "HF_HUB_OFFLINE is set: offline mode, only the local Hugging Face cache was tried. "
                if offline
                else "This machine is probably offline. "
            )
            + "Run once with network access to fill the Hugging Face cache, or "
            "save the dataset with `save_to_disk` elsewhere and use dataset=hf_disk "
            "dataset.path=<dir>, or use dataset=npz / dataset=digits."
        ) from err
    try:
        test = fds.load_split("test")
    except ValueError:  # no test split: hold out test_fraction of train
        test = None
    make = lambda ds: HFSource(ds, cfg.image_key, cfg.label_key)  # noqa: E731
    return _own_test_split((make(train), make(test) if test is not None else None), cfg, seed)


def _pair(x: Any, y: Any, where: str) -> ArraySource:  # noqa: ANN401
    source = ArraySource(any_inputs(x, f"{where} inputs"), targets(y, f"{where} labels"))
    if len(source.x) != len(source.labels):
        raise DatasetUnavailableError(f"{where}: {len(source.x)} inputs but {len(source.labels)} labels")
    return source


def loader_sources(out: Any, cfg: DatasetConfig, where: str) -> tuple[Source, Source | None]:  # noqa: ANN401
    """(train, test or None) from what a dataset=python loader returned: (x, y), ((x, y),
    (x_test, y_test)), {"train": (x, y), "test": ...}, or a Hugging Face Dataset / DatasetDict."""
    if type(out).__module__.startswith("datasets"):
        import datasets

        if isinstance(out, datasets.DatasetDict):
            if "train" not in out:
                raise DatasetUnavailableError(f"{where} returned splits {list(out)}; it needs 'train'")
            test = HFSource(out["test"], cfg.image_key, cfg.label_key) if "test" in out else None
            return HFSource(out["train"], cfg.image_key, cfg.label_key), test
        if isinstance(out, datasets.Dataset):
            return HFSource(out, cfg.image_key, cfg.label_key), None
    if isinstance(out, dict) and "train" in out:
        test = out.get("test")
        return _pair(*out["train"], f"{where} train"), (_pair(*test, f"{where} test") if test is not None else None)
    if isinstance(out, tuple | list) and len(out) == 2:
        first, second = out
        if isinstance(first, tuple | list) and len(first) == 2:
            return _pair(*first, f"{where} train"), _pair(*second, f"{where} test")
        return _pair(first, second, where), None
    raise DatasetUnavailableError(
        f"{where} returned a {type(out).__name__}; expected (x, y), ((x, y), (x_test, y_test)), "
        "{'train': (x, y), 'test': (x, y)} or a Hugging Face Dataset / DatasetDict"
    )


def _load_python(cfg: DatasetConfig, **offered: Any) -> tuple[Source, Source | None]:  # noqa: ANN401
    """A dataset=python loader's data; `offered` values go to it when its signature names them."""
    out = call("dataset._target_", str(cfg.target), cfg.kwargs, offered)
    return loader_sources(out, cfg, f"dataset._target_={cfg.target}")


def _own_test_split(pair: tuple[Source, Source | None], cfg: DatasetConfig, seed: int) -> tuple[Source, Source]:
    """A file's own test split, else a seeded hold-out of its training data."""
    train, test = pair
    return (train, test) if test is not None else _split_pair(train, cfg, seed)


def _load_text(cfg: DatasetConfig, seed: int, model: ModelConfig, task_type: str) -> tuple[Source, Source]:
    from app.task.text import text_splits  # transformers' tokenizers: imported only for text

    return text_splits(cfg, model, task_type == "causal_lm", seed)


_LOADERS: Registry[Callable[[DatasetConfig, int, ModelConfig, str], tuple[Source, Source]]] = Registry(
    "dataset.name",
    DATASETS,
    {
        "digits": lambda cfg, seed, *_: _split_pair(_load_digits(), cfg, seed),
        **dict.fromkeys(HUB_DATASETS, lambda cfg, seed, *_: _load_hub(cfg, seed)),
        "npz": lambda cfg, seed, *_: _own_test_split(_load_npz(cfg.path), cfg, seed),
        "hf_disk": lambda cfg, seed, *_: _own_test_split(_load_disk(cfg, cfg.path), cfg, seed),
        "python": lambda cfg, seed, *_: _own_test_split(_load_python(cfg, seed=seed), cfg, seed),
        "text": _load_text,
    },
)


@lru_cache(maxsize=4)
def load_splits(
    cfg: DatasetConfig, seed: int, model: ModelConfig | None = None, task_type: str = "classification"
) -> tuple[Source, Source]:
    """(train, test) sources of the configured dataset; cached per process. Text is tokenized
    with `model`'s tokenizer (default: bytes) into rows for `task_type` (`app.task.text`)."""
    return _LOADERS[cfg.name](cfg, seed, model or ModelConfig(), task_type)


def load_local_data(
    cfg: DatasetConfig, path: str, seed: int, model: ModelConfig | None = None, task_type: str = "classification"
) -> Source:
    """A SuperNode's own training data (deployment): a .npz file or a save_to_disk dir, under
    dataset=python what the loader returns when it takes a `data_path` argument, under
    dataset=text its own text files (tokenized with `model`'s tokenizer)."""
    if cfg.name == "text":
        from app.task.text import text_source

        return text_source(cfg, model or ModelConfig(), task_type == "causal_lm", path)
    if cfg.name == "python" and "data_path" in call_parameters("dataset._target_", str(cfg.target)):
        return _load_python(cfg, seed=seed, data_path=path)[0]
    if not Path(path).exists():
        raise DatasetUnavailableError(
            f"node config data-path={path!r} does not exist on this node (an absolute path on the SuperNode's "
            "machine, e.g. a file from scripts/export_partitions.py; start the SuperNode with "
            "--node-config 'data-path=\"/abs/path/site.npz\"')"
        )
    if Path(path).is_file() and cfg.name == "python":
        return _load_npz(path, images=False)[0]
    if Path(path).is_dir():
        return _load_disk(cfg, path)[0]
    if Path(path).is_file():
        return _load_npz(path)[0]
    raise DatasetUnavailableError(f"node config data-path={path!r} is neither a .npz file nor a directory")


def data_spec(train: Source, test: Source, causal_lm: bool = False) -> DataSpec:
    """One example's shape and the class (or target) count, read off the data; the test
    split must agree with the training split. Causal LM: the count of token ids the data uses
    (the model's vocabulary must cover them)."""
    shape, test_shape = (tuple(int(d) for d in s.inputs(np.arange(1)).shape[1:]) for s in (train, test))
    if shape != test_shape:
        raise DatasetUnavailableError(f"training examples are shaped {shape} but test examples {test_shape}")
    if causal_lm:
        used = max(int(s.inputs(np.arange(len(s.labels))).max()) for s in (train, test))
        return DataSpec(shape, max(used, int(train.labels.max()), int(test.labels.max())) + 1, causal_lm=True)
    if train.labels.ndim == 2:
        if test.labels.ndim != 2 or test.labels.shape[1] != train.labels.shape[1]:
            raise DatasetUnavailableError(
                f"training targets are N x {train.labels.shape[1]} but test targets are shaped {test.labels.shape}"
            )
        return DataSpec(shape, int(train.labels.shape[1]), multilabel=True)
    if test.labels.ndim != 1:
        raise DatasetUnavailableError(f"training labels are class indices but test targets are {test.labels.shape}")
    return DataSpec(shape, int(max(train.labels.max(), test.labels.max(initial=0))) + 1)


def partition_key(source: Source, cfg: PartitionConfig) -> np.ndarray:
    """What the partitioner splits by: the labels, or under partition=by_file each example's file."""
    if cfg.name != "by_file":
        return source.labels
    groups = getattr(source, "groups", None)
    if groups is None:
        raise ConfigError("partition=by_file splits text files (dataset=text); this dataset has no files to split by")
    return groups


def check_partitioning(key: np.ndarray, num_partitions: int, cfg: PartitionConfig) -> None:
    """Reject partition counts the data cannot fill, before any training (`key`: `partition_key`)."""
    num_samples = len(key)
    if cfg.name == "by_file" and len(np.unique(key)) != num_partitions:
        raise ConfigError(
            f"partition=by_file makes one partition per file: the data has {len(np.unique(key))} file(s) with "
            f"examples, for {num_partitions} partitions (nodes); give as many files as nodes, or partition=iid"
        )
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
def _by_file(num_partitions: int, cfg: PartitionConfig, seed: int) -> Partitioner:
    """One partition per distinct key (`partition_key`: a file), Flower's natural-id split."""
    from flwr_datasets.partitioner import NaturalIdPartitioner

    return NaturalIdPartitioner(partition_by="label")


_PARTITIONERS: Registry[Callable[[int, PartitionConfig, int], Partitioner]] = Registry(
    "partition.name", PARTITIONS, {"iid": _iid, "dirichlet": _dirichlet, "by_file": _by_file}
)


def partition_indices(
    labels: np.ndarray, num_partitions: int, partition_id: int, cfg: PartitionConfig, seed: int
) -> np.ndarray:
    """Row indices of one partition, via Flower Datasets partitioners (seeded).

    The partitioner is built once per labels, partition count, config and seed, and kept
    (`_partitioner`): a simulation worker serves many nodes, and building it (an Arrow table
    of every label, shuffled and flattened) costs seconds, while one more partition from a
    built partitioner costs milliseconds.
    """
    check_partitioning(labels, num_partitions, cfg)
    if not 0 <= partition_id < num_partitions:
        raise ConfigError(f"partition-id={partition_id} is invalid: must be in [0, {num_partitions})")
    if labels.ndim != 1:
        if cfg.name == "dirichlet":
            raise ConfigError(
                "partition.name=dirichlet splits by class label, and N x K (multi-label) targets have none; "
                "use partition=iid, or give class labels"
            )
        labels = np.zeros(len(labels), dtype=np.int64)  # iid ignores the labels
    _PARTITIONERS[cfg.name]  # an unknown name is refused here, not taken for an unmet constraint below
    try:
        part = _load_partition(np.ascontiguousarray(labels), num_partitions, partition_id, cfg, seed)
    except ValueError as err:
        raise ConfigError(
            f"partition.alpha={cfg.alpha} / partition.min_partition_size="
            f"{cfg.min_partition_size} cannot be met with {num_partitions} partitions: {err}"
        ) from err
    return np.sort(np.asarray(part["row"], dtype=np.int64))


_BUILT: OrderedDict[tuple, Partitioner] = OrderedDict()  # the few partitioners of this process, newest last
_BUILT_LOCK = threading.Lock()  # the in-process grid's nodes are threads
_KEEP = 4


def _load_partition(
    labels: np.ndarray, num_partitions: int, partition_id: int, cfg: PartitionConfig, seed: int
) -> datasets.Dataset:
    """One partition from a Flower Datasets partitioner over a seeded shuffle of `labels`, built
    once per labels (by digest), partition count, config and seed (the last `_KEEP` are kept).
    Under the lock: partitioners compute their split lazily, at the first partition asked for."""
    digest = hashlib.blake2b(labels.view(np.uint8), digest_size=16).hexdigest()
    key = (digest, labels.dtype.str, len(labels), num_partitions, cfg, seed)
    with _BUILT_LOCK:
        if key in _BUILT:
            _BUILT.move_to_end(key)
            return _BUILT[key].load_partition(partition_id)
        import datasets

        datasets.disable_progress_bars()
        table = datasets.Dataset.from_dict({"label": labels, "row": np.arange(len(labels))})
        partitioner = _PARTITIONERS[cfg.name](num_partitions, cfg, seed)
        partitioner.dataset = table.shuffle(seed=seed).flatten_indices()
        _BUILT[key] = partitioner
        while len(_BUILT) > _KEEP:
            _BUILT.popitem(last=False)
        return partitioner.load_partition(partition_id)


def materialize(source: Source, idx: np.ndarray | None = None) -> Examples:
    """Decode inputs and targets into tensors (the whole source when idx is None)."""
    idx = np.arange(len(source.labels)) if idx is None else idx
    return Examples(x=torch.from_numpy(source.inputs(idx)), y=torch.from_numpy(source.labels[idx]))


def check_spec(data: Examples, spec: DataSpec, where: str) -> None:
    """A node's data must fit the global model (example shape, targets)."""
    got = tuple(data.x.shape[1:])
    if got != spec.input_shape:
        raise DatasetUnavailableError(
            f"{where}: examples are shaped {got}, the global model expects {spec.input_shape}"
        )
    if spec.causal_lm:
        if tuple(data.y.shape) != tuple(data.x.shape):
            raise DatasetUnavailableError(
                f"{where}: next tokens shaped {tuple(data.y.shape)}, tokens {tuple(data.x.shape)}"
            )
    elif spec.multilabel:
        if data.y.dim() != 2 or data.y.shape[1] != spec.num_classes:
            raise DatasetUnavailableError(
                f"{where}: targets are {tuple(data.y.shape)}, expected N x {spec.num_classes}"
            )
    elif data.y.dim() != 1:
        raise DatasetUnavailableError(f"{where}: targets are {tuple(data.y.shape)}, expected N class indices")
    elif len(data) and (int(data.y.min()) < 0 or int(data.y.max()) >= spec.num_classes):
        raise DatasetUnavailableError(f"{where}: labels outside [0, {spec.num_classes})")


def validation_size(n: int, fraction: float) -> int:
    """How many of a partition's n examples `split_validation` keeps for validation
    (the server caps a node's claimed counts with it)."""
    return 0 if fraction <= 0 or n < 2 else max(1, math.ceil(n * fraction))


def split_validation(data: Examples, fraction: float, seed: int) -> tuple[Examples, Examples]:
    """Keep `fraction` of a client's partition for its local (federated) evaluation."""
    if validation_size(len(data), fraction) == 0:
        return data, Examples(data.x[:0], data.y[:0])
    train_idx, val_idx = holdout_split(len(data), fraction, seed)
    t, v = torch.from_numpy(train_idx), torch.from_numpy(val_idx)
    return Examples(data.x[t], data.y[t]), Examples(data.x[v], data.y[v])
