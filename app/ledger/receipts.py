"""A site's side of the ledger: the receipts of its replies, read from a run's ledger, and the check
of the receipts file its ClientApp kept (`state-dir/ledger-receipts-run<id>.jsonl`).

`python -m app.ledger receipts RUN_DIR --node ID` lists every entry that recorded a reply of the
node (step, entry hash, the reply's sha256, what became of it): the receipt of its last reply
too, which no further task carried. With `--check FILE` the site's file is held against the
ledger: every receipt it was sent must be the entry at that step, every reply it sent should be
recorded, and what the ClientApp already flagged (a receipt for a reply it did not send, two
receipts for one step) is reported again; `--keep` appends the receipts the file lacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.ledger.chain import read_entries


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a receipts file, one a line as in the ledger itself (a line that is not
    one raises ValueError naming the file and the line)."""
    try:
        return read_entries(path)
    except ValueError as err:
        raise ValueError(f"{path} {err}") from None


def node_receipts(entries: list[dict[str, Any]], node: int) -> list[dict[str, Any]]:
    """One receipt per record of a reply of `node`: step, entry hash, reply_sha256, outcome."""
    out = []
    for entry in entries:
        for record in entry.get("nodes", []):
            if record.get("node_id") == node and "reply_sha256" in record:
                out.append(
                    {
                        "node_id": node,
                        "step": entry["step"],
                        "hash": entry["hash"],
                        "reply_sha256": record["reply_sha256"],
                        "outcome": record.get("outcome"),
                    }
                )
    return out


def check_receipts(
    entries: list[dict[str, Any]], lines: list[dict[str, Any]], node: int
) -> tuple[list[str], list[dict[str, Any]]]:
    """(what contradicts the ledger or was flagged, the receipts of recorded replies the file lacks)."""
    by_step = {e["step"]: e["hash"] for e in entries}
    recorded = node_receipts(entries, node)
    problems: list[str] = []
    held: dict[int, list[str]] = {}
    for line in (item for item in lines if "step" in item and item.get("node_id", node) == node):
        step, digest = int(line["step"]), str(line["hash"])
        held.setdefault(step, [])
        if digest not in held[step]:
            held[step].append(digest)
        if step not in by_step:
            problems.append(f"receipt for step {step} (entry {digest[:12]}): the ledger has no step {step}")
        elif by_step[step] != digest:
            problems.append(
                f"receipt for step {step} names entry {digest[:12]}, the ledger's step {step} is "
                f"{by_step[step][:12]}: the ledger was rewritten after it acknowledged this node's reply"
            )
        if line.get("mismatch"):
            problems.append(
                f"the node flagged the receipt for step {step}: entry {digest[:12]} records reply "
                f"{str(line.get('reply_sha256'))[:12]}, which is none of the replies it sent"
            )
    for step, digests in sorted(held.items()):
        if len(digests) > 1:
            problems.append(
                f"conflicting receipts for step {step}: entries {', '.join(d[:12] for d in digests)} "
                "(the server acknowledged two different entries for one step)"
            )
    sent = [item for item in lines if "sent_sha256" in item and item.get("node_id", node) == node]
    in_ledger = {r["reply_sha256"] for r in recorded}
    for item in sent:
        if item["sent_sha256"] not in in_ledger:
            problems.append(
                f"reply {item['sent_sha256'][:12]} (round {item.get('round')}) is not in the ledger: it did not "
                "arrive in time, or it was left out of the record"
            )
    kept = {(s, d) for s, ds in held.items() for d in ds}
    missing = [r for r in recorded if (r["step"], r["hash"]) not in kept]
    return problems, missing


def nodes_in(lines: list[dict[str, Any]]) -> set[int]:
    return {int(item["node_id"]) for item in lines if "node_id" in item}
