"""Settle a pool from a run's ledger: `python -m app.ledger settle RUN_DIR --pool AMOUNT --rule R`.

A node's record in an entry earns for that step only if all of these hold:
- its update was applied (not rejected, excluded by the robust rule, stale, missing or failed);
- it carries a signed work record that verifies (`ledger.work_keys`: app/ledger/work.py), so the
  payee is the site whose key signed, for this run and this reply;
- where the run scored contributions (`ledger.contribution`), its score is above zero: a free-rider
  (an update that only replays the public step, or none) or a harmful update earns nothing.

What an earning step is worth, by rule, over the whole run:
- `work`: the effective weight the aggregation gave the update (the ledger's `weight`: a mean's
  capped count, a robust rule's or central DP's one equal weight, times FedBuff's staleness factor),
  never the seconds the node claims (a site signs its own claims). payout_i = pool x W_i / sum_j W_j.
  Without contribution scores only where that weight cannot favour a free-rider (a node that sends
  the public model back, signed, claiming the cap), `work_unbounded`: in rounds, every update used
  and weighed alike (a coordinate-wise median or trimmed mean, central DP), so a free-rider earns
  exactly what an honest node answering the same tasks earns, never more.
- `contribution`: the step's contribution score. payout_i = pool x C_i / sum_j C_j, C_i the sum of
  node i's positive scores.
- `blend`: `--blend B` of the work share and 1 - B of the contribution share, each as above.
A ledger that does not verify is refused whole, and so is a run without verified work records.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.ledger.chain import LEDGER_FILE, read_entries
from app.ledger.verify import verify_run

RULES = ("work", "contribution", "blend")
SETTLEMENT_CSV = "settlement.csv"
SETTLEMENT_JSON = "settlement.json"


class SettlementError(ValueError):
    """A ledger or a rule that cannot be settled, with the reason."""


@dataclass
class Payee:
    node_id: int
    site: str = ""
    earning_steps: int = 0
    unpaid_steps: dict[str, int] = field(default_factory=dict)  # why a step earned nothing -> how many
    work: float = 0.0
    contribution: float = 0.0
    payout: float = 0.0


def _unpaid_reason(record: dict[str, Any], scored: bool) -> str | None:
    """Why this step of this node earns nothing (None: it earns)."""
    outcome = str(record.get("outcome", ""))
    if outcome != "applied":
        return outcome.split(":")[0]  # rejected, excluded by <rule>, stale, missing, failed, unused
    if "work" not in record:
        return "no signed work record"
    if scored and not (float(record.get("contribution", 0.0)) > 0):
        return "contribution <= 0 (free-rider or harmful)"
    return None


def work_unbounded(entries: list[dict[str, Any]]) -> str | None:
    """Why, without contribution scores, paying by weight could pay a free-rider more than an honest
    node (None: it cannot): a step that weighed updates by their claimed counts (a claim of the cap
    buys the cap), a FedBuff version (a node that does not train answers at once and fills more of
    the buffers), or a rule that kept some updates and excluded others (Krum, Multi-Krum, Bulyan:
    the public model sits at the centre of the honest updates, so it is kept first)."""
    for entry in entries:
        step = f"step {entry.get('step')}"
        if "weights" not in entry:
            return f"{step} does not record how it weighed the updates (a ledger of an older version)"
        if entry["weights"] != "alike":
            return f"{step} weighed updates by their claimed example counts (a claim buys weight up to the cap)"
        if entry.get("unit") != "round":
            return f"{step} is a FedBuff version (a node that does not train answers first and fills more buffers)"
        if excluded := [n["node_id"] for n in entry.get("nodes", []) if str(n.get("outcome")).startswith("excluded")]:
            return f"{step}'s rule kept some updates and excluded others ({excluded}): it may keep a free-rider's first"
    return None


def settle(run_dir: Path, pool: float, rule: str, blend: float = 0.5) -> list[Payee]:
    """The payout per node of `pool` under `rule` (module docstring), highest first."""
    if rule not in RULES:
        raise SettlementError(f"--rule {rule}: one of {', '.join(RULES)}")
    if not pool > 0:
        raise SettlementError(f"--pool {pool}: must be a positive amount")
    if not 0 <= blend <= 1:
        raise SettlementError(f"--blend {blend}: between 0 and 1")
    problems = verify_run(run_dir)
    if problems:
        raise SettlementError("the ledger does not verify, so nothing in it is settled: " + "; ".join(problems))
    entries = read_entries(Path(run_dir) / LEDGER_FILE)
    records = [r for e in entries for r in e.get("nodes", [])]
    if not any("work" in r for r in records):
        raise SettlementError("no signed work records in this ledger: settle a run made with ledger.work_keys=DIR")
    scored = any("contribution" in r for r in records)
    if rule != "work" and not scored:
        raise SettlementError(f"--rule {rule} needs contribution scores: run with ledger.contribution=loo|shapley")
    if not scored and (why := work_unbounded(entries)) is not None:
        raise SettlementError(
            f"--rule work without contribution scores would pay a free-rider (no data, the public model sent "
            f"back with a valid signature) as much as the aggregation weighed it, and {why}: run with "
            "ledger.contribution=loo|shapley (a free-rider then earns nothing), or with a rule that uses every "
            "update alike in rounds (strategy=median or trimmed_mean, or central DP)"
        )
    payees: dict[int, Payee] = {}
    for r in records:
        payee = payees.setdefault(int(r["node_id"]), Payee(int(r["node_id"])))
        payee.site = payee.site or str(r.get("work", {}).get("site", ""))
        if (why := _unpaid_reason(r, scored)) is not None:
            payee.unpaid_steps[why] = payee.unpaid_steps.get(why, 0) + 1
            continue
        payee.earning_steps += 1
        payee.work += float(r.get("weight") or 0.0)
        payee.contribution += float(r.get("contribution", 0.0)) if scored else 0.0
    total_work = sum(p.work for p in payees.values())
    total_contribution = sum(p.contribution for p in payees.values())
    share = {"work": 1.0, "contribution": 0.0, "blend": blend}[rule]
    for p in payees.values():
        by_work = p.work / total_work if total_work > 0 else 0.0
        by_contribution = p.contribution / total_contribution if total_contribution > 0 else 0.0
        p.payout = pool * (share * by_work + (1 - share) * by_contribution)
    return sorted(payees.values(), key=lambda p: (-p.payout, p.node_id))


def write_settlement(run_dir: Path, pool: float, rule: str, blend: float = 0.5) -> tuple[str, Path, Path]:
    """Settle, write `settlement.csv` and `settlement.json` into the run, and return a table."""
    payees = settle(run_dir, pool, rule, blend)
    run_dir = Path(run_dir)
    columns = ("node_id", "site", "payout", "earning_steps", "work", "contribution", "unpaid_steps")
    rows = [
        {
            "node_id": p.node_id,
            "site": p.site,
            "payout": round(p.payout, 6),
            "earning_steps": p.earning_steps,
            "work": p.work,
            "contribution": p.contribution,
            "unpaid_steps": "; ".join(f"{why}: {n}" for why, n in sorted(p.unpaid_steps.items())),
        }
        for p in payees
    ]
    csv_path, json_path = run_dir / SETTLEMENT_CSV, run_dir / SETTLEMENT_JSON
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    payload = {"pool": pool, "rule": rule, "blend": blend if rule == "blend" else None, "payees": rows}
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    lines = [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)]
    lines += [f"| {' | '.join(str(r[c]) for c in columns)} |" for r in rows]
    return "\n".join(lines), csv_path, json_path
