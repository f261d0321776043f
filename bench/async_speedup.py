"""Time to a target accuracy: synchronous FedAvg vs FedBuff with stragglers.

    python bench/async_speedup.py                     # both settings, seed 42
    python bench/async_speedup.py --seeds 42 43 44    # more seeds

The default task (digits, small CNN, the default local training) on 10 nodes, in two settings:
3 nodes 5x slower (`stragglers=fixed`), and lognormal slowdowns with sigma = 1
(`stragglers=lognormal`). Per setting and seed, sync FedAvg runs `--rounds` rounds;
FedBuff then gets exactly the wall-clock time sync took (`federation.max_wall_time_s`).
Both run here, one after the other, through the real ClientApp on 10 concurrent
in-process nodes (app/simulation/local_grid.py, one thread per node): stragglers really sleep
(s − 1) x their measured compute time, and wall time is real. Time to target is the
wall time of the first central evaluation at or above `--target`.

Prints a table with both times, the speedup and both final accuracies, writes the
numbers as JSON and an accuracy-vs-time plot that overlays the runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_model  # noqa: E402

from app.tools.compare_runs import draw_curves, read_curve  # noqa: E402
from app.tools.in_process import run_in_process  # noqa: E402

SETTINGS = {"3 nodes 5x slower": "stragglers=fixed", "lognormal sigma=1": "stragglers=lognormal stragglers.sigma=1.0"}
FEDBUFF = "strategy=fedbuff federation.eval_every=2 federation.rounds=100000"


def run(overrides: str, root: Path, nodes: int) -> dict:
    """One run's summary; every node trains in its own thread."""
    return run_in_process(overrides, root, nodes=nodes, workers=nodes)[0]


def time_to(target: float, run_dir: str) -> float | None:
    times, _, accs = read_curve(Path(run_dir))
    return next((t for t, a in zip(times, accs, strict=True) if a >= target), None)


def curve(run_dir: str) -> list[list[float]]:
    """[wall time, accuracy] of every evaluation, kept in the JSON with the summary numbers."""
    times, _, accs = read_curve(Path(run_dir))
    return [[round(t, 2), a] for t, a in zip(times, accs, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=15, help="sync FedAvg rounds (sets the shared time budget)")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--fedbuff", default="", help="extra Hydra overrides for the FedBuff runs")
    parser.add_argument("--out", type=Path, default=Path("docs/async-results.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/async.png"))
    parser.add_argument("--runs", type=Path, default=None, help="keep run directories here (default: a temp dir)")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    root = args.runs or Path(tempfile.mkdtemp(prefix="async-bench-"))

    print(f"machine: {cpu_model()}; {args.nodes} nodes, target accuracy {args.target}; runs in {root}")
    results = []
    for setting, stragglers in SETTINGS.items():
        for seed in args.seeds:
            common = f"seed={seed} {stragglers}"
            t0 = time.time()
            sync = run(f"federation.rounds={args.rounds} {common}", root, args.nodes)
            budget = sync["wall_time_s"]
            fedbuff = run(
                f"{FEDBUFF} federation.max_wall_time_s={budget:.1f} {common} {args.fedbuff}", root, args.nodes
            )
            t_sync, t_buff = time_to(args.target, sync["run_dir"]), time_to(args.target, fedbuff["run_dir"])
            row = {
                "setting": setting,
                "seed": seed,
                "slowdowns": [round(x, 2) for x in sync["stragglers"]["slowdown_per_partition"]],
                "sync_time_to_target_s": t_sync,
                "fedbuff_time_to_target_s": t_buff,
                "speedup": t_sync / t_buff if t_sync and t_buff else None,
                "sync_final_accuracy": sync["final_accuracy"],
                "fedbuff_final_accuracy": fedbuff["final_accuracy"],
                "sync_rounds": sync["rounds_completed"],
                "fedbuff_versions": fedbuff["rounds_completed"],
                "fedbuff_discarded_stale": fedbuff["fedbuff"]["discarded_stale"],
                "budget_s": budget,
                "sync_run": sync["run_dir"],
                "fedbuff_run": fedbuff["run_dir"],
                "sync_curve": curve(sync["run_dir"]),
                "fedbuff_curve": curve(fedbuff["run_dir"]),
            }
            results.append(row)
            print(
                f"{setting:>18} seed {seed}: to {args.target:.0%}: sync {t_sync or float('nan'):6.1f} s, "
                f"FedBuff {t_buff or float('nan'):6.1f} s -> {row['speedup'] or float('nan'):.2f}x; final accuracy "
                f"sync {sync['final_accuracy']:.4f} ({sync['rounds_completed']} rounds), FedBuff "
                f"{fedbuff['final_accuracy']:.4f} ({fedbuff['rounds_completed']} versions) "
                f"[{time.time() - t0:.0f} s]",
                flush=True,
            )

    print(
        f"\n| setting | seeds | sync to {args.target:.0%} (s) | FedBuff to {args.target:.0%} (s) | speedup | final sync | final FedBuff |"
    )
    print("|---|---|---|---|---|---|---|")
    for setting in SETTINGS:
        rows = [r for r in results if r["setting"] == setting]
        speedups = [r["speedup"] for r in rows if r["speedup"]]

        def mean(key: str, rows: list[dict] = rows) -> float:
            values = [r[key] for r in rows if r[key] is not None]
            return statistics.mean(values) if values else float("nan")

        print(
            f"| {setting} | {len(rows)} | {mean('sync_time_to_target_s'):.1f} | {mean('fedbuff_time_to_target_s'):.1f} "
            f"| {statistics.mean(speedups) if speedups else float('nan'):.2f}x "
            f"(min {min(speedups) if speedups else float('nan'):.2f}x) | {mean('sync_final_accuracy'):.4f} "
            f"| {mean('fedbuff_final_accuracy'):.4f} |"
        )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": cpu_model(), "target": args.target, "nodes": args.nodes, "runs": results}, indent=2)
        + "\n"
    )
    plot(results, args.plot, args.target)
    print(f"wrote {args.out} and {args.plot}")


def plot(results: list[dict], path: Path, target: float) -> None:
    """Accuracy over wall-clock time of each setting's first seed, sync and FedBuff overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first: dict[str, dict] = {}
    for r in results:
        first.setdefault(r["setting"], r)
    fig, axes = plt.subplots(1, len(first), figsize=(6 * len(first), 4.2), squeeze=False)
    for ax, (setting, r) in zip(axes[0], first.items(), strict=True):
        runs = [("sync FedAvg", Path(r["sync_run"])), ("FedBuff", Path(r["fedbuff_run"]))]
        draw_curves(ax, runs, "time", title=f"{setting} (seed {r['seed']})", target=target)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
