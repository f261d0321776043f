"""Overlay runs: the primary metric on the test split against time (simulated seconds for fleet
runs on a virtual clock, else wall-clock) and against rounds/versions. The primary metric is
summary.json's `primary_metric` (the run's first
`task.metrics` entry), accuracy for runs written before metrics were configurable.

    python -m app.compare_runs ~/fedgpu-runs/<sync run> ~/fedgpu-runs/<fedbuff run> -o compare.png

Synchronous rounds and asynchronous versions are different units; seconds are not,
which is why the left panel is the one to read when comparing FedAvg and FedBuff.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from app.run.results import clock_s, read_rows, read_summary


def primary_metric(run_dir: Path) -> str:
    """The run's primary metric: its summary's, else accuracy (older runs, and runs still going)."""
    return str((read_summary(run_dir) or {}).get("primary_metric") or "accuracy")


def read_curve(run_dir: Path, metric: str | None = None) -> tuple[list[float], list[int], list[float]]:
    """(times on the run's clock, rounds, values of `metric`, default the primary one) of the evaluated rows of
    a run's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass run directories (the ones holding metrics.jsonl)")
    metric = metric or primary_metric(run_dir)
    rows = [r for r in read_rows(run_dir) if r.get(metric) is not None]
    return [clock_s(r) for r in rows], [r["round"] for r in rows], [r[metric] for r in rows]


def draw_curves(
    ax, runs: Sequence[tuple[str, Path]], x: str = "time", title: str = "", target: float | None = None
) -> None:  # noqa: ANN001
    """The primary metric of each `(label, run dir)` on one matplotlib axis, against time or
    rounds; runs with different primary metrics say theirs in the legend."""
    metrics = [primary_metric(run_dir) for _, run_dir in runs]
    mixed = len(set(metrics)) > 1
    for (label, run_dir), metric in zip(runs, metrics, strict=True):
        times, rounds, values = read_curve(run_dir, metric)
        ax.plot(times if x == "time" else rounds, values, marker=".", label=f"{label} [{metric}]" if mixed else label)
    name = "primary metric" if mixed or not metrics else metrics[0]
    if x == "time":
        ax.set(xlabel="time (s; simulated for fleet runs)", ylabel=f"test {name}", title=title or f"{name} over time")
    else:
        ax.set(xlabel="round (sync) / version (async)", ylabel=f"test {name}", title=title or f"{name} per update")
    if target:
        ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
    ax.grid(alpha=0.3)
    ax.legend()


def plot_runs(runs: Sequence[tuple[str, Path]], out: Path, target: float | None = None) -> Path:
    """Both views side by side in `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_round) = plt.subplots(1, 2, figsize=(11, 4))
    draw_curves(ax_time, runs, "time", target=target)
    draw_curves(ax_round, runs, "round", target=target)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (holding metrics.jsonl)")
    parser.add_argument("-o", "--out", type=Path, default=Path("compare.png"))
    parser.add_argument("--target", type=float, default=None, help="draw a line at this value of the primary metric")
    args = parser.parse_args(argv)
    labels = []
    for run in args.runs:
        strategy = (read_summary(run) or {}).get("strategy", "")
        labels.append(f"{run.name} ({strategy})" if strategy else run.name)
    print(plot_runs(list(zip(labels, args.runs, strict=True)), args.out, target=args.target))
