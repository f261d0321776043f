"""Krum and Multi-Krum on client updates.

Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine Tolerant
Gradient Descent", https://arxiv.org/abs/1703.02757 (Krum; Multi-Krum averages the m
best-scored updates). Each client's score is the sum of squared distances from its
update to its n − f − 2 nearest neighbours; the lowest scores win.

Multi-Krum averages its selection with equal weights (times FedBuff's staleness
factor s(τ) in the asynchronous buffer), never with the claimed example counts: a
selected attacker claiming 1e308 examples would otherwise be the whole average (or
overflow the weight sum to inf and zero the model), undoing the selection that let it
in only because its update looked honest.

Distances come from a Gram matrix of the updates accumulated block by block
(`robust_ops.update_gram`), never from an n × d copy; its diagonal also tells which
updates hold NaN or Inf, so no separate pass screens them.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from strategies.replies import Screened, reject
from strategies.robust import RobustStrategy
from strategies.robust_ops import (
    apply_update,
    krum_scores,
    select_lowest,
    squared_distances,
    update_gram,
    weighted_update_mean,
)
from strategies.tensor_ops import TensorDict, weighted_mean

log = logging.getLogger("flwr.fedgpu." + __name__)


class MultiKrum(RobustStrategy):
    """Multi-Krum: the equal-weight mean of the m best-scored client updates."""

    screen_finite = False  # the Gram diagonal finds non-finite updates

    def __init__(self, *, num_selected: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if num_selected < 1:
            raise ValueError(f"num_selected={num_selected} must be >= 1")
        self.num_selected = num_selected

    def summary(self) -> None:
        super().summary()
        log.info("%s: averages the m=%d best-scored updates", type(self).__name__, self.num_selected)

    def too_few(self, n: int) -> str | None:
        f, m = self.num_byzantine, self.num_selected
        if n < 2 * f + 3:
            return f"strategy.num_byzantine={f} needs n >= 2f+3 = {2 * f + 3} valid replies (n={n})"
        if m > n - f:
            return f"strategy.num_selected={m} must be <= n - f = {n - f} (n={n} valid replies, f={f})"
        return None

    def robust_aggregate(self, server_round: int, screened: Screened) -> TensorDict | None:
        models = [r.arrays for r in screened.valid]
        bases = self.bases(screened)
        gram = update_gram(models, bases, self.device)
        finite = torch.isfinite(gram.diagonal()).tolist()
        if not all(finite):
            keep = [i for i, ok in enumerate(finite) if ok]
            for reply, ok in list(zip(screened.valid, finite, strict=True)):
                if not ok:
                    reject(screened, reply, "non-finite values (NaN or Inf) in its update")
            if (reason := self.too_few(len(keep))) is not None:
                return self.apply_policy(server_round, screened, reason)
            gram = gram[keep][:, keep]
            bases = [bases[i] for i in keep]
        scores = krum_scores(squared_distances(gram), self.num_byzantine)
        chosen = select_lowest(scores, self.num_selected)
        report = self.train_report
        report.scores = {r.node_id: float(s) for r, s in zip(screened.valid, scores.tolist(), strict=True)}
        report.excluded = [r.node_id for i, r in enumerate(screened.valid) if i not in chosen]
        selected = [screened.valid[i] for i in chosen]
        log.info(
            "round %d: %s selected %s, excluded %s; scores %s",
            server_round,
            type(self).__name__,
            [r.node_id for r in selected],
            report.excluded,
            {k: f"{v:.4g}" if math.isfinite(v) else v for k, v in report.scores.items()},
        )
        bases = [bases[i] for i in chosen]
        weights = [r.scale for r in selected]  # not r.weight: claimed counts must not undo the selection
        if all(b is self._global for b in bases):
            # One base (a synchronous round): the mean of the selected models is
            # global + the mean of their updates, without forming the updates.
            return weighted_mean([r.arrays for r in selected], weights, self.device)
        return apply_update(
            self._global, weighted_update_mean([r.arrays for r in selected], bases, weights, self.device)
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "num_byzantine": self.num_byzantine, "num_selected": self.num_selected}


class Krum(MultiKrum):
    """Krum: the single best-scored client update becomes the new global model."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(num_selected=1, **kwargs)
