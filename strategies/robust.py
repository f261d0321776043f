"""Common ground of the Byzantine-robust strategies: the too-few-replies policy.

A robust rule tolerating f Byzantine clients needs enough valid replies (Krum:
n >= 2f + 3). When a round brings fewer, the configured policy applies and is
logged: `skip` keeps the previous model, `fallback` takes the coordinate-wise
median of the valid replies if there are at least 2f + 1 of them (the median's own
bound: f attackers cannot outnumber the honest middle), and skips otherwise: the
median of 2 replies is their mean, which one attacker moves anywhere. Never a silent
plain average.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import Any

from strategies.fedavg import FedAvg
from strategies.replies import Screened, reject
from strategies.robust_ops import apply_update, coordinatewise
from strategies.tensor_ops import TensorDict, is_finite

log = logging.getLogger("flwr.fedgpu." + __name__)

POLICIES = ("skip", "fallback")


def median_too_few(n: int, f: int) -> str | None:
    """Why a coordinate-wise median of n replies does not tolerate f Byzantine ones."""
    if n < 2 * f + 1:
        return f"strategy.num_byzantine={f} needs n >= 2f+1 = {2 * f + 1} valid replies for a median (n={n})"
    return None


class RobustStrategy(FedAvg):
    """FedAvg's sampling and screening with a robust rule in place of the mean."""

    screen_finite = True

    def __init__(self, *, num_byzantine: int = 0, on_too_few: str = "skip", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if num_byzantine < 0:
            raise ValueError(f"num_byzantine={num_byzantine} must be >= 0")
        if on_too_few not in POLICIES:
            raise ValueError(f"on_too_few={on_too_few!r} must be one of {POLICIES}")
        self.num_byzantine = num_byzantine
        self.on_too_few = on_too_few

    def summary(self) -> None:
        super().summary()
        log.info(
            "%s: tolerates f=%d Byzantine clients; too few valid replies -> %s",
            type(self).__name__,
            self.num_byzantine,
            self.on_too_few,
        )

    @abstractmethod
    def too_few(self, n: int) -> str | None:
        """Why n valid replies are not enough for this rule (None when they are)."""

    @abstractmethod
    def robust_aggregate(self, server_round: int, screened: Screened) -> TensorDict | None:
        """The new global model from enough valid replies."""

    def cohort_problem(self, cohort: int) -> str | None:
        """Checked before the first round: a cohort this size could never be enough."""
        reason = self.too_few(cohort)
        return None if reason is None else f"{reason}, but a round samples at most {cohort} clients"

    def bases(self, screened: Screened) -> list[TensorDict]:
        """The model each reply trained from: its own version in the asynchronous buffer,
        the one global model in a synchronous round."""
        return [self._global if r.base is None else r.base for r in screened.valid]

    def aggregate_models(self, server_round: int, screened: Screened) -> TensorDict | None:
        self.train_report.excluded, self.train_report.scores, self.train_report.policy = [], {}, None
        reason = self.too_few(len(screened.valid))
        if reason is None:
            return self.robust_aggregate(server_round, screened)
        return self.apply_policy(server_round, screened, reason)

    def apply_policy(self, server_round: int, screened: Screened, reason: str) -> TensorDict | None:
        if self.on_too_few == "fallback":
            for reply in list(screened.valid):
                if not all(is_finite(t) for t in reply.arrays.values()):
                    reject(screened, reply, "non-finite values (NaN or Inf)")
            problem = median_too_few(len(screened.valid), self.num_byzantine)
            if problem is None:
                self.train_report.policy = "fallback-median"
                log.warning(
                    "round %d: %s; policy fallback: coordinate-wise median of %d replies",
                    server_round,
                    reason,
                    len(screened.valid),
                )
                models = [r.arrays for r in screened.valid]
                return apply_update(self._global, coordinatewise(models, self.bases(screened), None, self.device))
            reason = f"{reason}; policy fallback cannot help: {problem}"
        self.train_report.policy = "skip"
        log.warning("round %d: %s; skipping the round: keeping the previous global model", server_round, reason)
        return None
