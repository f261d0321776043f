"""Coordinate-wise median and trimmed mean of client updates.

Yin et al. 2018, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical
Rates", https://arxiv.org/abs/1803.01498. Per coordinate, the median (resp. the mean
after dropping the k largest and k smallest values, k = floor(trim_ratio · n)) of the
n client updates is added to the global model. Unweighted: example counts are claims
a Byzantine client could inflate.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from strategies.replies import Screened
from strategies.robust import RobustStrategy, median_too_few
from strategies.robust_ops import apply_update, coordinatewise
from strategies.tensor_ops import TensorDict

log = logging.getLogger("flwr.fedgpu." + __name__)


class CoordinateMedian(RobustStrategy):
    """Coordinate-wise median; tolerates f Byzantine clients when n >= 2f + 1."""

    def too_few(self, n: int) -> str | None:
        return median_too_few(n, self.num_byzantine)

    def trim(self, n: int) -> int | None:
        return None

    def robust_aggregate(self, server_round: int, screened: Screened) -> TensorDict | None:
        models = [r.arrays for r in screened.valid]
        trim = self.trim(len(models))
        log.info(
            "round %d: %s over %d updates%s",
            server_round,
            type(self).__name__,
            len(models),
            f", trimming {trim} per side" if trim else "",
        )
        return apply_update(self._global, coordinatewise(models, self.bases(screened), trim, self.device))


class TrimmedMean(CoordinateMedian):
    """Coordinate-wise trimmed mean; robust to f Byzantine clients when k >= f."""

    def __init__(self, *, trim_ratio: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= trim_ratio < 0.5:
            raise ValueError(f"trim_ratio={trim_ratio} must be in [0, 0.5)")
        self.trim_ratio = trim_ratio

    def summary(self) -> None:
        super().summary()
        log.info("TrimmedMean: trims floor(%.3f * n) updates at each end of every coordinate", self.trim_ratio)

    def trim(self, n: int) -> int:
        return math.floor(self.trim_ratio * n)

    def too_few(self, n: int) -> str | None:
        k, f = self.trim(n), self.num_byzantine
        if n - 2 * k < 1:
            return f"strategy.trim_ratio={self.trim_ratio} trims all {n} replies"
        if k < f:
            return f"strategy.trim_ratio={self.trim_ratio} trims {k} per side of n={n} replies, fewer than strategy.num_byzantine={f}"
        return None
