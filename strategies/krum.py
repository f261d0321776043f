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

`MultiKrumRule` and `KrumRule` aggregate in a synchronous round (`RobustStrategy`)
or FedBuff's buffer alike.

Distances come from a Gram matrix of the updates accumulated block by block
(`robust_ops.update_gram`), never from an n × d copy; its diagonal also tells which
updates hold NaN or Inf, so no separate pass screens them. The replies and their bases
are staged on the aggregation device once (`robust_ops.stage_groups`), then read there
by the Gram matrix and again by the mean of the selected.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from strategies.node_names import label
from strategies.replies import Screened, ValidReply
from strategies.robust import RobustRule, RuleReport, RuleSettings, reject_where
from strategies.robust_ops import (
    apply_update,
    krum_scores,
    select_lowest,
    squared_distances,
    stage_groups,
    update_gram,
    weighted_update_mean,
)
from strategies.tensor_ops import TensorDict, weighted_mean

log = logging.getLogger("flwr.fedgpu." + __name__)


@dataclass
class Kept:
    """What the Krum stage kept, staged on the aggregation device: `models[i]` is `replies[i]`'s
    model, trained from `bases[i]`; `current` is the global model."""

    current: TensorDict
    models: list[TensorDict]
    bases: list[TensorDict]
    replies: list[ValidReply]


class KrumSelection(RobustRule):
    """Rules that first keep the updates with the lowest Krum scores, then aggregate those:
    Multi-Krum (a mean of m) and Bulyan (a coordinate-wise stage over n - 2f).

    `combine` stages the replies once, rejects non-finite updates by the Gram diagonal (then
    applies the too-few policy if too few are left), scores every update, keeps `kept(n)`,
    fills the report and hands the kept ones to `combine_kept`.
    """

    finds_non_finite = True  # the Gram diagonal

    @abstractmethod
    def kept(self, n: int) -> int:
        """How many of n valid updates the Krum stage keeps."""

    @abstractmethod
    def combine_kept(self, server_round: int, kept: Kept, screened: Screened, report: RuleReport) -> TensorDict | None:
        """The new model from the kept updates."""

    def combine(
        self,
        server_round: int,
        current: TensorDict,
        screened: Screened,
        bases: list[TensorDict],
        report: RuleReport,
    ) -> TensorDict | None:
        (current,), models, bases = stage_groups(self.device, [current], [r.arrays for r in screened.valid], bases)
        gram = update_gram(models, bases, self.device)
        finite = torch.isfinite(gram.diagonal()).tolist()
        if not all(finite):
            bad = [not ok for ok in finite]
            bases = reject_where(screened, bases, bad, "non-finite values (NaN or Inf) in its update")
            models = [m for m, ok in zip(models, finite, strict=True) if ok]
            if (reason := self.too_few(len(bases))) is not None:
                return self.apply_policy(server_round, current, screened, bases, reason, report, models)
            keep = [i for i, ok in enumerate(finite) if ok]
            gram = gram[keep][:, keep]
        scores = krum_scores(squared_distances(gram), self.num_byzantine)
        chosen = select_lowest(scores, self.kept(len(models)))
        report.scores = {r.node_id: float(s) for r, s in zip(screened.valid, scores.tolist(), strict=True)}
        report.excluded = [r.node_id for i, r in enumerate(screened.valid) if i not in chosen]
        kept = [screened.valid[i] for i in chosen]
        models, bases = [models[i] for i in chosen], [bases[i] for i in chosen]
        return self.combine_kept(server_round, Kept(current, models, bases, kept), screened, report)

    @staticmethod
    def scored(nodes: list[int], screened: Screened, report: RuleReport) -> str:
        """Nodes with their scores, for a log line."""
        return "[" + ", ".join(f"{label(n, screened.names)}: {report.scores[n]:.4g}" for n in nodes) + "]"


class MultiKrumRule(KrumSelection):
    """Multi-Krum's rule: the equal-weight mean of the m best-scored client updates.

    Parameters
    ----------
    num_selected : int (default: 1)
        m, the updates averaged (m <= n - f).
    num_byzantine, on_too_few, device
        As in `RobustRule` (Krum needs n >= 2f + 3 valid replies).
    """

    name = "MultiKrum"

    def __init__(
        self,
        *,
        num_byzantine: int = 0,
        num_selected: int = 1,
        on_too_few: str = "skip",
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(num_byzantine=num_byzantine, on_too_few=on_too_few, device=device)
        if num_selected < 1:
            raise ValueError(f"num_selected={num_selected} must be >= 1")
        self.num_selected = num_selected

    @classmethod
    def from_config(cls, st: RuleSettings, device: torch.device | str = "cpu") -> MultiKrumRule:
        return cls(
            num_byzantine=st.num_byzantine,
            num_selected=st.num_selected,
            on_too_few=st.on_too_few,
            device=device,
        )

    def summary(self) -> None:
        super().summary()
        log.info("%s: averages the m=%d best-scored updates", self.name, self.num_selected)

    def state_dict(self) -> dict[str, Any]:
        return {"num_byzantine": self.num_byzantine, "num_selected": self.num_selected}

    def too_few(self, n: int) -> str | None:
        f, m = self.num_byzantine, self.num_selected
        if n < 2 * f + 3:
            return f"strategy.num_byzantine={f} needs n >= 2f+3 = {2 * f + 3} valid replies (n={n})"
        if m > n - f:
            return f"strategy.num_selected={m} must be <= n - f = {n - f} (n={n} valid replies, f={f})"
        return None

    def kept(self, n: int) -> int:
        return self.num_selected

    def combine_kept(self, server_round: int, kept: Kept, screened: Screened, report: RuleReport) -> TensorDict | None:
        log.info(
            "round %d: %s selected %s, excluded %s (by score: the lowest are selected)",
            server_round,
            self.name,
            self.scored([r.node_id for r in kept.replies], screened, report),
            self.scored(report.excluded, screened, report),
        )
        weights = [r.scale for r in kept.replies]  # not r.weight: claimed counts must not undo the selection
        if all(b is kept.current for b in kept.bases):  # staging maps one base object to one staged object
            # One base (a synchronous round): the mean of the selected models is
            # global + the mean of their updates, without forming the updates.
            return weighted_mean(kept.models, weights, self.device)
        return apply_update(
            kept.current,
            weighted_update_mean(kept.models, kept.bases, weights, self.device),
        )


class KrumRule(MultiKrumRule):
    """Krum's rule: the single best-scored client update becomes the new global model.

    Parameters
    ----------
    num_byzantine, on_too_few, device
        As in `RobustRule` (Krum needs n >= 2f + 3 valid replies).
    """

    name = "Krum"

    def __init__(
        self,
        *,
        num_byzantine: int = 0,
        on_too_few: str = "skip",
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(
            num_byzantine=num_byzantine,
            num_selected=1,
            on_too_few=on_too_few,
            device=device,
        )

    @classmethod
    def from_config(cls, st: RuleSettings, device: torch.device | str = "cpu") -> KrumRule:
        return cls(num_byzantine=st.num_byzantine, on_too_few=st.on_too_few, device=device)
