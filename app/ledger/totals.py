"""Per-node totals of a run's ledger: tasks, applied and refused updates, examples used, and the
compute and energy the nodes report; as a table, a CSV and a plot."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from app.ledger.chain import LEDGER_FILE, read_entries
from app.ledger.verify import verify_run

COLUMNS = (
    "node_id",
    "contribution",
    "tasks",
    "applied",
    "refused",
    "excluded",
    "stale",
    "missing_or_failed",
    "weight",
    "compute_s",
    "energy_j",
)


def node_totals(run_dir: Path) -> list[dict[str, Any]]:
    """One row per node: highest cumulative contribution first (ledger.contribution), then most weight."""
    totals: dict[int, dict[str, Any]] = {}
    for entry in read_entries(Path(run_dir) / LEDGER_FILE):
        for n in entry["nodes"]:
            row = totals.setdefault(n["node_id"], dict.fromkeys(COLUMNS, 0) | {"node_id": n["node_id"]})
            outcome = n["outcome"]
            row["tasks"] += 1
            if outcome == "applied":
                row["applied"] += 1
                row["weight"] += n.get("weight") or 0
            elif outcome.startswith("rejected"):
                row["refused"] += 1
            elif outcome.startswith("excluded"):
                row["excluded"] += 1
            elif outcome == "stale":
                row["stale"] += 1
            elif outcome == "missing" or outcome.startswith("failed"):
                row["missing_or_failed"] += 1
            row["contribution"] += n.get("contribution", 0.0)
            row["compute_s"] += n.get("reported_compute_s", 0.0)
            row["energy_j"] += n.get("reported_energy_j", 0.0)
    return sorted(totals.values(), key=lambda r: (-r["contribution"], -r["weight"], r["node_id"]))


OUTCOMES = (  # the plot's stacked bars: (column, colour)
    ("applied", "tab:green"),
    ("excluded", "tab:orange"),
    ("refused", "tab:red"),
    ("stale", "tab:grey"),
    ("missing_or_failed", "black"),
)


def cumulative_contributions(run_dir: Path) -> tuple[list[int], dict[int, list[float]]]:
    """(the ledger's steps, node -> its cumulative contribution after each step); empty without scores."""
    entries = read_entries(Path(run_dir) / LEDGER_FILE)
    steps = [e["step"] for e in entries]
    curves: dict[int, list[float]] = {}
    for i, entry in enumerate(entries):
        for n in entry["nodes"]:
            if "contribution" in n:
                curve = curves.setdefault(n["node_id"], [0.0] * len(entries))
                for j in range(i, len(entries)):
                    curve[j] += n["contribution"]
    return steps, curves


def plot_report(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """ledger_report.png: what became of each node's updates (stacked bars, highest contribution
    on the left) and, with `ledger.contribution`, each node's cumulative contribution per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps, curves = cumulative_contributions(run_dir)
    panels = 2 if curves else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    labels = [str(r["node_id"]) for r in rows]
    bottom = [0] * len(rows)
    for column, colour in OUTCOMES:
        heights = [r[column] for r in rows]
        ax.bar(labels, heights, bottom=bottom, color=colour, label=column.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set(xlabel="node (highest contribution first)", ylabel="updates", title="What became of each node's updates")
    ax.tick_params(axis="x", labelrotation=90 if len(rows) > 8 else 0)
    ax.set_ylim(0, max(bottom, default=1) * 1.3)  # room for the legend above the bars
    ax.legend(fontsize="small", loc="upper center", ncol=3)
    if curves:
        ax = axes[0][1]
        for node in (r["node_id"] for r in rows if r["node_id"] in curves):
            ax.plot(steps, curves[node], marker=".", label=str(node))
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="round / version", ylabel="cumulative contribution", title="Contribution over the run")
        if len(curves) <= 12:
            ax.legend(title="node", fontsize="small")
    fig.tight_layout()
    out = Path(run_dir) / "ledger_report.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_ledger(run_dir: Path) -> dict[str, Any]:
    """A run's ledger in one line of a sweep report: whether it verifies (`verified`, `off`, or
    `broken` with the first problem), its head hash, the compute and energy its nodes reported,
    and the node with the lowest cumulative contribution (when scored)."""
    if not (Path(run_dir) / LEDGER_FILE).exists():
        return {"ledger": "off"}
    problems = verify_run(run_dir)
    entries = read_entries(Path(run_dir) / LEDGER_FILE) if not problems else []
    totals = node_totals(run_dir) if not problems else []
    scored = any("contribution" in n for e in entries for n in e["nodes"])
    return {
        "ledger": "broken" if problems else "verified",
        "ledger_problem": problems[0] if problems else None,
        "ledger_head": entries[-1]["hash"] if entries else None,
        "reported_compute_s": sum(r["compute_s"] for r in totals) if totals else None,
        "reported_energy_j": sum(r["energy_j"] for r in totals) if totals else None,
        "lowest_contribution_node": totals[-1]["node_id"] if scored else None,
    }


def write_report(run_dir: Path) -> tuple[str, Path, Path]:
    """(a Markdown table of node_totals, the CSV and the plot written next to the ledger)."""
    rows = node_totals(run_dir)
    out = Path(run_dir) / "ledger_report.csv"
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "| node | contribution | tasks | applied | refused | excluded | stale | missing/failed | weight used "
        "| compute s (reported) | energy J (reported) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['node_id']} | {r['contribution']:.4g} | {r['tasks']} | {r['applied']} | {r['refused']} | {r['excluded']} | {r['stale']} "
            f"| {r['missing_or_failed']} | {r['weight']:,.0f} | {r['compute_s']:.1f} | {r['energy_j']:.0f} |"
        )
    return "\n".join(lines), out, plot_report(run_dir, rows)
