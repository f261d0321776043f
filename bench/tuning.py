"""An Optuna study against a grid with the same number of federations (issue 38): FedProx + FedAdam
(`strategy.proximal_mu`, `strategy.server_lr`) on digits split Dirichlet alpha 0.1 over 10 nodes.

    python bench/tuning.py --runs /tmp/tuning --json docs/tuning-benchmark.json
    python bench/tuning.py --points 2 --rounds 5 --runs /tmp/tuning-quick      # quick

Both arms are `python -m app.sweep --multirun` through `flwr run`, as a user runs them: the grid
(the basic sweeper) over `--points` log-spaced values of each key, and the study
(`hydra/sweeper=optuna`, TPE, median pruner) with as many trials as the grid has points, over the
same ranges as log-uniform intervals. Reported: each arm's best final accuracy and its settings,
the federation-rounds each spent (a pruned trial stops early) and the wall time. Both arms' sweep
directories stay under `--runs`, and running the command again continues them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.tools.sweep import read_job  # noqa: E402
from bench.machine import cpu_model  # noqa: E402

RANGES = {"strategy.proximal_mu": (0.001, 0.1), "strategy.server_lr": (0.003, 0.1)}


def grid_values(low: float, high: float, points: int) -> list[float]:
    """`points` log-spaced values from low to high, rounded to 3 significant digits."""
    if points == 1:
        return [float(f"{(low * high) ** 0.5:.3g}")]
    return [float(f"{low * (high / low) ** (i / (points - 1)):.3g}") for i in range(points)]


def sweep(args: argparse.Namespace, name: str, extra: list[str]) -> tuple[Path, float]:
    """One `python -m app.sweep --multirun` (both arms share the fixed overrides); its directory and seconds."""
    fixed = [
        "strategy=fedavg", "strategy.server_optimizer=adam", "train.lr_schedule=constant",
        "partition=dirichlet", f"partition.alpha={args.alpha}", f"seed={args.seed}",
        f"federation.rounds={args.rounds}", f"simulation.num_supernodes={args.nodes}", "ledger=off",
    ]  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "app.sweep",
        "--multirun",
        *fixed,
        *extra,
        f"sweep.root={args.runs}",
        f"sweep.name={name}",
    ]
    print(" ".join(cmd), flush=True)
    started = time.monotonic()
    env = {**os.environ, "FEDGPU_FLWR_HOME_ROOT": str(args.runs / "homes")}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return args.runs / name, time.monotonic() - started


def arm(sweep_dir: Path, seconds: float) -> dict[str, Any]:
    """An arm's jobs: the best completed one's final accuracy and settings, rounds spent, states."""
    jobs = [read_job(p.parent) for p in sweep_dir.glob("*/job.json")]
    rounds = []
    for job in jobs:
        rows = (Path(job["job_dir"]) / "metrics.jsonl").read_text().splitlines() if job.get("job_dir") else []
        rounds.append(sum(1 for line in rows if json.loads(line).get("round", 0) >= 1))
    done = [j for j in jobs if j.get("status") == "completed"]
    best = max(done, key=lambda j: j["final_metric"]) if done else None
    keys = tuple(RANGES)
    return {
        "federations": len(jobs),
        "completed": len(done),
        "pruned": sum(j.get("status") == "pruned" for j in jobs),
        "failed": sum(j.get("status") == "failed" for j in jobs),
        "rounds_spent": sum(rounds),
        "wall_s": round(seconds, 1),
        "best_final": best["final_metric"] if best else None,
        "best_settings": {o.split("=")[0]: float(o.split("=")[1]) for o in best["overrides"] if o.split("=")[0] in keys}
        if best
        else None,
        "finals": sorted((j["final_metric"] for j in done), reverse=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=3, help="grid values per key (the study gets points**2 trials)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--runs", type=Path, required=True, help="sweep directories go here (outside the app)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.runs = args.runs.expanduser().resolve()
    trials = args.points ** len(RANGES)
    grid = [f"{k}={','.join(str(v) for v in grid_values(lo, hi, args.points))}" for k, (lo, hi) in RANGES.items()]
    space = [f"{k}=tag(log, interval({lo}, {hi}))" for k, (lo, hi) in RANGES.items()]
    study = ["hydra/sweeper=optuna", f"hydra.sweeper.n_trials={trials}", "hydra.sweeper.warmup_rounds=5", *space]
    grid_dir, grid_s = sweep(args, "grid", grid)
    study_dir, study_s = sweep(args, "study", study)
    results = {"grid": arm(grid_dir, grid_s), "study": arm(study_dir, study_s)}
    for name, r in results.items():
        print(
            f"{name}: {r['federations']} federations ({r['completed']} completed, {r['pruned']} pruned, "
            f"{r['failed']} failed), {r['rounds_spent']} rounds, {r['wall_s']:.0f} s; best final "
            f"{r['best_final']} with {r['best_settings']}",
            flush=True,
        )
    if args.json:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        payload = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
            "app": head,
            "settings": {k: v for k, v in vars(args).items() if k not in ("runs", "json")},
            "grid": grid,
            "space": space,
            "results": results,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
