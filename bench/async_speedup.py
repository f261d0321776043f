"""Time to a target accuracy in simulated time: sync FedAvg vs FedBuff vs FedBuff with a robust
buffer, through Flower's simulation engine (`flwr run`) with fleet profiles on a virtual clock.

    python bench/async_speedup.py                                  # 10 nodes, every setting, seed 42
    python bench/async_speedup.py --nodes 10 100 --seeds 42 43 44
    python bench/async_speedup.py --host-check                    # + 100 nodes x 50 versions, fleet vs none

Every run is a real `flwr run` (app/tools/sweep.py's run_in_simulation: a local SuperLink in
simulation mode, the installed environment) on the default task. Per node count, setting and
seed, sync FedAvg runs `--rounds` rounds; FedBuff and FedBuff with a median buffer then get
the simulated time sync took (`federation.max_wall_time_s`, simulated seconds on a virtual
clock), or `--max-versions` versions if that comes first (a fleet with a CPU node gives the fast
nodes thousands of tasks in the time of 12 sync rounds). Runs already completed in `--runs` are
read, not run again. Time to target is the simulated time of the first central evaluation at or above
`--target`; host time is the ServerApp's wall time on this machine (without Flower's start-up).

With --stop-at-target every run stops at the target instead (large fleets, where FedBuff's
share of the budget would be thousands of tasks): the times to target compare, the final
accuracies do not.

Settings (conf/fleet/): "3 nodes 5x slower" (fleet=fixed), "lognormal sigma=1" (fleet=lognormal),
and a mixed device-class fleet with wide-area links (fleet=devices).

`--host-check` also runs 100 nodes x 50 FedBuff versions with fleet=lognormal and with fleet=none,
side by side, and prints the ratio of their host times, overall and per task sent (the virtual
clock must not cost time). With `--nodes` and no count it runs only the check and renews the
`host_check` entry of `--out`, keeping the runs recorded there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_model  # noqa: E402

from app.run.results import clock_s, read_rows, read_summary  # noqa: E402
from app.tools.compare_runs import draw_curves  # noqa: E402
from app.tools.sweep import run_in_simulation  # noqa: E402

SETTINGS = {
    "3 nodes 5x slower": "fleet=fixed",
    "lognormal sigma=1": "fleet=lognormal",
    "devices + WAN": "fleet=devices",
}
STRATEGIES = {
    "sync FedAvg": "",
    "FedBuff": "strategy=fedbuff strategy.buffer_size=10 federation.eval_every=2",  # K of docs/benchmarks.md's tables
    "FedBuff, median buffer": "strategy=fedbuff strategy.buffer_aggregator=median strategy.buffer_size=5 "
    "federation.eval_every=2",
}


def flwr_run(name: str, overrides: str, root: Path, nodes: int) -> dict:
    """One `flwr run` in simulation (or, when `root` already holds it completed, that run again):
    its summary, the host seconds its ServerApp ran (summary.json's wall time, without Flower's
    start-up) and its run directory."""
    run_dir = root / "runs" / name
    summary = read_summary(run_dir)
    if not summary or summary.get("status") != "completed":
        shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run starts again from scratch
        job = root / "jobs" / name
        job.mkdir(parents=True, exist_ok=True)
        fed = f"num-supernodes={nodes} client-resources-num-cpus=1"
        result = run_in_simulation(job, root / "runs", [f"name={name}", *overrides.split()], fed, 0)
        if result["error"]:
            raise RuntimeError(f"{name}: {result['error']} (log: {job / 'flwr.log'})")
        summary = read_summary(run_dir)
    return {"summary": summary, "host_s": summary["wall_time_s"], "run_dir": str(run_dir)}


def time_to(target: float, run_dir: str) -> float | None:
    return next((clock_s(r) for r in read_rows(Path(run_dir)) if (r.get("accuracy") or 0) >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="*", default=[10], help="node counts (none: only --host-check)")
    parser.add_argument("--rounds", type=int, default=12, help="sync FedAvg rounds (sets the simulated-time budget)")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument(
        "--max-versions",
        type=int,
        default=100,
        help="FedBuff stops at the simulated budget or after this many versions, whichever is first",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--host-check", action="store_true", help="100 nodes x 50 versions, fleet vs none")
    parser.add_argument(
        "--stop-at-target",
        action="store_true",
        help="every run stops at --target (federation.target_value): time to target only, for large fleets",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/async-results.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/async.png"))
    parser.add_argument("--runs", type=Path, default=None, help="keep run directories here (default: a temp dir)")
    args = parser.parse_args()
    root = args.runs or Path(tempfile.mkdtemp(prefix="async-bench-"))
    print(f"machine: {cpu_model()}; target accuracy {args.target}; runs in {root}", flush=True)

    results = []
    for nodes in args.nodes:
        for setting in args.settings:
            for seed in args.seeds:
                common = f"seed={seed} {SETTINGS[setting]}"
                if args.stop_at_target:
                    common += f" federation.target_value={args.target}"
                tag = f"n{nodes}-{SETTINGS[setting].split('=')[1]}-s{seed}"
                sync = flwr_run(f"{tag}-sync", f"federation.rounds={args.rounds} {common}", root, nodes)
                budget = clock_s(read_rows(Path(sync["run_dir"]))[-1])
                row = {"nodes": nodes, "setting": setting, "seed": seed, "budget_sim_s": budget, "runs": {}}
                for label, overrides in STRATEGIES.items():
                    out = (
                        sync
                        if not overrides
                        else flwr_run(
                            f"{tag}-{label.split(',')[0].replace(' ', '').lower()}{'-robust' if ',' in label else ''}",
                            f"{overrides} federation.rounds={args.max_versions} federation.max_wall_time_s={budget:.3f} {common}",
                            root,
                            nodes,
                        )
                    )
                    s = out["summary"]
                    row["runs"][label] = {
                        "time_to_target_sim_s": time_to(args.target, out["run_dir"]),
                        "final_accuracy": s["final_accuracy"],
                        "steps": s["rounds_completed"],
                        "host_s": round(out["host_s"], 1),
                        "run_dir": out["run_dir"],
                    }
                sync_t = row["runs"]["sync FedAvg"]["time_to_target_sim_s"]
                for r in row["runs"].values():
                    t = r["time_to_target_sim_s"]
                    r["speedup"] = sync_t / t if sync_t and t else None
                results.append(row)
                print(
                    f"{nodes:>4} nodes {setting:>18} seed {seed}: "
                    + "; ".join(
                        f"{label} {_f(r['time_to_target_sim_s'])} s sim ({_f(r['speedup'], 2)}x), final "
                        f"{r['final_accuracy']:.4f}, {r['steps']} steps, host {r['host_s']:.0f} s"
                        for label, r in row["runs"].items()
                    ),
                    flush=True,
                )

    host = host_check(root) if args.host_check else None
    table(results, args.target)
    if host:
        print(
            f"\n100 nodes x 50 FedBuff versions: host {host['fleet_host_s']:.0f} s with fleet=lognormal, "
            f"{host['none_host_s']:.0f} s with fleet=none: ratio {host['ratio']:.2f} "
            f"({host['fleet_tasks_sent']} and {host['none_tasks_sent']} tasks sent: per task {host['ratio_per_task']:.2f})"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not results and args.out.exists():  # --nodes --host-check: keep the file's runs, renew the check
        payload = {**json.loads(args.out.read_text()), "host_check": host}
    else:
        payload = {
            "machine": cpu_model(),
            "target": args.target,
            "rounds": args.rounds,
            "stop_at_target": args.stop_at_target,
            "runs": results,
            "host_check": host,
        }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    if results:
        plot(results, args.plot, args.target)
    print(f"wrote {args.out}" + (f" and {args.plot}" if results else ""))


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def host_check(root: Path) -> dict:
    """The same 100-node, 50-version FedBuff run with and without a fleet profile."""
    common = (
        "strategy=fedbuff strategy.buffer_size=10 federation.rounds=50 federation.eval_every=10 train.epochs=1 seed=42"
    )
    fleet = flwr_run("host-fleet", f"{common} fleet=lognormal", root, 100)
    none = flwr_run("host-none", f"{common} fleet=none", root, 100)
    return {
        "fleet_host_s": round(fleet["host_s"], 1),
        "none_host_s": round(none["host_s"], 1),
        "ratio": fleet["host_s"] / none["host_s"],
        # A fleet's slow nodes send stale updates that FedBuff discards: 50 versions take more
        # tasks than without one. Host time per task is the clock's own cost.
        "ratio_per_task": (fleet["host_s"] / fleet["summary"]["fedbuff"]["tasks_sent"])
        / (none["host_s"] / none["summary"]["fedbuff"]["tasks_sent"]),
        "fleet_versions": fleet["summary"]["rounds_completed"],
        "none_versions": none["summary"]["rounds_completed"],
        "fleet_tasks_sent": fleet["summary"]["fedbuff"]["tasks_sent"],
        "none_tasks_sent": none["summary"]["fedbuff"]["tasks_sent"],
    }


def table(results: list[dict], target: float) -> None:
    print(
        f"\n| nodes | setting | seeds | strategy | to {target:.0%} (simulated s) | speedup | final accuracy | host s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for nodes in dict.fromkeys(r["nodes"] for r in results):
        for setting in dict.fromkeys(r["setting"] for r in results):
            rows = [r for r in results if r["nodes"] == nodes and r["setting"] == setting]
            if not rows:
                continue
            for label in STRATEGIES:
                runs = [r["runs"][label] for r in rows]

                def mean(key: str, runs: list[dict] = runs) -> float | None:
                    values = [r[key] for r in runs if r[key] is not None]
                    return statistics.mean(values) if values else None

                speedups = [r["speedup"] for r in runs if r["speedup"]]
                reached = sum(r["time_to_target_sim_s"] is not None for r in runs)
                print(
                    f"| {nodes} | {setting} | {len(rows)} | {label} | {_f(mean('time_to_target_sim_s'))} "
                    f"({reached}/{len(runs)} reached) | {_f(mean('speedup'), 2)}x"
                    f"{f' (min {min(speedups):.2f}x)' if len(speedups) > 1 else ''} | "
                    f"{_f(mean('final_accuracy'), 4)} | {_f(mean('host_s'), 0)} |"
                )


def plot(results: list[dict], path: Path, target: float) -> None:
    """Accuracy over simulated time of each setting's first run, the three strategies overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    first: dict[tuple[int, str], dict] = {}
    for r in results:
        first.setdefault((r["nodes"], r["setting"]), r)
    fig, axes = plt.subplots(1, len(first), figsize=(5.5 * len(first), 4.2), squeeze=False)
    for ax, ((nodes, setting), r) in zip(axes[0], first.items(), strict=True):
        runs = [(label, Path(run["run_dir"])) for label, run in r["runs"].items()]
        draw_curves(ax, runs, "time", title=f"{setting}, {nodes} nodes (seed {r['seed']})", target=target)
        ends = [clock_s(rows[-1]) for _, run_dir in runs if (rows := read_rows(run_dir))]
        if ends and min(ends) > 0 and max(ends) / min(ends) > 20:  # FedBuff's curves would sit on the axis
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
