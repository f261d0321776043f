"""Byzantine-robust aggregation: one `RobustRule` shared by the synchronous strategies
and FedBuff's buffer, and `RobustStrategy`, FedAvg with a rule in place of the mean.

A rule is stateless between aggregations: the caller hands it the current global
model, the screened replies and the model each reply trained from (its base: this
round's global model in a synchronous round, the reply's own version in the
asynchronous buffer), and gets back the new model and a `RuleReport`. So one rule
object serves any caller, and no caller reaches into another object's state.

A rule tolerating f Byzantine clients needs enough valid replies (Krum:
n >= 2f + 3). When a round brings fewer, the configured policy applies and is
logged: `skip` keeps the previous model, `fallback` takes the coordinate-wise
median of the valid replies if there are at least 2f + 1 of them (the median's own
bound: f attackers cannot outnumber the honest middle), and skips otherwise: the
median of 2 replies is their mean, which one attacker moves anywhere. Never a silent
plain average.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from strategies.fedavg import FedAvg, guarded_step
from strategies.registry import POLICIES
from strategies.replies import Screened, ValidReply, reject
from strategies.robust_ops import apply_update, coordinatewise, stage_groups
from strategies.server_opt import ServerOptimizer
from strategies.settings import ReplyLimits, Sampling, TaskWiring
from strategies.tensor_ops import Part, TensorDict, is_finite

if TYPE_CHECKING:
    from strategies.regional import RegionalCombine

log = logging.getLogger("flwr.fedgpu." + __name__)


def median_too_few(n: int, f: int) -> str | None:
    """Why a coordinate-wise median of n replies does not tolerate f Byzantine ones."""
    if n < 2 * f + 1:
        return f"strategy.num_byzantine={f} needs n >= 2f+1 = {2 * f + 1} valid replies for a median (n={n})"
    return None


def reject_where(screened: Screened, bases: Sequence[TensorDict], bad: Sequence[bool], reason: str) -> list[TensorDict]:
    """Reject the valid replies flagged `bad`; returns the bases of the others, in order."""
    kept = []
    for reply, base, is_bad in zip(list(screened.valid), bases, bad, strict=True):
        if is_bad:
            reject(screened, reply, reason)
        else:
            kept.append(base)
    return kept


class RuleSettings(Protocol):
    """The config section rules are built from (the app's `strategy.*`: StrategyConfig)."""

    num_byzantine: int
    on_too_few: str
    num_selected: int
    trim_ratio: float


@dataclass
class RuleReport:
    """What a rule made of one aggregation's valid replies (for logs and metrics.jsonl)."""

    excluded: list[int] = field(default_factory=list)  # valid replies it left out of the model
    scores: dict[int, float] = field(default_factory=dict)  # per-node scores (Krum)
    policy: str | None = None  # "skip" or "fallback-median" when too few replies were valid


class RobustRule(ABC):
    """A Byzantine-robust replacement for the weighted mean of client updates.

    Parameters
    ----------
    num_byzantine : int (default: 0)
        f, the number of Byzantine clients to tolerate.
    on_too_few : str (default: "skip")
        One of `POLICIES`: what happens when fewer valid replies arrive than the rule
        needs for f. "skip" keeps the previous model; "fallback" takes the
        coordinate-wise median when at least 2f + 1 replies are valid, else skips.
    device : torch.device | str (default: "cpu")
        Where the aggregation runs.
    """

    name: str  # how logs and summaries call the rule (the class name of its strategy)
    finds_non_finite = False  # True: the rule spots NaN/Inf updates itself, no screening pass needed

    def __init__(self, *, num_byzantine: int = 0, on_too_few: str = "skip", device: torch.device | str = "cpu") -> None:
        if num_byzantine < 0:
            raise ValueError(f"num_byzantine={num_byzantine} must be >= 0")
        if on_too_few not in POLICIES:
            raise ValueError(f"on_too_few={on_too_few!r} must be one of {POLICIES}")
        self.num_byzantine = num_byzantine
        self.on_too_few = on_too_few
        self.device = torch.device(device)

    @classmethod
    def from_config(cls, st: RuleSettings, device: torch.device | str = "cpu") -> RobustRule:
        """The rule from the strategy section of a config (strategy.*); rules with settings of
        their own (Multi-Krum's m, the trim ratio) read them in their override."""
        return cls(num_byzantine=st.num_byzantine, on_too_few=st.on_too_few, device=device)

    def summary(self) -> None:
        log.info(
            "%s: tolerates f=%d Byzantine clients; too few valid replies -> %s",
            self.name,
            self.num_byzantine,
            self.on_too_few,
        )

    def state_dict(self) -> dict[str, Any]:
        """Settings a checkpoint records next to the strategy's name (none by default)."""
        return {}

    @abstractmethod
    def too_few(self, n: int) -> str | None:
        """Why n valid replies are not enough for this rule (None when they are)."""

    @abstractmethod
    def combine(
        self, server_round: int, current: TensorDict, screened: Screened, bases: list[TensorDict], report: RuleReport
    ) -> TensorDict | None:
        """The new global model from enough valid replies, filling `report`."""

    def aggregate(
        self, server_round: int, current: TensorDict, screened: Screened, bases: Sequence[TensorDict]
    ) -> tuple[TensorDict | None, RuleReport]:
        """The new global model (None: keep `current`) and what the rule made of the replies.

        `bases[i]` is the model `screened.valid[i]` trained from; passing `current`
        itself for every reply of a synchronous round lets a rule skip forming the
        updates. Replies the rule finds unusable (NaN or Inf) are moved to
        `screened.rejected`; `server_round` only labels the logs.
        """
        if len(bases) != len(screened.valid):
            raise ValueError(f"{len(screened.valid)} replies but {len(bases)} bases")
        report = RuleReport()
        reason = self.too_few(len(screened.valid))
        if reason is None:
            return self.combine(server_round, current, screened, list(bases), report), report
        return self.apply_policy(server_round, current, screened, list(bases), reason, report), report

    def apply_policy(
        self,
        server_round: int,
        current: TensorDict,
        screened: Screened,
        bases: list[TensorDict],
        reason: str,
        report: RuleReport,
        models: list[TensorDict] | None = None,
    ) -> TensorDict | None:
        """The too-few policy (module docstring): the fallback median's model, or None to skip.

        `models`: the valid replies' arrays when the caller has staged them already
        (default: `screened.valid`'s own)."""
        if self.on_too_few == "fallback":
            models = [r.arrays for r in screened.valid] if models is None else models
            bad = [not all(is_finite(t) for t in m.values()) for m in models]
            bases = reject_where(screened, bases, bad, "non-finite values (NaN or Inf)")
            models = [m for m, is_bad in zip(models, bad, strict=True) if not is_bad]
            problem = median_too_few(len(screened.valid), self.num_byzantine)
            if problem is None:
                report.policy = "fallback-median"
                log.warning(
                    "round %d: %s; policy fallback: coordinate-wise median of %d replies",
                    server_round,
                    reason,
                    len(screened.valid),
                )
                (current,), models, bases = stage_groups(self.device, [current], models, bases)
                return apply_update(current, coordinatewise(models, bases, None, self.device))
            reason = f"{reason}; policy fallback cannot help: {problem}"
        report.policy = "skip"
        log.warning("round %d: %s; skipping the round: keeping the previous global model", server_round, reason)
        return None


class RobustStrategy(FedAvg):
    """FedAvg's sampling and screening with a robust rule in place of the weighted mean.

    One class for every rule: logs, summaries and checkpoints call it by the rule's
    strategy name (`Krum`, `MultiKrum`, `CoordinateMedian`, `TrimmedMean`, ...), as
    the classes each rule once had did.

    Parameters
    ----------
    rule : RobustRule
        Aggregates each round's valid replies; every base is the round's global model.
    sampling, limits, wiring, device, regions
        As in `FedAvg`.
    """

    def __init__(
        self,
        *,
        rule: RobustRule,
        sampling: Sampling | None = None,
        limits: ReplyLimits | None = None,
        wiring: TaskWiring | None = None,
        device: torch.device | str = "cpu",
        regions: RegionalCombine | None = None,
        server_opt: ServerOptimizer | None = None,
    ) -> None:
        super().__init__(
            sampling=sampling, limits=limits, wiring=wiring, device=device, regions=regions, server_opt=server_opt
        )
        self.rule = rule
        self.screen_finite = not rule.finds_non_finite

    # A rule compares the replies with each other (distances, per-coordinate order), so it holds the
    # whole cohort: `federation.server_memory_gb` bounds it before round 1 (docs/strategies.md).
    streams = False

    @property
    def name(self) -> str:
        return self.rule.name

    def robust_row(self) -> dict[str, Any] | None:
        return self.train_report.robust_row()

    def summary(self) -> None:
        super().summary()
        self.rule.summary()

    def node_count_problem(self, num_nodes: int) -> str | None:
        cohort = self.cohort_size(num_nodes)
        if (problem := self.cohort_problem(cohort)) is None:
            return None
        return (
            f"{problem} ({num_nodes} nodes, federation.fraction_train={self.sampling.fraction_train}, "
            f"federation.min_train_nodes={self.sampling.min_train_nodes}); use more nodes or tolerate fewer Byzantine clients"
        )

    def cohort_problem(self, cohort: int) -> str | None:
        """Checked before the first round: a cohort this size could never be enough."""
        reason = self.rule.too_few(cohort)
        return None if reason is None else f"{reason}, but a round samples at most {cohort} clients"

    def aggregate_models(self, server_round: int, screened: Screened) -> TensorDict | None:
        """The rule's model, checked (`fedavg.guarded_step`): replies that would make it non-finite
        are rejected and the rule runs again without them."""
        last: list[tuple[Screened, RuleReport]] = []

        def step(kept: list[ValidReply]) -> tuple[TensorDict | None, list[Part]]:
            attempt = Screened(valid=list(kept), names=screened.names)
            new, outcome = self.rule.aggregate(server_round, self._global, attempt, [self._global] * len(kept))
            last[:] = [(attempt, outcome)]
            return new, [(r, r.arrays, self._global, 1.0) for r in attempt.valid if r.node_id not in outcome.excluded]

        new = guarded_step(server_round, screened, step)
        if last:  # the rule's own rejections (NaN or Inf updates) in its last run
            attempt, outcome = last[0]
            named = {r.node_id for r in screened.rejected}
            for rejection in (r for r in attempt.rejected if r.node_id not in named):
                screened.valid = [r for r in screened.valid if r.node_id != rejection.node_id]
                screened.rejected.append(rejection)
            report = self.train_report
            report.excluded, report.scores, report.policy = outcome.excluded, outcome.scores, outcome.policy
        return new

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.rule.state_dict()}
