"""topology=regions on a deployment, the global server's side: its nodes are regional aggregators
(app/regions/aggregator.py), each replying with its region's one-round aggregate and weight, and
the global strategy combines those as it would any node's replies
(docs/deployment.md#regions-two-level-deployment).

In simulation the server combines the regions itself (the sites are its nodes); on a deployment
it cannot see the sites, so three things change, all decided here and nowhere else: every training
task carries the overrides of the regions' sub-runs, an aggregator's weight (its sites' capped
counts summed) is capped at `topology.region_max_examples` rather than at one node's
`federation.max_examples_per_node`, and secagg=plus runs inside the sub-runs, not at the top.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from flwr.app import MetricRecord
from flwr.serverapp import Grid

from app.config.schema import Config, ConfigError
from app.config.validate import problem_block
from app.protocol import REGION_RUN_OVERRIDES
from app.regions.aggregator import merge_overrides
from strategies.replies import WeightCap

log = logging.getLogger("flwr.fedgpu." + __name__)


@dataclass(frozen=True)
class RegionalDeployment:
    """What a two-level deployment adds to the global run: the training tasks' extra config keys
    and the aggregators' weight cap."""

    task_config: dict[str, str]
    weight_cap: WeightCap

    @staticmethod
    def top(cfg: Config) -> Config:
        """The global run's own strategy settings: secagg=plus runs inside each region's sub-run (its
        overrides carry it: each aggregator learns its sites' sums only); the top combines the
        aggregators' models, which they send in the clear, with plain FedAvg."""
        return replace(cfg, secagg=replace(cfg.secagg, name="none"))


def region_run_overrides(cfg: Config, overrides: str) -> str:
    """The overrides of a region's sub-run: the global run's, with the region's own rule as the
    strategy (`topology.region_rule`, f = `topology.region_byzantine`), one round, flat. The
    aggregator adds the starting model, the sub-run's name and its region's own overrides."""
    t = cfg.topology
    rule = "fedavg" if t.region_rule == "mean" else t.region_rule
    byzantine = f" strategy.num_byzantine={t.region_byzantine}" if t.region_rule != "mean" else ""
    return merge_overrides(overrides, f"strategy={rule}{byzantine} topology=flat federation.rounds=1")


def refusals(cfg: Config) -> list[str]:
    """What a two-level deployment does not do (yet), each with the reason; [] when it can run."""
    t, f = cfg.topology, cfg.federation
    problems = []
    if t.region_max_examples < 0:
        problems.append(f"topology.region_max_examples={t.region_max_examples}: must be >= 0 (0: federation's cap)")
    if cfg.privacy.name != "none":
        problems.append(
            f"privacy={cfg.privacy.name}: a two-level deployment has no privacy accounting across its levels yet, "
            "and a region's weight is an exact statistic of its sites: use privacy=none"
        )
    if cfg.compression.name != "none":
        problems.append(
            f"compression={cfg.compression.name}: an aggregator replies with its region's model as it is: "
            "use compression=none"
        )
    if t.wan_compression != "none":
        problems.append(
            f"topology.wan_compression={t.wan_compression}: simulated only; an aggregator sends its region's model "
            "as it is"
        )
    if cfg.strategy.name == "fedbuff":
        problems.append(
            "strategy=fedbuff: FedBuff over regions runs in simulation (app/regions/grid.py); over deployed "
            "aggregators it is not built yet: use a synchronous strategy"
        )
    if f.fraction_evaluate > 0:
        problems.append(
            f"federation.fraction_evaluate={f.fraction_evaluate}: an aggregator holds no data to evaluate on; "
            "the regions' sub-runs and the global server evaluate centrally"
        )
    if cfg.model.name == "hf":
        problems.append(
            "model=hf: its frozen base never travels, and a sub-run starts from a whole model "
            "(model.init_weights): not supported in a two-level deployment"
        )
    return problems


def deployed_regions(cfg: Config, grid: Grid, simulated: bool) -> RegionalDeployment | None:
    """The two-level additions when the run is topology=regions on deployed nodes (None otherwise);
    a ConfigError naming every setting it cannot run with, before any work."""
    if cfg.topology.name != "regions" or simulated:
        return None
    if problems := refusals(cfg):
        raise ConfigError(problem_block(problems))
    overrides = str(grid.run.override_config.get("overrides", ""))  # the run config's, as Flower holds it
    limit = float(cfg.topology.region_max_examples or cfg.federation.max_examples_per_node)
    sub_run = region_run_overrides(cfg, overrides)
    log.info(
        "topology=regions on a deployment: the nodes are regional aggregators, each counted for at most %g examples "
        "(topology.region_max_examples); their sub-runs' overrides: %s",
        limit,
        sub_run,
    )

    def cap(node_id: int, metrics: MetricRecord, kind: str) -> float:
        return limit

    return RegionalDeployment({REGION_RUN_OVERRIDES: sub_run}, cap)
