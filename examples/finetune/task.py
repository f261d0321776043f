"""The fine-tuning example's loader, named by `_target_` in conf/example/finetune.yaml.

Kept free of Hydra and of the app's server code: every ClientApp imports this module.
"""

from __future__ import annotations

import numpy as np

HALVES = ("a", "b")


def half(which: str = "b", split_seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(x, y): one half of scikit-learn's 1797 handwritten digits, as N x 1 x 8 x 8 uint8 images
    scaled like the app's default `digits` data (0..16 to 0..255).

    Half "a" is what the model is pretrained on centrally, half "b" what the federation
    fine-tunes on (the run holds out `dataset.test_fraction` of it for its test split), so the
    federated test examples were never seen in pretraining. `split_seed` fixes the halves
    independently of the run's seed.
    """
    from sklearn.datasets import load_digits

    if which not in HALVES:
        raise ValueError(f"which={which!r}: expected one of {HALVES}")
    bunch = load_digits()
    x = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    order = np.random.default_rng(split_seed).permutation(len(x))
    rows = order[: len(x) // 2] if which == "a" else order[len(x) // 2 :]
    return x[rows], bunch.target[rows].astype(np.int64)
