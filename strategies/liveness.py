"""Liveness (`federation.stall_rounds`): a run in which no update has been applied for that many
rounds (FedBuff: that many versions' worth of replies, K each) stops with `Stalled`, whose message
says what became of the replies meanwhile and what to try.

Without it a run whose every reply is refused never ends under FedBuff (a version needs K accepted
updates; an exploded global model makes every node's reply non-finite, forever) and idles through
its remaining rounds under FedAvg. The checkpoint is untouched by the stop: it holds the last model
a step applied.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from strategies.norm_bound import REASON as NORM_BOUND_REASON

# What became of a reply that made no update, and what to try when it is most of them.
NON_FINITE, NORM_BOUND, FAILED, STALE, MISSING, REFUSED, UNUSED = (
    "non-finite",
    "over the norm bound",
    "failed",
    "too stale",
    "missing",
    "rejected otherwise",
    "not applied",
)
ADVICE = {
    NON_FINITE: "the replies are non-finite: the global model has most likely exploded (a finite but huge "
    "update was applied; the rows' loss shows when), so resuming it cannot help: start a new run with "
    "strategy.norm_bound on (its default) or a robust strategy (strategy=median; FedBuff: "
    "strategy.buffer_aggregator=median)",
    NORM_BOUND: "strategy.norm_bound rejects every update: raise it (0 turns it off) or "
    "strategy.norm_bound_action=clip",
    FAILED: "the nodes' training tasks fail: read their errors in the rows and the nodes' logs",
    STALE: "every update is too stale: raise strategy.max_staleness or lower strategy.concurrency",
    MISSING: "the nodes do not reply in time: check that they run, or raise federation.round_timeout_s",
    REFUSED: "read the rejections' reasons in metrics.jsonl",
    UNUSED: "the rounds' replies were not turned into a model (a robust rule's too-few policy, an aborted "
    "secure round): read the rows' robust and secagg columns",
}


class Stalled(RuntimeError):
    """No update applied for `federation.stall_rounds` steps: the run stops, its checkpoint kept."""


def outcome_of(reason: str) -> str:
    """A rejection's reason as an outcome of `ADVICE`."""
    if reason.startswith(NORM_BOUND_REASON):
        return NORM_BOUND
    if "non-finite" in reason:
        return NON_FINITE
    if reason.startswith("error reply") or reason.startswith("no reply"):
        return FAILED
    return REFUSED


def tally(reasons: Iterable[str], *, stale: int = 0, missing: int = 0) -> Counter[str]:
    """The outcomes of a step's replies that made no update: rejected or failed (`reasons`),
    discarded as too stale, or never received."""
    outcomes = Counter(outcome_of(r) for r in reasons)
    outcomes.update({STALE: stale, MISSING: missing})
    return +outcomes  # zero counts dropped


def stall_reason(limit: int, unit: str, last: int, outcomes: Counter[str]) -> str:
    """`Stalled`'s message: how long, what became of the replies, what to try, where the model is."""
    seen = ", ".join(f"{n} {what}" for what, n in outcomes.most_common()) or "none received"
    main = outcomes.most_common(1)[0][0] if outcomes else MISSING
    resume = (
        "" if main == NON_FINITE else "; once the cause is fixed, the same command with resume=auto continues from it"
    )
    return (
        f"stalled: no update applied for {limit} {unit}s (federation.stall_rounds={limit}); replies since "
        f"{unit} {last}: {seen}. What to try: {ADVICE[main]}. The checkpoint holds the last applied model "
        f"({unit} {last}){resume}"
    )


class StallWatch:
    """Synchronous rounds: counts the rounds since the last one that applied an update, and what
    became of their replies; `Stalled` at `limit` of them (0: never)."""

    def __init__(self, limit: int, last: int = 0) -> None:
        self.limit, self.last = limit, last
        self.missed = 0
        self.outcomes: Counter[str] = Counter()

    def round_ended(self, rnd: int, applied: bool, outcomes: Counter[str]) -> None:
        """Round `rnd` is recorded: reset when it applied an update, else count it (and raise)."""
        if applied:
            self.last, self.missed = rnd, 0
            self.outcomes.clear()
            return
        self.missed += 1
        self.outcomes.update(outcomes or Counter({UNUSED: 1}))
        if self.limit and self.missed >= self.limit:
            raise Stalled(stall_reason(self.limit, "round", self.last, self.outcomes))
