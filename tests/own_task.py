"""A user's own task as the tests give it by `_target_`: models and loaders of several shapes,
and callables that fail in the ways the app must report."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


class MLP(nn.Module):
    """A two-layer perceptron for any input shape (flattened); `body` and `head` for fine-tuning."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.float()))


def mlp_from_spec(spec, hidden: int = 16) -> nn.Module:  # noqa: ANN001 - a DataSpec
    return MLP(spec.input_shape, spec.num_classes, hidden)


def _blobs(n: int, features: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two Gaussian classes 3 standard deviations apart along every feature."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.normal(size=(n, features)) + 1.5 * (2 * y[:, None] - 1) / math.sqrt(features)
    return x.astype(np.float32), y


def tabular(n: int = 400, features: int = 6, seed: int = 0) -> tuple:
    """((x, y), (x_test, y_test)): N x F floats, binary labels."""
    return _blobs(n, features, seed), _blobs(n // 4, features, seed + 1)


def tabular_train_only(n: int = 200, features: int = 6) -> tuple:
    return _blobs(n, features, 0)


def tabular_dict(n: int = 200) -> dict:
    return {"train": _blobs(n, 4, 0), "test": _blobs(n // 4, 4, 1)}


def sequences(n: int = 120, steps: int = 5, features: int = 3) -> tuple:
    """N x T x F float sequences as torch tensors, 3 classes."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, steps, features, generator=g), torch.arange(n) % 3


def multilabel(n: int = 200, features: int = 5, labels: int = 3) -> tuple:
    """N x F inputs, N x K 0/1 targets: label k is on when feature k is positive."""
    x = np.random.default_rng(0).normal(size=(n, features)).astype(np.float32)
    return x, (x[:, :labels] > 0).astype(np.int64)


def hf_tabular(n: int = 120):  # noqa: ANN201 - a datasets.Dataset
    import datasets

    x, y = _blobs(n, 4, 0)
    return datasets.Dataset.from_dict({"features": x.tolist(), "label": y.tolist()})


def node_file(data_path: str) -> tuple:
    """A deployed node's own data: the loader reads the node's data-path."""
    with np.load(data_path) as f:
        return f["x"], f["y"]


def mismatched(n: int = 20) -> tuple:
    return np.zeros((n, 3), np.float32), np.zeros(n + 1, np.int64)


def not_a_module() -> int:
    return 3


def broken(**kwargs: object) -> None:
    raise ValueError("the user's code failed")


def wrong_outputs(num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes + 1))


NOT_CALLABLE = 42


class OddLinear(nn.Linear):
    """A layer type a test declares unsupported by Opacus."""
