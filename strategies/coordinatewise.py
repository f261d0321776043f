"""Coordinate-wise median and trimmed mean of client updates.

Yin et al. 2018, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical
Rates", https://arxiv.org/abs/1803.01498. Per coordinate, the median (resp. the mean
after dropping the k largest and k smallest values, k = floor(trim_ratio · n)) of the
n client updates is added to the global model. Unweighted: example counts are claims
a Byzantine client could inflate.

`MedianRule` and `TrimmedMeanRule` aggregate (in a synchronous round or FedBuff's
buffer); `CoordinateMedian` and `TrimmedMean` are the synchronous strategies built on
them.
"""

from __future__ import annotations

import logging
import math

import torch

from strategies.replies import Screened, WeightCap
from strategies.robust import RobustRule, RobustStrategy, RuleReport, median_too_few
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


class CoordinateMedian(RobustStrategy):
    """Coordinate-wise median [Yin et al., 2018]: each round adds the per-coordinate
    median of the client updates to the global model.

    Parameters
    ----------
    num_byzantine : int (default: 0)
        f, the Byzantine clients to tolerate: a round needs n >= 2f + 1 valid replies.
    on_too_few : str (default: "skip")
        "skip" or "fallback": the policy for rounds with too few valid replies
        (`strategies.robust`).
    fraction_train, min_train_nodes, fraction_evaluate, min_evaluate_nodes
        Who trains and evaluates each round, as in `FedAvg`.
    min_available_nodes, message_ttl_s, device, weight_cap
        Nodes to wait for, message lifetime, aggregation device and the cap on claimed
        example counts, as in `FedAvg`.
    """

    def __init__(
        self,
        *,
        num_byzantine: int = 0,
        on_too_few: str = "skip",
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        fraction_evaluate: float = 0.0,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        message_ttl_s: float = 3600.0,
        device: torch.device | str = "cpu",
        weight_cap: WeightCap | None = None,
    ) -> None:
        super().__init__(
            rule=MedianRule(num_byzantine=num_byzantine, on_too_few=on_too_few, device=device),
            fraction_train=fraction_train,
            min_train_nodes=min_train_nodes,
            fraction_evaluate=fraction_evaluate,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            message_ttl_s=message_ttl_s,
            device=device,
            weight_cap=weight_cap,
        )


class TrimmedMean(RobustStrategy):
    """Coordinate-wise trimmed mean [Yin et al., 2018]: each round adds the per-coordinate
    mean of the client updates, less the k largest and k smallest, to the global model.

    Parameters
    ----------
    num_byzantine : int (default: 0)
        f, the Byzantine clients to tolerate: a round needs k = floor(trim_ratio · n) >= f.
    trim_ratio : float (default: 0.1)
        The fraction trimmed at each end of every coordinate, in [0, 0.5).
    on_too_few : str (default: "skip")
        "skip" or "fallback": the policy for rounds with too few valid replies
        (`strategies.robust`).
    fraction_train, min_train_nodes, fraction_evaluate, min_evaluate_nodes
        Who trains and evaluates each round, as in `FedAvg`.
    min_available_nodes, message_ttl_s, device, weight_cap
        Nodes to wait for, message lifetime, aggregation device and the cap on claimed
        example counts, as in `FedAvg`.
    """

    def __init__(
        self,
        *,
        num_byzantine: int = 0,
        trim_ratio: float = 0.1,
        on_too_few: str = "skip",
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        fraction_evaluate: float = 0.0,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        message_ttl_s: float = 3600.0,
        device: torch.device | str = "cpu",
        weight_cap: WeightCap | None = None,
    ) -> None:
        super().__init__(
            rule=TrimmedMeanRule(
                num_byzantine=num_byzantine, trim_ratio=trim_ratio, on_too_few=on_too_few, device=device
            ),
            fraction_train=fraction_train,
            min_train_nodes=min_train_nodes,
            fraction_evaluate=fraction_evaluate,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            message_ttl_s=message_ttl_s,
            device=device,
            weight_cap=weight_cap,
        )
