"""What the server checks in a secure round's unmasked sums, and how it finds the node behind sums
that fail the checks (group testing).

SecAgg+ shows the server the survivors' summed ring vectors and nothing else, so a node that
writes what it likes into its own vector (a negative weight, a weight that leaves a tiny divisor,
a coordinate far beyond the clipping range, an accuracy above its weight) cannot be seen in one
sum. But an honest input lies in a known box: its weight w in [1/max_weight, 1], its weighted
accuracy and clipped fraction in [0, w], its weighted loss within the ring's +-64 c, its weighted
update within +-w c per coordinate (c = secagg.clipping_range; updates within it). So s honest
inputs sum into s times that box, widened only by each input's rounding (under one ring step per
summed value), and their mean update moves no coordinate further than c. A sum outside the box
proves that one of its survivors deviated (`sums_problem`): the round is refused.

Which one, the sum cannot say. Group testing (adaptive splitting, Dorfman 1943; Hwang 1972) finds
it over the next rounds (`GroupSearch`): the sampled suspects are split into as many parts as the
cleared nodes can pad to at least 3 contributors each, each part its own SecAgg+ round (the
cleared rest one more); groups whose sums pass apply (FedAvg over their members), and a failing
group's suspects are the new suspects. The deviating node is in every failing group, so the
suspects are the intersection of the failing groups since the search began, and nodes outside it
are cleared: with one deviating node this is sound whatever it does (behaving in some rounds only
delays the search); the one node left is excluded for the run and named. With 10 nodes: round 1
refused, then groups of 3, 3 and 4, then the failing group's 3 or 4 suspects one (or two) a group:
excluded after round 3 or 4, and every round after the first applies.
Several deviating nodes can make the intersection empty (the search then starts over from the
latest failing groups) and, by lying in turn, can get an honest node excluded: the bound this
gives is for one deviating node (docs/threat-model.md). The server learns each group's sums, as
it learns each region's under topology=regions: every group has at least 3 contributors.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from app.secagg.ring import ACCURACY, CLIPPED, EXTRA_SCALE, LOSS, WEIGHT, Ring

log = logging.getLogger("flwr.fedgpu." + __name__)

LEAST_CONTRIBUTORS = 3  # with 2, each contributor subtracts its own update from the sum and learns the other's


def sums_problem(
    sums: Mapping[str, torch.Tensor], extras: Mapping[str, float], survivors: int, ring: Ring, max_weight: float
) -> str | None:
    """Why plain secure aggregation's decoded sums cannot come from `survivors` honest inputs (None:
    they can). Each input's stochastic rounding moves a summed value by under one ring step, so the
    bounds are widened by 2 s steps (the value's and the weight sum's rounding), nothing more."""
    s, c, step = survivors, ring.clipping_range, ring.step
    tol = 2 * s * step
    weights = extras[WEIGHT]
    lo, hi = s * min(1.0 / max_weight, c) - tol, s * min(1.0, c) + tol
    if not lo <= weights <= hi or weights <= 0:
        return (
            f"the weights sum to {weights:.6g}, outside [{lo:.6g}, {hi:.6g}] (what {s} survivors can send: each "
            f"between 1/secagg.max_weight = {1 / max_weight:.3g} and 1)"
        )
    for key, what in ((ACCURACY, "accuracy"), (CLIPPED, "clipped fraction")):
        if not -tol <= extras[key] <= weights + tol:
            return f"the weighted {what} sums to {extras[key]:.6g}, outside [0, {weights:.6g}] (the weights' sum)"
    if abs(extras[LOSS]) > s * c * EXTRA_SCALE[LOSS] * (1 + 1e-9):
        return f"the weighted loss sums to {extras[LOSS]:.6g}, beyond what {s} inputs in the ring can carry"
    largest = max((float(t.abs().max()) for t in sums.values() if t.numel()), default=0.0)
    bound = c + tol * (c + 1) / weights
    if largest / weights > bound:
        return (
            f"the mean update moves a coordinate by {largest / weights:.6g}, beyond secagg.clipping_range={c:g} "
            "(a mean of updates within it cannot)"
        )
    return None


@dataclass
class GroupSearch:
    """The run's search for the node behind refused sums, and the nodes excluded for the run.

    `least`: the fewest contributors a group may have (3, or secagg.threshold when larger: a
    group must be able to reach its threshold). `suspects`: the deviating node is among them (the
    intersection of the failing groups since the search began; empty: no search). `excluded`:
    node -> why, never sampled again (`SecureFedAvg.eligible`); nodes the SecAgg+ round proves
    deviated (`Outcome.culprits`) join them too (`exclude`). Kept in checkpoints."""

    least: int = LEAST_CONTRIBUTORS
    suspects: set[int] = field(default_factory=set)
    excluded: dict[int, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # this search's failing rounds and reasons, for the log

    def groups(self, cohort: list[int]) -> list[list[int]]:
        """The round's SecAgg+ groups: the cohort whole when none of it is suspect; else its suspects
        in as many parts as the cleared nodes can pad to `least` each (one node a part when there
        are enough: the search then ends with the round), the cleared rest a group of its own, or
        spread over the others when fewer than `least`. A cohort too small for even one padded part
        stays whole (its round is refused again if the liar lies again)."""
        suspects = [v for v in cohort if v in self.suspects]
        cleared = [v for v in cohort if v not in self.suspects]
        if not suspects:
            return [cohort]
        for parts in range(len(suspects), 0, -1):
            sizes = [len(suspects) // parts + (i < len(suspects) % parts) for i in range(parts)]
            if sum(max(0, self.least - size) for size in sizes) <= len(cleared):
                break
        else:
            return [cohort]
        groups = []
        for size in sizes:
            pad = max(0, self.least - size)
            groups.append(suspects[:size] + cleared[:pad])
            suspects, cleared = suspects[size:], cleared[pad:]
        if len(cleared) >= self.least:
            groups.append(cleared)
        else:
            for i, v in enumerate(cleared):
                groups[i % len(groups)].append(v)
        return groups

    def record(self, server_round: int, failing: list[tuple[list[int], str]]) -> list[tuple[int, str]]:
        """Narrow the suspects with the round's failing groups (each: its survivors, the reason) and
        return the node proven to have deviated, excluded now (or nothing)."""
        if not failing:
            return []
        self.failures.append(f"round {server_round}: {failing[0][1]}")
        if len(failing) > 1:  # more than one node deviates: start over from all of them
            self.suspects = {v for members, _ in failing for v in members}
            self.failures = self.failures[-1:]
            log.warning(
                "round %d: %d secure groups failed the checks: more than one node deviates; the search for "
                "them starts over from the %d nodes of those groups", server_round, len(failing), len(self.suspects)
            )  # fmt: skip
            return []
        members = set(failing[0][0])
        narrowed = self.suspects & members
        if not narrowed:  # a new search (or a second deviating node): the culprit is among the members
            self.suspects, self.failures = members, self.failures[-1:]
            return []
        self.suspects = narrowed
        if len(narrowed) > 1:
            return []
        (node,) = narrowed
        why = (
            "the one node in every secure group whose sums failed the checks ("
            + "; ".join(self.failures)
            + "): excluded from secure rounds for the rest of the run"
        )
        self.exclude(node, why)
        return [(node, why)]

    def exclude(self, node: int, why: str) -> None:
        """`node` is never sampled again in this run; a search it was in is over."""
        self.excluded.setdefault(node, why)
        if node in self.suspects:
            self.suspects, self.failures = set(), []

    def state_dict(self) -> dict[str, Any]:
        return {
            "suspects": sorted(self.suspects),
            "excluded": {str(node): why for node, why in self.excluded.items()},
            "failures": list(self.failures),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        try:
            suspects = {int(v) for v in state["suspects"]}
            excluded = {int(node): str(why) for node, why in state["excluded"].items()}
            failures = [str(f) for f in state.get("failures", [])]
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"the secure rounds' exclusions are malformed ({err!r})") from None
        self.suspects, self.excluded, self.failures = suspects, excluded, failures
