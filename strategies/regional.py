"""Two-level aggregation (`topology=regions`): each region combines its members' valid replies
first, then the strategy's own rule combines one update per region.

A region's update is its members' sample-weighted mean (or a robust rule's model, `rule`) and it
travels with the region's weight, the sum of its members' capped weights: the top-level weighted
mean of the regions is then the flat weighted mean of every reply, to float rounding (a sum is a
sum, whatever the grouping). A robust top rule (the strategy's) sees one update per region:
median of region means, Krum over regions. The wide-area leg (`wan`) may re-encode each region's
update (a codec with the aggregator's error-feedback residual, `app/regions/wan.py`); the top rule
then combines what the server decodes.

In simulation the server plays every region's aggregator, so this runs inside the strategy; in a
deployment each aggregator is a SuperNode (docs/deployment.md) and the server sees its replies as
nodes. Kept free of the app: the region of a node and the WAN leg are callables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import MetricRecord

from strategies.fedavg import RoundReport, guarded_step
from strategies.node_names import NodeNames
from strategies.replies import Screened, ValidReply, reject, weighted_metrics
from strategies.robust import RobustRule, RuleReport
from strategies.streaming import MeanFold
from strategies.tensor_ops import Part, TensorDict, weighted_mean

log = logging.getLogger("flwr.fedgpu." + __name__)

WanLeg = Callable[[int, TensorDict], tuple[TensorDict, int]]
"""(region, its update) -> (the update as the server decodes it, its bytes on the wide-area link)."""
TopRule = Callable[[int, Screened], TensorDict | None]


def region_node(region: int) -> int:
    """The id a region's update carries at the top level: negative, so never a Flower node id."""
    return -1 - region


@dataclass
class RegionOutcome:
    """What one region made of a round, for the row's `regions` column."""

    region: int
    nodes: list[int]  # its members whose replies were valid
    weight: float = 0.0  # the sum of their capped weights: the region's weight at the top
    excluded: list[int] = field(default_factory=list)  # members its rule left out
    policy: str | None = None  # its rule's too-few policy, when it applied
    sent: bool = False  # it sent an update to the server
    wan_bytes_up: int | None = None  # the encoded update's bytes (None: sent as it is, a reply's size)
    top_excluded: bool = False  # the top rule left the whole region out
    score: float | None = None  # the top rule's score of the region (Krum)

    def row(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "weight": self.weight,
            "excluded": self.excluded,
            "policy": self.policy,
            "wan_bytes_up": self.wan_bytes_up,
            "top_excluded": self.top_excluded,
            **({"score": self.score} if self.score is not None else {}),
        }


@dataclass(frozen=True)
class RegionModel:
    """A region's model made where the server cannot see its members (`combine_made`)."""

    model: TensorDict
    weight: float  # its members' capped weights summed
    metrics: MetricRecord  # its members' weighted-mean training metrics
    members: list[int]  # the nodes whose updates it holds


class RegionalCombine:
    """The two levels of a round's aggregation (module docstring).

    Parameters
    ----------
    region_of : node id -> its region (None: not known, its reply is rejected)
    num_regions : how many regions there are (every one is reported, also one without replies)
    rule : inside each region, a robust rule in place of the weighted mean (None: the mean)
    wan : the wide-area leg of each region's update (None: sent as it is)
    device : where regions are combined
    """

    def __init__(
        self,
        region_of: Callable[[int], int | None],
        num_regions: int,
        rule: RobustRule | None = None,
        wan: WanLeg | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.region_of, self.num_regions, self.rule, self.wan = region_of, num_regions, rule, wan
        self.device = torch.device(device)
        self.last: list[RegionOutcome] = []

    def too_few(self, members: int) -> str | None:
        """Why a region of `members` replies could never satisfy the inner rule."""
        return None if self.rule is None else self.rule.too_few(members)

    def combine(
        self, server_round: int, base: TensorDict, screened: Screened, top: TopRule, report: RoundReport
    ) -> TensorDict | None:
        """The round's model: each region's, then `top` over them. Members an inner rule leaves out,
        and every member of a region the top rule leaves out, become `report.excluded`; replies
        rejected on the way (no region; NaN or Inf) move to `screened.rejected`."""
        groups: dict[int, list[ValidReply]] = {}
        for reply in list(screened.valid):
            if (region := self._region(reply, screened)) is not None:
                groups.setdefault(region, []).append(reply)
        self.last = [RegionOutcome(r, [m.node_id for m in groups.get(r, [])]) for r in range(self.num_regions)]
        models: dict[int, tuple[TensorDict | None, list[ValidReply]]] = {}
        for region, members in sorted(groups.items()):
            outcome = self.last[region]
            kept = Screened(valid=list(members), names=screened.names)
            model = self._region_model(server_round, base, kept, outcome)
            for rejection in kept.rejected:  # NaN or Inf members: rejected for the round, as flat
                screened.valid = [r for r in screened.valid if r.node_id != rejection.node_id]
                screened.rejected.append(rejection)
            outcome.nodes = [r.node_id for r in kept.valid]
            models[region] = model, [r for r in kept.valid if r.node_id not in outcome.excluded]
        return self._top(server_round, base, models, screened, top, report)

    def fold(
        self,
        server_round: int,
        base: TensorDict,
        valid: Iterable[ValidReply],
        screened: Screened,
        top: TopRule,
        report: RoundReport,
    ) -> TensorDict | None:
        """`combine` for replies taken one at a time (a streamed round, the mean inside regions):
        one running weighted mean per region (`MeanFold`), so the server holds R model-sized
        accumulators, never the replies."""
        if self.rule is not None:
            raise ValueError("a robust rule inside regions needs each region's replies together: gather them")
        folds: dict[int, MeanFold] = {}
        members: dict[int, list[ValidReply]] = {}
        for reply in valid:
            if (region := self._region(reply, screened)) is None:
                continue
            folds.setdefault(region, MeanFold(base, self.device)).add(reply.arrays, reply.weight)
            members.setdefault(region, []).append(reply)  # its metrics and weight; its arrays go after the fold
        self.last = [RegionOutcome(r, [m.node_id for m in members.get(r, [])]) for r in range(self.num_regions)]
        models = {r: (folds[r].result(), members[r]) for r in sorted(folds)}
        return self._top(server_round, base, models, screened, top, report)

    def combine_made(
        self,
        server_round: int,
        base: TensorDict,
        made: dict[int, RegionModel],
        top: TopRule,
        report: RoundReport,
        names: NodeNames | None = None,
    ) -> TensorDict | None:
        """`combine` where each region's model was made at its aggregator without the server seeing
        a member's update (SecAgg+ inside regions, app/secagg/strategy.py): the regions' models,
        weights and members, then the WAN leg and `top` as for any region."""
        self.last = [RegionOutcome(r, list(made[r].members) if r in made else []) for r in range(self.num_regions)]
        for r, m in made.items():  # its model as it is, unless the WAN leg re-encodes it
            self.last[r].wan_bytes_up = sum(t.numel() * t.element_size() for t in m.model.values())
        models = {
            r: (m.model, [ValidReply(region_node(r), m.weight, m.metrics, m.model)]) for r, m in sorted(made.items())
        }
        return self._top(server_round, base, models, Screened(names=names), top, report)

    def _region(self, reply: ValidReply, screened: Screened) -> int | None:
        """The reply's region; a reply without one is rejected."""
        region = self.region_of(reply.node_id)
        if region is None or not 0 <= region < self.num_regions:
            reject(screened, reply, "its node has no region (topology.regions)")
            return None
        return region

    def _top(
        self,
        server_round: int,
        base: TensorDict,
        models: dict[int, tuple[TensorDict | None, list[ValidReply]]],
        screened: Screened,
        top: TopRule,
        report: RoundReport,
    ) -> TensorDict | None:
        """Each region's model over the WAN, with its weight, then `top` over them."""
        tops: list[ValidReply] = []
        inner_excluded = [n for o in self.last for n in o.excluded]
        for region, (model, used) in models.items():
            outcome = self.last[region]
            if model is None or not used:  # skipped by its rule's too-few policy: none of it is used
                inner_excluded += [n for n in outcome.nodes if n not in outcome.excluded]
                continue
            outcome.weight = float(sum(r.weight for r in used))
            model = self._wide_area(region, base, model, outcome)
            tops.append(ValidReply(region_node(region), outcome.weight, weighted_metrics(used), model))
        report.excluded, report.scores, report.policy = [], {}, None
        new = top(server_round, Screened(valid=tops, names=screened.names)) if tops else None
        self._map_top(report, inner_excluded)
        return new

    def _region_model(
        self, server_round: int, base: TensorDict, kept: Screened, outcome: RegionOutcome
    ) -> TensorDict | None:
        """A region's model from its members: the weighted mean, or the inner rule's; either checked
        for NaN and Inf (`guarded_step`), the replies that cause it rejected."""
        rule = self.rule
        if rule is None:

            def mean(members: list[ValidReply]) -> tuple[TensorDict | None, list[Part]]:
                if not members:
                    return None, []
                total = float(sum(r.weight for r in members))
                parts: list[Part] = [(r, r.arrays, None, r.weight / total) for r in members]
                return weighted_mean([r.arrays for r in members], [r.weight for r in members], self.device), parts

            return guarded_step(server_round, kept, mean)
        last: list[tuple[Screened, RuleReport]] = []

        def robust(members: list[ValidReply]) -> tuple[TensorDict | None, list[Part]]:
            attempt = Screened(valid=list(members), names=kept.names)
            new, ruled = rule.aggregate(server_round, base, attempt, [base] * len(members))
            last[:] = [(attempt, ruled)]
            return new, [(r, r.arrays, base, 1.0) for r in attempt.valid if r.node_id not in ruled.excluded]

        model = guarded_step(server_round, kept, robust)
        if last:  # the rule's own rejections (NaN or Inf updates) in its last run, as RobustStrategy's
            attempt, ruled = last[0]
            named = {r.node_id for r in kept.rejected}
            for rejection in (r for r in attempt.rejected if r.node_id not in named):
                kept.valid = [r for r in kept.valid if r.node_id != rejection.node_id]
                kept.rejected.append(rejection)
            outcome.excluded, outcome.policy = list(ruled.excluded), ruled.policy
        return model

    def _wide_area(self, region: int, base: TensorDict, model: TensorDict, outcome: RegionOutcome) -> TensorDict:
        """The region's model as the server receives it over the WAN: its update from `base`,
        through `wan` when there is one (floating-point keys; the rest goes as it is)."""
        outcome.sent = True
        if self.wan is None:
            return model
        update = {k: model[k] - base[k].to(model[k].device) for k in model}
        decoded, outcome.wan_bytes_up = self.wan(region, update)
        return {k: base[k].to(decoded[k].device) + decoded[k] for k in model}

    def _map_top(self, report: RoundReport, inner_excluded: list[int]) -> None:
        """The top rule's verdicts on regions, onto their members: `report` names nodes only."""
        regions = {region_node(o.region): o for o in self.last}
        excluded = set(inner_excluded)
        for node in report.excluded:
            if (outcome := regions.get(node)) is not None:
                outcome.top_excluded = True
                excluded.update(n for n in outcome.nodes if n not in outcome.excluded)
        for node, score in report.scores.items():
            if (outcome := regions.get(node)) is not None:
                outcome.score = score
        report.excluded, report.scores = sorted(excluded), {}

    def state_dict(self) -> dict[str, Any]:
        """What the aggregators keep across rounds: the WAN codec's residuals, if it has any."""
        state = getattr(self.wan, "state_dict", None)
        return {"wan": state()} if state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "wan" in state and (load := getattr(self.wan, "load_state_dict", None)) is not None:
            load(state["wan"])

    def problems(self, members: dict[int, int]) -> list[str]:
        """Why regions of these sizes (region -> sites) could never satisfy the inner rule."""
        return [f"region {r} ({m} sites): {why}" for r, m in sorted(members.items()) if (why := self.too_few(m))]

    def row(self) -> dict[str, dict[str, Any]]:
        """The row's `regions` column: each region's members, weight, exclusions and WAN bytes."""
        return {str(o.region): o.row() for o in self.last}

    def wan_bytes_up(self) -> dict[int, int]:
        """region -> its update's bytes on the WAN in the last round: 0 without an update, the
        encoded size through a WAN codec; regions whose update went as it is are left out (the
        caller counts them as one reply's size)."""
        return {o.region: 0 if not o.sent else o.wan_bytes_up for o in self.last if not o.sent or o.wan_bytes_up}
