"""Hierarchical aggregation over slow WAN links (issue 37): `topology=flat` against
`topology=regions` through `flwr run`, on the devices+WAN fleet profile (conf/fleet/devices_wan.yaml).

    python bench/hierarchy.py                                        # 100 nodes, 5 regions, every variant
    python bench/hierarchy.py --nodes 20 --rounds 3 --variants flat regions   # quick
    python bench/hierarchy.py --runs /tmp/hier --json docs/hierarchy-benchmark.json \\
        --plot docs/hierarchy.png                                    # the committed result

Variants, each a whole federation through `flwr run` (app/tools/sweep.py's run_in_simulation: a
local SuperLink in simulation mode, the installed environment), default task (digits, small CNN,
default recipe), the same seed, `--nodes` nodes all training every round
(`client-resources-num-cpus=1`), `--rounds` synchronous rounds, central evaluation every round:

- `flat`: `fleet=devices_wan topology=flat topology.regions=R`: every site talks to the server
  itself, through its fair share of its region's one WAN link (app/simulation/fleet.py `shared_wan`);
- `regions`: `topology=regions topology.regions=R`: each region's aggregator combines its members
  (sample-weighted mean) and one update per region crosses the WAN link (strategies/regional.py);
- `regions+int8`: the same with `topology.wan_compression=int8` on the WAN leg (error feedback);
- `regions+fedbuff`: FedBuff at the top (`strategy=fedbuff`: the regions are its asynchronous units,
  app/regions/grid.py; buffer and concurrency at their defaults), given `--fedbuff-versions`
  versions and at most the flat run's simulated time (`federation.max_wall_time_s`). A variant the
  config validation refuses (ConfigError) is recorded as "refused: <the message>", not run.

Reported per variant, from the runs' metrics.jsonl rows (app/run/results.py): WAN bytes per round
(the rows' `wan_bytes`: every task and reply crossing a WAN link under flat, one model copy down and
one update up per region under regions; mean over the rounds) and flat/variant; the simulated time
(virtual clock, `sim_time_s`) of the first central evaluation at or above `--target` and
flat/variant; the WAN bytes spent until then and flat/variant (FedBuff's rows are versions, not
rounds: this is the figure that compares it); the final central accuracy and its difference from flat in points; host time (the
ServerApp's wall time from summary.json, and the whole `flwr run` with Flower's start-up).

Goals (issue 37), regions against flat: WAN bytes per round at least 10x fewer (about the members
per region), the target reached at least 3x sooner in simulated time, final accuracy within 0.5
points. The simulated times follow from the profile's assumptions (device speeds, the
1 Gbit/s links inside a region, one 50/20 Mbit/s WAN egress per region, latencies), not from this
host: docs/benchmarks.md#regions-hierarchical-aggregation-over-slow-wan-links states them.

Every variant runs one copy of the app, taken under `--runs` when the benchmark starts: the
working tree's (tracked and untracked-but-not-ignored files, bench/flwr_runs.py `app_copy`), or
with `--commit REV` the app as committed at REV (a `git archive` of app/, strategies/, conf/,
pyproject.toml and README.md); edits made to the tree meanwhile do not reach the later runs. The
JSON records which. Runs already completed in `--runs` are read again, not rerun.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's `app`, ahead of any installed copy

from app.config.compose import load_config  # noqa: E402
from app.config.schema import ConfigError  # noqa: E402
from app.run.results import clock_s, read_rows, read_summary  # noqa: E402
from app.tools.sweep import run_in_simulation  # noqa: E402
from bench.flwr_runs import app_copy  # noqa: E402
from bench.machine import cpu_model  # noqa: E402

VARIANTS: dict[str, str] = {
    "flat": "fleet=devices_wan topology=flat topology.regions={regions}",
    "regions": "fleet=devices_wan topology=regions topology.regions={regions}",
    "regions+int8": "fleet=devices_wan topology=regions topology.regions={regions} topology.wan_compression=int8",
    "regions+fedbuff": "fleet=devices_wan topology=regions topology.regions={regions} strategy=fedbuff",
}
GOAL_WAN_RATIO = 10.0  # flat's WAN bytes per round / regions' (about the members per region)
GOAL_TIME_RATIO = 3.0  # flat's simulated time to target / regions'
GOAL_ACCURACY_POINTS = 0.5
LEVELS = (0.8, 0.9, 0.95)  # the JSON also records the simulated time to each of these accuracies


def app_at(commit: str, root: Path) -> tuple[Path, str]:
    """The app as committed at `commit` (what `flwr run` packs: app/, strategies/, conf/,
    pyproject.toml, README.md), extracted under `root`; and the commit's full hash."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    out = root / f"app-{sha[:10]}"
    if not (out / "pyproject.toml").is_file():
        tar = subprocess.run(
            ["git", "archive", "--format=tar", sha, "app", "strategies", "conf", "pyproject.toml", "README.md"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
            archive.extractall(out, filter="data")
    return out, sha


def working_tree(root: Path) -> tuple[Path, str]:
    """A copy of the working tree's app (tracked and untracked-but-not-ignored files, as `flwr run`
    packs them) under `root`, taken once: edits made while the benchmark runs do not reach its
    later runs. And what it holds: HEAD, plus the files of app/, strategies/ and conf/ that differ."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "app", "strategies", "conf", "pyproject.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    changed = sorted(line[3:] for line in dirty if line.strip())
    out, note = root / "app-working-tree", root / "app-working-tree.txt"
    if not (out / "pyproject.toml").is_file() or not note.is_file():
        shutil.rmtree(out, ignore_errors=True)
        app_copy(root, out.name)
        note.write_text(head + (f" + uncommitted changes to {', '.join(changed)}" if changed else ""))
    return out, note.read_text()


def overrides_of(variant: str, args: argparse.Namespace, budget_s: float | None) -> list[str]:
    fedbuff = variant == "regions+fedbuff"
    out = [
        *VARIANTS[variant].format(regions=args.regions).split(),
        f"seed={args.seed}",
        f"federation.rounds={args.fedbuff_versions if fedbuff else args.rounds}",
    ]
    if fedbuff and budget_s:
        out.append(f"federation.max_wall_time_s={budget_s:.3f}")  # simulated seconds on the virtual clock
    if args.stop_at_target:
        out.append(f"federation.target_value={args.target}")
    return out + args.extra


def refusal(overrides: list[str]) -> str | None:
    """The validation's message when the app refuses this configuration, else None."""
    try:
        load_config(overrides)
    except ConfigError as err:
        return str(err)
    return None


def flwr_run(name: str, overrides: list[str], args: argparse.Namespace, app_dir: Path, code: str) -> dict[str, Any]:
    """One federation through `flwr run`, or the completed one already in `--runs` when the same
    app (`code`) ran it: every variant of a result is measured on one app."""
    run_dir = args.runs / "runs" / name
    bench = args.runs / "jobs" / name / "bench.json"
    summary = read_summary(run_dir)
    done = json.loads(bench.read_text()) if bench.is_file() else {}
    total_s = None
    if not summary or summary.get("status") != "completed" or done.get("app") != code:
        shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run starts again from scratch
        job = args.runs / "jobs" / name
        job.mkdir(parents=True, exist_ok=True)
        fed = f"num-supernodes={args.nodes} client-resources-num-cpus=1"
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        result = run_in_simulation(job, args.runs / "runs", [f"name={name}", *overrides], fed, args.timeout, app_dir)
        total_s = time.monotonic() - started
        if result["error"]:
            raise RuntimeError(f"{name}: {result['error']} (log: {job / 'flwr.log'})")
        summary = read_summary(run_dir)
        record = {"app": code, "flwr_run_s": total_s, "load_average_1min": [load_before, os.getloadavg()[0]]}
        bench.write_text(json.dumps(record) + "\n")
    else:
        total_s = done["flwr_run_s"]
    if summary is None:
        raise RuntimeError(f"{name}: the run wrote no summary.json in {run_dir}")
    return {"summary": summary, "run_dir": run_dir, "flwr_run_s": total_s}


def first_at(rows: list[dict[str, Any]], level: float) -> int | None:
    """The index of the first row whose central accuracy is at or above `level`."""
    return next((i for i, r in enumerate(rows) if (r.get("accuracy") or 0) >= level), None)


def measure(variant: str, out: dict[str, Any], target: float) -> dict[str, Any]:
    """A run's figures from its rows: a row is a round (synchronous) or a version (FedBuff)."""
    rows = [r for r in read_rows(out["run_dir"]) if r.get("round") is not None]
    wan = [r.get("wan_bytes") or 0 for r in rows]
    up: dict[str, list[int]] = {}
    for r in rows:
        for region, entry in (r.get("regions") or {}).items():
            up.setdefault(region, []).append(entry.get("wan_bytes_up") or 0)
    at = first_at(rows, target)
    reached = rows[at] if at is not None else None
    s = out["summary"]
    return {
        "variant": variant,
        "status": "measured",
        "strategy": s.get("strategy"),
        "step": "version" if s.get("strategy") == "fedbuff" else "round",
        "rounds": len(rows),
        "wan_bytes_per_round": sum(wan) / len(wan) if wan else None,
        "wan_bytes_up_per_region_per_round": {k: sum(v) / len(v) for k, v in up.items()} or None,
        "wan_bytes_to_target": sum(wan[: at + 1]) if at is not None else None,
        "wan_bytes_total": sum(wan),
        "time_to_target_sim_s": clock_s(reached) if reached else None,
        "round_at_target": reached["round"] if reached else None,
        "time_to_sim_s": {
            f"{level:g}": (clock_s(rows[i]) if (i := first_at(rows, level)) is not None else None) for level in LEVELS
        },
        "sim_time_per_round_s": clock_s(rows[-1]) / len(rows) if rows else None,
        "sim_time_end_s": clock_s(rows[-1]) if rows else None,
        "final_accuracy": s.get("final_accuracy"),
        "accuracy_by_round": [r.get("accuracy") for r in rows],
        "host_server_s": s.get("wall_time_s"),
        "host_flwr_run_s": out["flwr_run_s"],
        "run_dir": str(out["run_dir"]),
    }


def ratios(results: dict[str, dict[str, Any]]) -> None:
    """Flat / variant for WAN bytes and time to target; accuracy difference in points."""
    flat = results.get("flat")
    for r in results.values():
        if r["status"] != "measured" or not flat or flat["status"] != "measured":
            continue
        fw, vw = flat["wan_bytes_per_round"], r["wan_bytes_per_round"]
        ft, vt = flat["time_to_target_sim_s"], r["time_to_target_sim_s"]
        r["wan_ratio"] = fw / vw if fw and vw else None
        fwt, vwt = flat["wan_bytes_to_target"], r["wan_bytes_to_target"]
        r["wan_to_target_ratio"] = fwt / vwt if fwt and vwt else None
        r["time_ratio"] = ft / vt if ft and vt else None
        fa, va = flat["final_accuracy"], r["final_accuracy"]
        r["accuracy_points"] = 100 * (va - fa) if fa is not None and va is not None else None


def goals(results: dict[str, dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """Each of issue 37's goals for each measured non-flat variant: met or not, and why."""
    out = []
    for name, r in results.items():
        if name == "flat":
            continue
        if r["status"] != "measured":
            out.append({"variant": name, "goal": "all", "met": None, "why": r["status"]})
            continue
        time_ratio, points = r.get("time_ratio"), r.get("accuracy_points")
        if r["step"] == "round":
            wan, why = r.get("wan_ratio"), "per round"
        else:  # a version is not a round: what it took to reach the target
            wan, why = r.get("wan_to_target_ratio"), f"to {target:.0%} (a FedBuff version is not a round)"
        out.append(
            {
                "variant": name,
                "goal": f"WAN bytes per round >= {GOAL_WAN_RATIO:g}x fewer than flat",
                "met": wan is not None and wan >= GOAL_WAN_RATIO,
                "why": "no WAN bytes recorded or target not reached" if wan is None else f"{wan:.1f}x fewer {why}",
            }
        )
        flat_t = results["flat"]["time_to_target_sim_s"]
        why = (
            f"flat never reached {target:.0%}"
            if not flat_t
            else f"{name} never reached {target:.0%}"
            if r["time_to_target_sim_s"] is None
            else f"{time_ratio:.2f}x sooner ({r['time_to_target_sim_s']:.1f} s against {flat_t:.1f} s simulated)"
        )
        out.append(
            {
                "variant": name,
                "goal": f"{target:.0%} reached >= {GOAL_TIME_RATIO:g}x sooner in simulated time",
                "met": time_ratio is not None and time_ratio >= GOAL_TIME_RATIO,
                "why": why,
            }
        )
        out.append(
            {
                "variant": name,
                "goal": f"final accuracy within {GOAL_ACCURACY_POINTS:g} points of flat",
                "met": points is not None and abs(points) <= GOAL_ACCURACY_POINTS,
                "why": "no accuracy" if points is None else f"{points:+.2f} points",
            }
        )
    return out


def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _mb(n: float | None) -> float | None:
    return None if n is None else n / 1e6


def table(results: dict[str, dict[str, Any]], target: float) -> str:
    lines = [
        f"| variant | WAN bytes / round | flat ÷ variant | WAN bytes to {target:.0%} | flat ÷ variant "
        f"| simulated s / round | to {target:.0%} (simulated) | flat ÷ variant | final accuracy | vs flat (points) "
        "| host s (ServerApp / flwr run) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if r["status"] != "measured":
            lines.append(f"| {name} | {r['status']} |||||||||")
            continue
        at = (
            f"{r['time_to_target_sim_s']:.1f} s ({r['step']} {r['round_at_target']})"
            if r["time_to_target_sim_s"] is not None
            else "not reached"
        )
        host = f"{_f(r['host_server_s'], '.0f')} / {_f(r['host_flwr_run_s'], '.0f')}"
        lines.append(
            f"| {name}{' (per version)' if r['step'] == 'version' else ''} "
            f"| {_f(_mb(r['wan_bytes_per_round']), '.2f')} MB | {_f(r.get('wan_ratio'), '.1f')}x "
            f"| {_f(_mb(r['wan_bytes_to_target']), '.1f')} MB | {_f(r.get('wan_to_target_ratio'), '.1f')}x "
            f"| {_f(r['sim_time_per_round_s'], '.2f')} | {at} | {_f(r.get('time_ratio'), '.2f')}x "
            f"| {_f(100 * r['final_accuracy'] if r['final_accuracy'] is not None else None, '.2f')}% "
            f"| {_f(r.get('accuracy_points'), '+.2f')} | {host} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path, target: float, title: str) -> None:
    """Accuracy against simulated time (log axis: the flat run is many times longer) and against
    rounds, every measured variant overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from app.tools.compare_runs import draw_curves

    runs = [(name, Path(r["run_dir"])) for name, r in results.items() if r["status"] == "measured"]
    fig, (ax_time, ax_round) = plt.subplots(1, 2, figsize=(12, 4.4))
    draw_curves(ax_time, runs, "time", title=f"{title}: accuracy over simulated time", target=target)
    ax_time.set_xscale("log")
    ax_time.set_xlabel("simulated time (s, log scale)")
    draw_curves(ax_round, runs, "round", title="accuracy per round", target=target)
    ax_round.set_xlabel("round")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--regions", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument(
        "--fedbuff-versions",
        type=int,
        default=200,
        help="regions+fedbuff: at most this many versions, and at most the flat run's simulated time",
    )
    parser.add_argument("--target", type=float, default=0.9, help="central accuracy the time is measured to")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--stop-at-target", action="store_true", help="stop each run at --target (final accuracies then do not compare)"
    )
    parser.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every variant")
    parser.add_argument("--commit", default=None, help="run the app as committed at this revision (default: the tree)")
    parser.add_argument("--timeout", type=float, default=0, help="seconds per run (0: no limit)")
    parser.add_argument("--runs", type=Path, default=None, help="keep run directories here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    args.runs = (args.runs or Path(tempfile.mkdtemp(prefix="hierarchy-bench-"))).resolve()
    if args.runs == ROOT or ROOT in args.runs.parents:
        parser.error(f"--runs {args.runs} is inside the app directory, which `flwr run` packs")
    app_dir, code = working_tree(args.runs) if args.commit is None else app_at(args.commit, args.runs)
    machine = f"{cpu_model()}, {os.cpu_count()} CPUs"
    print(
        f"machine: {machine}; {args.nodes} nodes in {args.regions} regions, {args.rounds} rounds, seed {args.seed}, "
        f"target {args.target:.0%}; app {code}; runs in {args.runs}",
        flush=True,
    )
    order = ["flat", *(v for v in args.variants if v != "flat")] if "flat" in args.variants else args.variants
    results: dict[str, dict[str, Any]] = {}
    for variant in order:
        budget = (results.get("flat") or {}).get("sim_time_end_s")
        overrides = overrides_of(variant, args, budget)
        if (why := refusal(overrides)) is not None:
            results[variant] = {"variant": variant, "status": f"refused: {why}", "overrides": overrides}
            print(f"{variant}: refused: {why}", flush=True)
            continue
        name = f"n{args.nodes}-r{args.regions}-s{args.seed}-{args.rounds}r-{variant.replace('+', '-')}"
        results[variant] = {**measure(variant, flwr_run(name, overrides, args, app_dir, code), args.target)}
        results[variant]["overrides"] = overrides
        r = results[variant]
        print(
            f"{variant}: WAN {_f(r['wan_bytes_per_round'], '.0f')} B/round, {_f(r['sim_time_per_round_s'], '.2f')} "
            f"simulated s/round, to target {_f(r['time_to_target_sim_s'], '.1f')} s, final "
            f"{_f(r['final_accuracy'], '.4f')}, host {_f(r['host_server_s'], '.0f')} s "
            f"(flwr run {_f(r['host_flwr_run_s'], '.0f')} s)",
            flush=True,
        )
    ratios(results)
    checked = goals(results, args.target)
    print("\n" + table(results, args.target) + "\n")
    for g in checked:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        print(f"{g['variant']}: {g['goal']}: {verdict} ({g['why']})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine,
            "app": code,
            "nodes": args.nodes,
            "regions": args.regions,
            "rounds": args.rounds,
            "seed": args.seed,
            "target": args.target,
            "stop_at_target": args.stop_at_target,
            "extra_overrides": args.extra,
            "results": results,
            "goals": checked,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot and any(r["status"] == "measured" for r in results.values()):
        plot(results, args.plot, args.target, f"{args.nodes} nodes in {args.regions} regions")
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
