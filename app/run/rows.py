"""The rows of metrics.jsonl: one per synchronous round or FedBuff version.

Built here from the strategies' reports so that the round loops only decide *when*
a row is written, and the keys a row can have are listed in one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message, MetricRecord

from app.config.schema import PUBLIC_COLUMNS
from app.protocol import PARTITION_ID
from app.run.arrivals import ReplyFacts
from app.secagg.server import Outcome
from strategies.fedavg import RoundReport
from strategies.fedbuff import VersionReport
from strategies.replies import payload_bytes


def reported(row: dict[str, Any], exact: bool, metric_names: Iterable[str]) -> dict[str, Any]:
    """The row as recorded: with privacy on (the run's privacy object says, `exact_per_node`) only
    its PUBLIC columns (app/config/schema.py ROW_COLUMN_PRIVACY) and the task's `metric_names`, an
    allow-list, so a new column is left out until it is declared public; everything with no privacy
    or privacy.report_exact. The log keeps the rest: it is the operator's, who sees every reply anyway."""
    if exact:
        return row
    shown = PUBLIC_COLUMNS | set(metric_names)
    return {k: v for k, v in row.items() if k in shown}


def reply_metrics(replies: list[ReplyFacts]) -> list[tuple[int, MetricRecord]]:
    """(node id, metrics) of every successful reply."""
    return [(r.src_node_id, record) for r in replies if r.error is None for record in r.metrics]


def node_partitions(metrics: list[tuple[int, MetricRecord]]) -> dict[str, int]:
    """node id -> partition id, as simulated nodes report it (for reading attack results)."""
    return {str(node): m[PARTITION_ID] for node, m in metrics if isinstance(m.get(PARTITION_ID), int)}


def _rejections(items: list) -> list[dict[str, Any]]:
    return [{"node_id": r.node_id, "reason": r.reason} for r in items]


def round_row(
    rnd: int,
    report: RoundReport,
    num_replies: int,
    client_metrics: list[tuple[int, MetricRecord]],
    robust: dict[str, Any] | None,
    updated: bool,
    train: MetricRecord | None,
    federated_eval: MetricRecord | None,
) -> dict[str, Any]:
    """A synchronous round's row, less the run's own columns (accuracy, loss, times); `robust` is
    the robust rule's picks (`strategy.robust_row()`, None for a plain mean); `client_metrics`
    the successful replies' (`reply_metrics`)."""
    return {
        "round": rnd,
        "num_sampled": report.sampled,
        "num_clients": len(report.accepted),
        "num_rejected": len(report.rejected),
        "num_missing": report.sampled - num_replies,
        "model_updated": updated,
        "rejected": _rejections(report.rejected),
        "capped_weights": report.capped,
        **({"norm_clipped": report.clipped} if report.clipped else {}),  # strategy.norm_bound_action=clip
        "robust": robust,
        "node_partitions": node_partitions(client_metrics),
        "train": dict(train) if train else {},
        "federated_eval": dict(federated_eval) if federated_eval else {},
    }


def traffic(bytes_down: list[int], bytes_up: list[int], unpack_s: float | None = None) -> dict[str, Any]:
    """The mean array bytes of the step's tasks sent (`bytes_down`) and replies received (`bytes_up`;
    None without any): what `model.trainable` and compression save; and their totals (exact
    counts: central DP leaves them out, as it does `num_sampled`). With a compressed uplink,
    `unpack_s`: the server's seconds checking and unpacking the step's replies."""
    return {
        "bytes_down": round(sum(bytes_down) / len(bytes_down)) if bytes_down else None,
        "bytes_up": round(sum(bytes_up) / len(bytes_up)) if bytes_up else None,
        "bytes_down_total": sum(bytes_down),
        "bytes_up_total": sum(bytes_up),
        **({"unpack_s": unpack_s} if unpack_s is not None else {}),
    }


def secure_traffic(outcome: Outcome, evaluation: list[Message]) -> dict[str, Any]:
    """`traffic` of a secure round, per node: the arrays, keys, shares and ciphertexts its four stages
    sent it and it sent back (`Outcome.bytes_down` / `bytes_up`), and any evaluation task's arrays;
    means over the nodes sent anything."""
    down = dict(outcome.bytes_down)
    for m in evaluation:
        down[m.metadata.dst_node_id] = down.get(m.metadata.dst_node_id, 0) + payload_bytes(m.content)
    return traffic(list(down.values()), list(outcome.bytes_up.values()))


def secure_row(outcome: Outcome, sum_digest: str | dict[str, str] | None) -> dict[str, Any]:
    """The `secagg` column: the nodes whose inputs are in the sum, who left at which stage and why,
    an abort's reason, and the sha256 of the masked inputs' sum and of the unmasked sum (both also
    in the ledger: each node's entry holds its masked input's hash, so the first can be checked);
    under topology=regions both hashes per region (each region sums on its own)."""
    return {
        "survivors": outcome.survivors,
        "dropped": {str(node): why for node, why in outcome.dropped.items()},
        "aborted": outcome.aborted,
        "masked_sum_sha256": outcome.group_digests or outcome.masked_sum_digest,
        "sum_sha256": sum_digest if outcome.aborted is None else None,
    }


def version_row(report: VersionReport, tasks_sent: int) -> dict[str, Any]:
    """A FedBuff version's row, less the run's own columns (accuracy, loss, times)."""
    return {
        "round": report.version,
        "version": report.version,
        "num_clients": len(report.applied),
        "staleness": [u["staleness"] for u in report.applied],
        "applied": report.applied,
        "num_discarded_stale": report.discarded_stale,
        "num_rejected": len(report.rejected),
        "num_failed": len(report.failed),
        "rejected": _rejections(report.rejected),
        "failed": _rejections(report.failed),
        "robust": report.robust,
        **({"norm_clipped": report.clipped} if report.clipped else {}),  # strategy.norm_bound_action=clip
        "tasks_sent": tasks_sent,
        "train": dict(report.metrics) if report.metrics else {},
    }
