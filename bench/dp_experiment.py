"""Accuracy vs privacy: central DP (several noise multipliers) and local DP-SGD,
next to the non-private runs, on the default digits data.

    python bench/dp_experiment.py                   # both groups, about 8 min on 2 cores
    python bench/dp_experiment.py --groups central  # one group

Client-level (central) DP needs many clients: the noise on the mean update has std
z·C/m per coordinate, so the central group uses 100 nodes (about 14 examples each) and
a 16-wide CNN (25k parameters) for 30 rounds, all nodes every round (q = 1), plus one
Poisson-sampled run (q = 0.2) to show what subsampling amplification buys and one
fixed-size cohort of 20 (q = 1, sensitivity 2C: one client can push another out) to
show what it costs when the cohort is not Poisson. Local
DP-SGD needs enough examples per client for a batch to be a sample, so the local group
uses 10 nodes (about 130 examples each) and the default settings (10 rounds). Runs use
the real ServerApp loop and ClientApp through the in-process grid. ε is what the run
reports: the central accountant's ε at δ = 1e-5 (client level), or the largest
per-client ε (sample level, local DP).

Writes a Markdown table to stdout and `--json` / `--plot` (defaults under docs/).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from app.run.results import read_rows  # noqa: E402
from app.tools.in_process import run_in_process  # noqa: E402

CENTRAL = "model.width=16 federation.rounds=30"  # privacy=central* clips at 1.0
GROUPS = {
    "central": (
        100,
        [
            ("non-private", f"{CENTRAL}"),
            ("central z=0.5", f"{CENTRAL} privacy=central privacy.noise_multiplier=0.5"),
            ("central z=1", f"{CENTRAL} privacy=central privacy.noise_multiplier=1.0"),
            ("central z=2", f"{CENTRAL} privacy=central privacy.noise_multiplier=2.0"),
            (
                "central z=1, Poisson q=0.2",
                f"{CENTRAL} privacy=central privacy.noise_multiplier=1.0 privacy.poisson_sampling=true "
                "federation.fraction_train=0.2",
            ),
            (
                "central z=1, fixed 20 of 100",
                f"{CENTRAL} privacy=central privacy.noise_multiplier=1.0 federation.fraction_train=0.2",
            ),
        ],
    ),
    "local": (
        10,
        [
            ("non-private", ""),
            ("local z=0.3", "privacy=local privacy.noise_multiplier=0.3"),
            ("local z=0.5", "privacy=local privacy.noise_multiplier=0.5"),
            ("local z=1", "privacy=local privacy.noise_multiplier=1.0"),
        ],
    ),
}


def run(label: str, overrides: str, nodes: int, seed: int, root: Path) -> dict:
    started = time.time()
    summary, _ = run_in_process(f"{overrides} seed={seed}", root, nodes=nodes)
    privacy = summary["privacy"]
    epsilon = privacy.get("epsilon", privacy.get("client_epsilon_max"))
    curve = [row["accuracy"] for row in read_rows(Path(summary["run_dir"]))]
    return {
        "label": label,
        "nodes": nodes,
        "seed": seed,
        "overrides": overrides,
        "final_accuracy": summary["final_accuracy"],
        "epsilon": epsilon,
        "delta": privacy.get("delta"),
        "privacy": privacy,
        "rounds": summary["rounds_completed"],
        "wall_time_s": time.time() - started,
        "curve": curve,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, default=Path("docs/dp-results.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/dp.png"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="dp-experiment-"))
    logging.getLogger("flwr").setLevel(logging.WARNING)  # after the imports: flwr sets it on import

    results = []
    for group in args.groups:
        nodes, configs = GROUPS[group]
        for label, overrides in configs:
            r = run(label, overrides, nodes, args.seed, root)
            r["group"] = group
            results.append(r)
            eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
            print(
                f"{group:>7} {label:<28} accuracy {r['final_accuracy']:.4f}  epsilon {eps}  [{r['wall_time_s']:.0f} s]",
                flush=True,
            )

    print("\n| group | nodes | run | epsilon (delta = 1e-5) | final accuracy |")
    print("|---|---|---|---|---|")
    for r in results:
        eps = "∞ (no DP)" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        print(f"| {r['group']} | {r['nodes']} | {r['label']} | {eps} | {100 * r['final_accuracy']:.2f}% |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"seed": args.seed, "runs": results}, indent=2) + "\n")
    plot(results, args.plot)
    print(f"wrote {args.json} and {args.plot}")


def plot(results: list[dict], path: Path) -> None:
    """Final accuracy against epsilon (log scale) per group; non-private runs as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({r["group"] for r in results}, key=list(GROUPS).index)
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.2), squeeze=False)
    for ax, group in zip(axes[0], groups, strict=True):
        runs = [r for r in results if r["group"] == group]
        for r in runs:
            if r["epsilon"] is None:
                ax.axhline(r["final_accuracy"], color="grey", linestyle="--", label=f"{r['label']}")
            else:
                ax.scatter(r["epsilon"], r["final_accuracy"], s=40)
                ax.annotate(r["label"], (r["epsilon"], r["final_accuracy"]), textcoords="offset points", xytext=(5, 5))
        finite = [r["epsilon"] for r in runs if r["epsilon"] is not None and math.isfinite(r["epsilon"])]
        if finite:
            ax.set_xscale("log")
        kind = "client-level ε (central accountant)" if group == "central" else "largest per-client sample-level ε"
        ax.set(xlabel=kind, ylabel="final test accuracy", title=f"{group} DP, {runs[0]['nodes']} nodes", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
