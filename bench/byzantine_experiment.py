"""Byzantine robustness experiment: every strategy under every attack, on the default data.

10 nodes on scikit-learn digits (IID), 2 of them malicious, for each attack type the
final test accuracy of FedAvg and of every robust rule in strategies/registry.py (Krum,
Multi-Krum, median, trimmed mean, ...), each tolerating f = 2, next to clean FedAvg (a rule
that needs more nodes for f = 2 is named and left out: Bulyan needs `--nodes 11`); averaged over seeds, since one seed's last round can be an outlier
(Krum adopts a single client's model each round). Runs use the real ServerApp round
loop and ClientApp through the in-process grid (`app/tools/in_process.py`): the same
code as under `flwr run`, without the SuperLink's start-up cost per run.

    python bench/byzantine_experiment.py                  # 90 runs, about 40 min on 2 cores
    python bench/byzantine_experiment.py --rounds 10 --attacks none sign_flip
    python bench/byzantine_experiment.py --merge --strategies multikrum   # re-run one column

Writes a Markdown table to stdout, and `--json` / `--plot` files (defaults under docs/).
`--merge` re-runs only the chosen cells and keeps the other cells of an existing
`--json` file (same rounds, nodes and seeds), so a change to one rule costs its cells only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# Run as a script, bench/ comes first on sys.path: put this checkout's root ahead of any
# installed copy of `app` (an editable install of another clone would otherwise win).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config.schema import ATTACKS, ROBUST_RULES  # noqa: E402  # dependency-free: the parent stays light

F = 2  # the Byzantine clients every robust rule tolerates here: the attack's 2 malicious nodes
# This experiment's own settings of some rules (defaults otherwise); every registered rule is a column.
RULE_SETTINGS = {"multikrum": "strategy.num_selected=6", "trimmed_mean": "strategy.trim_ratio=0.2"}
STRATEGIES = {
    "fedavg": "strategy=fedavg",
    **{r: f"strategy={r} strategy.num_byzantine={F} {RULE_SETTINGS.get(r, '')}".strip() for r in ROBUST_RULES},
}


def unrunnable(strategies: list[str], nodes: int) -> dict[str, str]:
    """The chosen rules that cannot tolerate F Byzantine clients among `nodes` (Bulyan needs
    n >= 4F + 3 = 11), with why: left out of the grid, named, instead of failing mid-grid."""
    from strategies.registry import rule_class  # loads torch: only once the arguments are known

    return {s: p for s in strategies if s in ROBUST_RULES and (p := rule_class(s)(num_byzantine=F).too_few(nodes))}


def run_one(job: tuple[str, str, int, int, int, str]) -> dict:
    """One federation in a worker process (one torch thread each)."""
    strategy, attack, rounds, nodes, seed, out_root = job
    import torch

    from app.run.results import read_rows
    from app.tools.in_process import run_in_process

    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)  # after the imports: flwr sets it on import

    attack_overrides = f"attack={attack}" + ("" if attack == "none" else " attack.num_malicious=2")
    overrides = f"{STRATEGIES[strategy]} {attack_overrides} federation.rounds={rounds} seed={seed} name={strategy}-{attack}-{seed}"
    started = time.time()
    summary, _ = run_in_process(overrides, out_root, nodes=nodes)
    curve = [row["accuracy"] for row in read_rows(Path(summary["run_dir"]))]
    return {
        "strategy": strategy,
        "attack": attack,
        "seed": seed,
        "final_accuracy": summary["final_accuracy"],
        "best_accuracy": summary["best_accuracy"],
        "malicious_partitions": summary["attack"]["malicious_partitions"],
        "curve": curve,
        "seconds": time.time() - started,
    }


def by_cell(results: list[dict]) -> dict[tuple[str, str], list[dict]]:
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        cells.setdefault((r["strategy"], r["attack"]), []).append(r)
    return cells


def final_accuracies(runs: list[dict]) -> list[float]:
    return [100 * r["final_accuracy"] for r in runs]


def markdown_table(results: list[dict], attacks: list[str], strategies: list[str]) -> str:
    """Mean final accuracy over seeds, with the lowest seed in brackets ("–": not run)."""
    cells = by_cell(results)
    lines = ["| attack | " + " | ".join(strategies) + " |", "|---|" + "---:|" * len(strategies)]
    for attack in attacks:
        row = []
        for s in strategies:
            accs = final_accuracies(cells.get((s, attack), []))
            row.append(f"{sum(accs) / len(accs):.1f} ({min(accs):.1f})" if accs else "–")
        lines.append(f"| {attack} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results: list[dict], attacks: list[str], strategies: list[str], path: Path, nodes: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = by_cell(results)
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(strategies)
    x = np.arange(len(attacks))
    for i, s in enumerate(strategies):
        accs = [final_accuracies(cells.get((s, a), [])) or [np.nan] for a in attacks]
        means = np.array([np.mean(a) for a in accs])
        spread = np.array([[m - min(a), max(a) - m] for m, a in zip(means, accs, strict=True)]).T
        bars.bar(x + i * width, means, width, yerr=spread, capsize=2, label=s)
    if ("fedavg", "none") in cells:  # the reference line needs the clean FedAvg cell
        clean = np.mean(final_accuracies(cells[("fedavg", "none")]))
        bars.axhline(clean, color="black", lw=0.8, ls="--", label="clean FedAvg")
    bars.set_xticks(x + width * (len(strategies) - 1) / 2, attacks)
    bars.set(
        ylabel="final test accuracy (%), mean and range over seeds",
        ylim=(0, 100),
        title=f"2 of {nodes} nodes malicious",
    )
    bars.legend(fontsize=8, loc="lower left")
    attack = "sign_flip" if "sign_flip" in attacks else attacks[-1]
    for s in strategies:
        curve = cells[(s, attack)][0]["curve"]
        curves.plot(range(1, len(curve) + 1), [100 * a for a in curve], label=s)
    seed = cells[(strategies[0], attack)][0]["seed"]
    curves.set(xlabel="round", ylabel="test accuracy (%)", ylim=(0, 100), title=f"under {attack} (seed {seed})")
    curves.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def save(args: argparse.Namespace, results: list[dict]) -> list[dict]:
    """Write `results` to --json (with --merge: and the file's runs that `results` does not
    redo, read now, as another merge may have written meanwhile); returns all written."""
    if args.merge:
        old = json.loads(args.json.read_text())["results"]
        redone = {(r["strategy"], r["attack"], r["seed"]) for r in results}
        results = results + [r for r in old if (r["strategy"], r["attack"], r["seed"]) not in redone]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"rounds": args.rounds, "nodes": args.nodes, "seeds": args.seeds, "results": results}, indent=1)
    )
    tmp.replace(args.json)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, default=Path("docs/byzantine-results.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/byzantine.png"))
    parser.add_argument("--merge", action="store_true", help="keep the --json file's other cells")
    args = parser.parse_args()
    for strategy, problem in unrunnable(args.strategies, args.nodes).items():
        print(f"{strategy}: left out with --nodes {args.nodes}: {problem}", flush=True)
        args.strategies.remove(strategy)
    if args.merge:
        old = json.loads(args.json.read_text())
        if (old["rounds"], old["nodes"], old["seeds"]) != (args.rounds, args.nodes, args.seeds):
            parser.error(f"--merge: {args.json} has rounds/nodes/seeds {old['rounds']}/{old['nodes']}/{old['seeds']}")
    with tempfile.TemporaryDirectory() as out_root:
        jobs = [
            (s, a, args.rounds, args.nodes, seed, out_root)
            for seed in args.seeds
            for a in args.attacks
            for s in args.strategies
        ]
        started = time.time()
        results: list[dict] = []
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            for result in pool.map(run_one, jobs):
                results.append(result)
                print(
                    f"seed {result['seed']} {result['attack']:>10} {result['strategy']:>12}: "
                    f"{100 * result['final_accuracy']:5.1f}% ({result['seconds']:.0f} s, "
                    f"{len(results)}/{len(jobs)} done)",
                    flush=True,
                )
                save(args, results)  # every finished run is kept, should the grid be stopped
    print(
        f"\n{len(results)} runs, {args.nodes} nodes, {args.rounds} rounds, seeds {args.seeds}, {time.time() - started:.0f} s"
    )
    results = save(args, results)
    cells = by_cell(results)
    attacks = [a for a in ATTACKS if any(k[1] == a for k in cells)]
    strategies = [s for s in STRATEGIES if any(k[0] == s for k in cells)]
    print("final test accuracy (%): mean over seeds (lowest seed)\n")
    print(markdown_table(results, attacks, strategies))
    plot(results, attacks, strategies, args.plot, args.nodes)
    print(f"\nwrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
