"""What the contribution ledger records of one round or FedBuff version (app/ledger/chain.py):
per node that was sent a task, the sha256 of its reply, its claimed and used example counts,
the compute it reports, and what became of its update.

Counts, compute seconds and energy are the node's own claims (marked `reported_`): the ledger
records what was claimed and what the server made of it (`weight`, after the cap), never
vouches for the claim itself.
"""

from __future__ import annotations

from typing import Any

from flwr.app import Message, MetricRecord

from app.protocol import GPU_POWER_MEAN_W, NUM_EXAMPLES, WALL_TIME_S
from app.run.arrivals import ReplyFacts
from app.secagg.server import Outcome
from strategies.fedavg import RoundReport
from strategies.fedbuff import VersionReport
from strategies.node_text import printable

POWER_KEY = GPU_POWER_MEAN_W  # app/task/telemetry.py: mean NVML board power while training
COMPUTE_KEY = WALL_TIME_S  # the node's training time
UNSCORED = ("rejected", "failed", "missing", "stale")  # outcomes of updates no score is computed for


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


def round_nodes(messages: list[Message], replies: list[ReplyFacts], report: RoundReport, rule: str) -> list[dict]:
    """One record per node sent a training task this round, in the order the tasks were sent."""
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
                record["weight"] = capped.get(node, record.get("reported_examples"))
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
    can check its receipt) and the compute it reported, never a count or weight (the server does
    not learn them)."""
    out = []
    for message in messages:
        node = message.metadata.dst_node_id
        record: dict[str, Any] = {"node_id": node}
        if node in outcome.digests:
            record["reply_sha256"] = outcome.digests[node]
            record |= _claims(outcome.clear.get(node))  # compute and energy: sent in the clear
        if node in outcome.survivors:
            record["outcome"] = "applied"  # inside the secure sum: no weight or share is known
        elif node in outcome.dropped:
            record["outcome"] = f"failed: {printable(outcome.dropped[node])}"
        else:
            record["outcome"] = "unused" if outcome.aborted else "missing"
        out.append(record)
    return out


def version_nodes(report: VersionReport, rule: str) -> list[dict]:
    """One record per reply or failure since the previous FedBuff version."""
    claims: dict[int, dict[str, Any]] = {}
    for node, metrics in report.client_metrics:
        claims[node] = _claims(metrics)
    total = sum(u["weight"] for u in report.applied)
    out: list[dict[str, Any]] = []

    def base(node: int) -> dict[str, Any]:
        record: dict[str, Any] = {"node_id": node, **claims.get(node, {})}
        if node in report.digests:
            record["reply_sha256"] = report.digests[node]
        return record

    for u in report.applied:  # the buffer's updates the step used (a robust rule's picks)
        share = u["weight"] / total if total else None
        out.append(
            {
                **base(u["node_id"]),
                "outcome": "applied",
                "staleness": u["staleness"],
                "weight": u["weight"],
                "share": share,
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
