"""What the contribution ledger records of one round or FedBuff version (app/ledger/chain.py):
per node that was sent a task, the sha256 of its reply, its claimed example count, the compute it
reports, what became of its update and, for an applied one, the weight the aggregation gave it.

Counts, compute seconds and energy are the node's own claims (marked `reported_`): the ledger
records what was claimed and what the server made of it, never vouches for the claim itself.
`weight` is the update's effective weight in the step: its capped count under a mean (a claim buys
weight up to the cap), one equal weight under a robust rule or central DP (a claim buys nothing),
times FedBuff's staleness factor; the entry's `weights` says which (`weighing`), and settlement
reads both (app/ledger/settle.py).
"""

from __future__ import annotations

from typing import Any

from flwr.app import Message, MetricRecord

from app.config.schema import Config
from app.protocol import GPU_POWER_MEAN_W, NUM_EXAMPLES, WALL_TIME_S
from app.regions.topology import has_regions
from app.run.arrivals import ReplyFacts
from app.secagg.server import Outcome
from strategies.fedavg import RoundReport
from strategies.fedbuff import VersionReport
from strategies.node_text import printable
from strategies.registry import ROBUST_RULES

POWER_KEY = GPU_POWER_MEAN_W  # app/task/telemetry.py: mean NVML board power while training
COMPUTE_KEY = WALL_TIME_S  # the node's training time
UNSCORED = ("rejected", "failed", "missing", "stale")  # outcomes of updates no score is computed for
CLAIMS, ALIKE = "claims", "alike"  # an entry's `weights`: how its step weighed the updates it used


def weighing(cfg: Config) -> str:
    """How the run's steps weigh the updates they use (each entry's `weights`): `alike` where a
    robust rule or central DP gives every update it uses the same weight (FedBuff: its staleness
    factor), whatever it claims; `claims` where a mean weighs each by its capped claimed count
    (FedAvg, SCAFFOLD, Ditto, FedBuff's mean buffer, SecAgg+'s sum), and over regions, whose
    updates carry their sites' capped counts to the top."""
    if has_regions(cfg.topology):
        return CLAIMS
    rule = cfg.strategy.buffer_aggregator if cfg.strategy.name == "fedbuff" else cfg.strategy.name
    return ALIKE if rule in ROBUST_RULES or cfg.privacy.name.startswith("central") else CLAIMS


def _claims(metrics: MetricRecord | None) -> dict[str, Any]:
    """The reply's claims worth recording: examples, compute seconds, energy (power x time)."""
    if metrics is None:
        return {}
    out: dict[str, Any] = {}
    if isinstance(metrics.get(NUM_EXAMPLES), int | float):
        out["reported_examples"] = float(metrics[NUM_EXAMPLES])
    if isinstance(seconds := metrics.get(COMPUTE_KEY), int | float):
        out["reported_compute_s"] = float(seconds)
        if isinstance(power := metrics.get(POWER_KEY), int | float):
            out["reported_energy_j"] = float(power) * float(seconds)
    return out


def round_nodes(
    messages: list[Message], replies: list[ReplyFacts], report: RoundReport, rule: str, weights: str = CLAIMS
) -> list[dict]:
    """One record per node sent a training task this round, in the order the tasks were sent; an
    applied update's `weight` as `weights` (`weighing`) says the round weighed it."""
    node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
    reply_of = {node_of.get(r.reply_to): r for r in replies}
    rejected = {r.node_id: r.reason for r in report.rejected}
    capped = {c["node_id"]: c["weight"] for c in report.capped}
    out = []
    for message in messages:
        node = message.metadata.dst_node_id
        record: dict[str, Any] = {"node_id": node}
        reply = reply_of.get(node)
        if reply is None:
            record["outcome"] = "missing"
        elif reply.error is not None:
            record["outcome"] = f"failed: {printable(reply.error)}"
        else:
            if reply.digest is not None:
                record["reply_sha256"] = reply.digest
            record |= _claims(reply.metrics[0] if len(reply.metrics) == 1 else None)
            if node in rejected:
                record["outcome"] = f"rejected: {rejected[node]}"
            elif node in report.excluded:
                record["outcome"] = f"excluded by {rule}"
            elif node in report.accepted:
                record["outcome"] = "applied"
                record["weight"] = 1.0 if weights == ALIKE else capped.get(node, record.get("reported_examples"))
            else:
                record["outcome"] = "unused"  # a round whose model was not updated (e.g. too few replies)
        out.append(record)
    applied = [r for r in out if r["outcome"] == "applied" and r.get("weight")]
    total = sum(r["weight"] for r in applied)
    for r in applied:
        r["share"] = r["weight"] / total
    return out


def secure_nodes(messages: list[Message], outcome: Outcome) -> list[dict]:
    """A secure round's records, one per node sampled: whether its masked input is in the sum, or the
    stage it left at and why; the hash of its masked input (what it sent: `reply_sha256`, so a node
    can check its receipt), never a count, weight or compute figure (the server does not learn
    them: a masked reply's clear metrics are its device's, protocol.SECAGG_CLEAR)."""
    out = []
    for message in messages:
        node = message.metadata.dst_node_id
        record: dict[str, Any] = {"node_id": node}
        if node in outcome.digests:
            record["reply_sha256"] = outcome.digests[node]
        if node in outcome.survivors:
            record["outcome"] = "applied"  # inside the secure sum: no weight or share is known
        elif node in outcome.dropped:
            record["outcome"] = f"failed: {printable(outcome.dropped[node])}"
        else:
            record["outcome"] = "unused" if outcome.aborted else "missing"
        out.append(record)
    return out


def version_nodes(report: VersionReport, rule: str, weights: str = CLAIMS) -> list[dict]:
    """One record per reply or failure since the previous FedBuff version; an applied update's
    `weight` as `weights` (`weighing`) says the version weighed it: its staleness factor s(τ) alone
    under a robust buffer rule or central DP, its capped count times s(τ) under the mean."""
    claims: dict[int, dict[str, Any]] = {}
    for node, metrics in report.client_metrics:
        claims[node] = _claims(metrics)
    used = {id(u): u["scale"] if weights == ALIKE else u["weight"] for u in report.applied}
    total = sum(used.values())
    out: list[dict[str, Any]] = []

    def base(node: int) -> dict[str, Any]:
        record: dict[str, Any] = {"node_id": node, **claims.get(node, {})}
        if node in report.digests:
            record["reply_sha256"] = report.digests[node]
        return record

    for u in report.applied:  # the buffer's updates the step used (a robust rule's picks)
        weight = used[id(u)]
        out.append(
            {
                **base(u["node_id"]),
                "outcome": "applied",
                "staleness": u["staleness"],
                "weight": weight,
                "share": weight / total if total else None,
            }
        )
    rejected = {r.node_id for r in report.rejected}
    excluded = [n for n in (report.robust or {}).get("excluded", []) if n not in rejected]
    out += [{**base(node), "outcome": f"excluded by {rule}"} for node in excluded]
    out += [{**base(r.node_id), "outcome": f"rejected: {r.reason}"} for r in report.rejected]
    out += [{**base(node), "outcome": "stale"} for node in report.stale_nodes]
    out += [{"node_id": r.node_id, "outcome": f"failed: {r.reason}"} for r in report.failed]
    return out


def attach_scores(nodes: list[dict], scores: dict[int, float]) -> None:
    """Each node's contribution score on its first record whose update was scored (applied,
    excluded or unused; not a rejected, failed, missing or stale one)."""
    done: set[int] = set()
    for record in nodes:
        node = record["node_id"]
        if node in scores and node not in done and not record["outcome"].startswith(UNSCORED):
            record["contribution"] = scores[node]
            done.add(node)
