"""The tabular example's model and loader, named by `_target_` in conf/example/breast_cancer.yaml.

scikit-learn's Wisconsin breast-cancer data (569 tumours, 30 numeric features, benign or
malignant) ships with scikit-learn, so the example runs offline. Kept free of Hydra and of
the app's server code: every ClientApp imports this module.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

Split = tuple[np.ndarray, np.ndarray]


def load(test_fraction: float = 0.2, split_seed: int = 0) -> tuple[Split, Split]:
    """((x, y), (x_test, y_test)): a stratified split fixed by `split_seed`, not by the run's
    seed, so runs with different seeds are scored on the same test tumours.

    Features are standardised with the training split's mean and standard deviation only:
    statistics of the test split would leak it into training. (In this simulation every node
    runs the loader and gets the same statistics; a real deployment would ship them.)
    """
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    x, y = load_breast_cancer(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=split_seed, stratify=y
    )
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std == 0] = 1.0

    def scale(a: np.ndarray) -> np.ndarray:
        return ((a - mean) / std).astype(np.float32)

    return (scale(x_train), y_train.astype(np.int64)), (scale(x_test), y_test.astype(np.int64))


class MLP(nn.Module):
    """Two hidden layers for any input shape (flattened). No BatchNorm: its running statistics
    would be averaged across nodes whose label mixes differ (the Dirichlet split)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(input_shape), hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))
