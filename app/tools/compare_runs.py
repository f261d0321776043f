"""Overlay runs: test accuracy against wall-clock time (and against rounds/versions).

    python -m app.compare_runs ~/fedgpu-runs/<sync run> ~/fedgpu-runs/<fedbuff run> -o compare.png

Synchronous rounds and asynchronous versions are different units; seconds are not,
which is why the left panel is the one to read when comparing FedAvg and FedBuff.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from app.run.results import read_rows, read_summary


def read_curve(run_dir: Path) -> tuple[list[float], list[int], list[float]]:
    """(wall times, rounds, accuracies) of the evaluated rows of a run's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass run directories (the ones holding metrics.jsonl)")
    rows = [r for r in read_rows(run_dir) if r.get("accuracy") is not None]
    return [r["wall_time_s"] for r in rows], [r["round"] for r in rows], [r["accuracy"] for r in rows]


def draw_curves(
    ax, runs: Sequence[tuple[str, Path]], x: str = "time", title: str = "", target: float | None = None
) -> None:  # noqa: ANN001
    """Accuracy of each `(label, run dir)` on one matplotlib axis, against wall time or rounds."""
    for label, run_dir in runs:
        times, rounds, accs = read_curve(run_dir)
        ax.plot(times if x == "time" else rounds, accs, marker=".", label=label)
    if x == "time":
        ax.set(xlabel="wall-clock time (s)", ylabel="test accuracy", title=title or "Accuracy over time")
    else:
        ax.set(xlabel="round (sync) / version (async)", ylabel="test accuracy", title=title or "Accuracy per update")
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
    parser.add_argument("--target", type=float, default=None, help="draw a target accuracy line")
    args = parser.parse_args(argv)
    labels = []
    for run in args.runs:
        strategy = (read_summary(run) or {}).get("strategy", "")
        labels.append(f"{run.name} ({strategy})" if strategy else run.name)
    print(plot_runs(list(zip(labels, args.runs, strict=True)), args.out, target=args.target))
