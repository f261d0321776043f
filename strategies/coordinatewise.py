"""Coordinate-wise median and trimmed mean of client updates.

Yin et al. 2018, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical
Rates", https://arxiv.org/abs/1803.01498. Per coordinate, the median (resp. the mean
after dropping the k largest and k smallest values, k = floor(trim_ratio · n)) of the
n client updates is added to the global model. Unweighted: example counts are claims
a Byzantine client could inflate.

`MedianRule` and `TrimmedMeanRule` aggregate in a synchronous round (`RobustStrategy`,
named `CoordinateMedian` and `TrimmedMean` in logs and checkpoints) or FedBuff's buffer.
"""

from __future__ import annotations

import logging
import math

import torch

from strategies.replies import Screened
from strategies.robust import RobustRule, RuleReport, RuleSettings, median_too_few
from strategies.robust_ops import apply_update, coordinatewise, stage_groups
from strategies.tensor_ops import TensorDict

log = logging.getLogger("flwr.fedgpu." + __name__)


class MedianRule(RobustRule):
    """The coordinate-wise median of the updates; tolerates f Byzantine clients when n >= 2f + 1.

    Parameters
    ----------
    num_byzantine, on_too_few, device
        As in `RobustRule`.
    """

    name = "CoordinateMedian"

    def too_few(self, n: int) -> str | None:
        return median_too_few(n, self.num_byzantine)

    def trim(self, n: int) -> int | None:
        """Updates dropped at each end of every coordinate (None: the median)."""
        return None

    def combine(
        self, server_round: int, current: TensorDict, screened: Screened, bases: list[TensorDict], report: RuleReport
    ) -> TensorDict | None:
        (current,), models, bases = stage_groups(self.device, [current], [r.arrays for r in screened.valid], bases)
        trim = self.trim(len(models))
        log.info(
            "round %d: %s over %d updates%s",
            server_round,
            self.name,
            len(models),
            f", trimming {trim} per side" if trim else "",
        )
        return apply_update(current, coordinatewise(models, bases, trim, self.device))


class TrimmedMeanRule(MedianRule):
    """The coordinate-wise trimmed mean of the updates; tolerates f Byzantine clients when k >= f.

    Parameters
    ----------
    trim_ratio : float (default: 0.1)
        Updates dropped at each end of every coordinate: k = floor(trim_ratio · n), in [0, 0.5).
    num_byzantine, on_too_few, device
        As in `RobustRule`.
    """

    name = "TrimmedMean"

    def __init__(
        self,
        *,
        num_byzantine: int = 0,
        trim_ratio: float = 0.1,
        on_too_few: str = "skip",
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(num_byzantine=num_byzantine, on_too_few=on_too_few, device=device)
        if not 0.0 <= trim_ratio < 0.5:
            raise ValueError(f"trim_ratio={trim_ratio} must be in [0, 0.5)")
        self.trim_ratio = trim_ratio

    @classmethod
    def from_config(cls, st: RuleSettings, device: torch.device | str = "cpu") -> TrimmedMeanRule:
        return cls(num_byzantine=st.num_byzantine, trim_ratio=st.trim_ratio, on_too_few=st.on_too_few, device=device)

    def summary(self) -> None:
        super().summary()
        log.info("%s: trims floor(%.3f * n) updates at each end of every coordinate", self.name, self.trim_ratio)

    def trim(self, n: int) -> int:
        return math.floor(self.trim_ratio * n)

    def too_few(self, n: int) -> str | None:
        k, f = self.trim(n), self.num_byzantine
        if n - 2 * k < 1:
            return f"strategy.trim_ratio={self.trim_ratio} trims all {n} replies"
        if k < f:
            return f"strategy.trim_ratio={self.trim_ratio} trims {k} per side of n={n} replies, fewer than strategy.num_byzantine={f}"
        return None
