"""Compare runs: one table row per configuration (seeds pooled), and plots of the primary metric.

    python -m app.report ~/fedgpu-runs/sweeps/default            # a sweep (python -m app.sweep)
    python -m app.report ~/fedgpu-runs/20261130-101500-fedavg-digits --target 0.9   # one run

Writes report.csv (one row per configuration), runs.csv (one row per run), report.md and
report.png (the primary metric per round and over time, simulated for fleet runs: the mean over seeds as
a line, min-max over seeds shaded) into the directory, or into --out. The primary metric is
each run's first `task.metrics` entry (summary.json's `primary_metric`; accuracy for runs
written before metrics were configurable); every metric is higher-is-better, and --target
is a value of it.

Every number comes from the runs' summary.json and metrics.jsonl. A configuration is a
sweep job's overrides minus the seed; runs that are not sweep jobs are told apart by the
config.yaml keys in which they differ.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from app.config.schema import BUILTIN_METRICS
from app.ledger.totals import run_ledger
from app.run.results import clock_s, read_rows, read_summary
from app.run.tracking import flat_params, metric_names

DEFAULT_TARGET = 0.95
STUDY_FILE = "study.json"  # app/tools/study.py's, in an Optuna sweep's directory (optuna is imported only then)
IGNORED_KEYS = ("seed", "name", "resume")  # never part of a configuration's identity
IGNORED_PREFIXES = ("sweep.", "tracking.")


class ReportError(ValueError):
    """Nothing to report on; the message says what was expected."""


@dataclass
class Run:
    """One run directory as the report sees it."""

    path: Path
    status: str  # completed | failed | running (job.json's, else summary.json's)
    error: str | None = None
    overrides: list[str] | None = None  # a sweep job's Hydra task overrides
    config: dict[str, Any] = field(default_factory=dict)  # flattened config.yaml
    summary: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    label: str = ""

    @property
    def metric(self) -> str:
        """The primary metric: summary.json's, else the config's first, else accuracy (older runs)."""
        if self.summary and self.summary.get("primary_metric"):
            return str(self.summary["primary_metric"])
        return metric_names({"task": {"metrics": self.config.get("task.metrics")}})[0]

    @property
    def seed(self) -> Any:  # noqa: ANN401
        for item in self.overrides or []:
            key, _, value = item.partition("=")
            if key == "seed":
                return value
        return self.config.get("seed")


def _ignored(key: str) -> bool:
    return key in IGNORED_KEYS or key.startswith(IGNORED_PREFIXES) or key in ("sweep", "tracking")


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_run(path: Path) -> Run:
    job = _load_json(path / "job.json") or {}
    summary = read_summary(path)
    overrides = job.get("overrides")
    if overrides is None and (path / ".hydra" / "overrides.yaml").is_file():
        overrides = yaml.safe_load((path / ".hydra" / "overrides.yaml").read_text()) or []
    config = (
        flat_params(yaml.safe_load((path / "config.yaml").read_text()) or {})
        if (path / "config.yaml").is_file()
        else {}
    )
    rows = read_rows(path)
    status = job.get("status") or (summary or {}).get("status") or "running"
    if status == "completed" and (summary or {}).get("status") != "completed":
        status = "failed"  # job.json says done but the run's own record disagrees: trust the run
    return Run(path, status, job.get("error"), overrides, config, summary, rows)


def find_runs(root: Path) -> list[Run]:
    """The run at `root`, or every sweep job / run directory below it (hidden dirs skipped)."""
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise ReportError(f"{root} is not a directory")
    marks = ("job.json", "summary.json")
    if any((root / m).is_file() for m in marks):
        dirs = [root]
    else:
        dirs = sorted(
            {
                p.parent
                for m in marks
                for p in root.rglob(m)
                if not any(s.startswith(".") for s in p.relative_to(root).parts)
            }
        )
    if not dirs:
        raise ReportError(
            f"no runs under {root}: expected a sweep directory (job directories with job.json, from "
            "python -m app.sweep) or a run directory (summary.json and metrics.jsonl)"
        )
    runs = [load_run(d) for d in dirs]
    label_runs(runs, root)
    return runs


def label_runs(runs: list[Run], root: Path) -> None:
    """A configuration label per run: the sweep overrides minus the seed, else the config.yaml
    keys in which the runs differ, else the directory name."""
    plain = [r for r in runs if r.overrides is None and r.config]
    keys = sorted({k for r in plain for k in r.config if not _ignored(k)})
    # A key present in only some runs (an option's own key) differs through its group's name.
    differing = [k for k in keys if len({repr(r.config[k]) for r in plain if k in r.config}) > 1]
    for run in runs:
        if run.overrides is not None:
            items = sorted(o for o in run.overrides if not _ignored(o.lstrip("+~").partition("=")[0]))
            run.label = " ".join(items) or "defaults"
        elif differing and run.config:
            run.label = " ".join(f"{k}={run.config[k]}" for k in differing if k in run.config)
        elif run.config and len(runs) > 1:
            run.label = str(run.config.get("strategy.name", run.path.name))
        else:
            run.label = run.path.name if run.path != root or len(runs) == 1 else "run"


# ----------------------------------------------------------------------------- numbers


def run_numbers(run: Run, target: float) -> dict[str, Any]:
    """One run's numbers, all read from its summary.json and metrics.jsonl; `target` is a value
    of its primary metric."""
    s = run.summary or {}
    metric = run.metric
    rows = [r for r in run.rows if r.get(metric) is not None]
    hit = next((r for r in rows if r[metric] >= target), None)
    privacy = s.get("privacy") or {}
    epsilon = privacy.get("epsilon", privacy.get("client_epsilon_max"))
    fedbuff = s.get("fedbuff") or {}
    stale = fedbuff.get("discarded_stale", sum(int(r.get("num_discarded_stale") or 0) for r in run.rows))
    return {
        "config": run.label,
        "seed": run.seed,
        "status": run.status,
        "metric": metric,
        "final_metric": s.get("final_metric", s.get("final_accuracy")),  # final_accuracy: older summaries
        "best_metric": s.get("best_metric", s.get("best_accuracy")),
        "rounds_completed": s.get("rounds_completed"),
        "wall_time_s": s.get("wall_time_s"),
        "round_to_target": hit["round"] if hit else None,
        "time_to_target_s": clock_s(hit) if hit else None,  # simulated seconds for a fleet run
        "clock": "simulated" if any("sim_time_s" in r for r in run.rows) else "wall",
        "epsilon": epsilon,
        "rejected": sum(int(r.get("num_rejected") or 0) for r in run.rows),
        "stale_discarded": stale,
        "failed_replies": sum(int(r.get("num_failed") or 0) + int(r.get("num_missing") or 0) for r in run.rows),
        "uplink_mb": s["bytes_up_total"] / 1e6 if s.get("bytes_up_total") is not None else None,
        "downlink_mb": s["bytes_down_total"] / 1e6 if s.get("bytes_down_total") is not None else None,
        **dict.fromkeys(("ledger_problem", "ledger_head", "reported_compute_s", "reported_energy_j"), None),
        "lowest_contribution_node": None,
        **run_ledger(run.path),
        **federated_numbers(run.rows, metric),
        "error": run.error,
        "path": str(run.path),
    }


def federated_numbers(rows: list[dict[str, Any]], metric: str) -> dict[str, float | None]:
    """The last federated evaluation's primary metric on the nodes' own validation splits: the
    global model's (`eval-<metric>`) and, under Ditto, the personal models' (`eval-personal-<metric>`)."""
    last = next((r["federated_eval"] for r in reversed(rows) if r.get("federated_eval")), {}) or {}
    return {"federated_metric": last.get(f"eval-{metric}"), "personal_metric": last.get(f"eval-personal-{metric}")}


def _mean_std(values: Sequence[Any]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (ddof=1) of the known values; std is None for one."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None, None
    return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else None


def summarize(runs: list[Run], target: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(one row per configuration, one row per run). The primary metric's statistics pool the
    completed runs; time to target is the mean over the runs that reached it."""
    per_run = [run_numbers(r, target) for r in runs]
    table = []
    for label in dict.fromkeys(r["config"] for r in per_run):  # first-seen order
        group = [r for r in per_run if r["config"] == label]
        done = [r for r in group if r["status"] == "completed"]
        reached = [r for r in done if r["round_to_target"] is not None]
        row: dict[str, Any] = {
            "config": label,
            "runs": len(done),
            "failed": sum(r["status"] == "failed" for r in group),
            "pruned": sum(r["status"] == "pruned" for r in group),  # an Optuna trial stopped early
            "unfinished": sum(r["status"] not in ("completed", "failed", "pruned") for r in group),
            "seeds": " ".join(str(r["seed"]) for r in done),
            "metric": "/".join(dict.fromkeys(r["metric"] for r in group)),
        }
        for key in ("final_metric", "best_metric", "wall_time_s"):
            row[f"{key}_mean"], row[f"{key}_std"] = _mean_std([r[key] for r in done])
        row["rounds_mean"] = _mean_std([r["rounds_completed"] for r in done])[0]
        row["target"] = target
        row["reached_target"] = len(reached)
        row["rounds_to_target_mean"] = _mean_std([r["round_to_target"] for r in reached])[0]
        row["time_to_target_s_mean"] = _mean_std([r["time_to_target_s"] for r in reached])[0]
        row["epsilon_mean"], row["epsilon_std"] = _mean_std([r["epsilon"] for r in done])
        row["uplink_mb_mean"] = _mean_std([r["uplink_mb"] for r in done])[0]
        row["downlink_mb_mean"] = _mean_std([r["downlink_mb"] for r in done])[0]
        for key in ("rejected", "stale_discarded", "failed_replies"):
            row[f"{key}_per_run"] = _mean_std([r[key] for r in done])[0]
        row["ledger_verified"] = sum(r["ledger"] == "verified" for r in done)
        row["ledger_broken"] = sum(r["ledger"] == "broken" for r in group)
        row["reported_compute_s_mean"] = _mean_std([r["reported_compute_s"] for r in done])[0]
        for key in ("federated_metric", "personal_metric"):
            row[f"{key}_mean"], row[f"{key}_std"] = _mean_std([r[key] for r in done])
        table.append(row)
    return table, per_run


# ----------------------------------------------------------------------------- output


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows([{k: "" if v is None else v for k, v in r.items()} for r in rows])


def _pm(mean: float | None, std: float | None, scale: float = 1.0, digits: int = 1) -> str:
    if mean is None:
        return "–"
    text = f"{mean * scale:.{digits}f}"
    return text + (f" ± {std * scale:.{digits}f}" if std is not None else "")


def _percent(metric: str) -> bool:
    """Built-in metrics lie in [0, 1] and show as percentages; a custom one shows as it is."""
    return metric in BUILTIN_METRICS


def markdown(table: list[dict[str, Any]], per_run: list[dict[str, Any]], root: Path, target: float, plot: str) -> str:
    # Overrides every configuration shares are said once, above the table; so is the metric.
    common = set.intersection(*(set(r["config"].split()) for r in table)) if len(table) > 1 else set()
    metrics = list(dict.fromkeys(r["metric"] for r in table))
    metric = metrics[0] if len(metrics) == 1 else "metric"
    unit = " (%)" if all(_percent(m) for m in metrics) else ""
    lines = [
        f"# Report: {root}",
        "",
        f"{len(per_run)} runs in {len(table)} configurations; mean ± std (sample, over seeds) of the completed "
        f"runs. Target {metric} {target:g}: rounds and seconds are means over the runs that reached it. "
        "¹ Simulated seconds for runs with a fleet profile (virtual clock), else wall-clock seconds.",
        *([f"All configurations: `{' '.join(sorted(common))}`."] if common else []),
        "",
        f"| configuration | runs | failed | final {metric}{unit} | best {metric}{unit} | reached target "
        "| rounds to target | time to target (s)¹ | wall time (s) | ε | rejected / run | stale discarded / run "
        "| failed replies / run | uplink MB / run | downlink MB / run | ledger verified | compute s / run (reported) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        config = f"`{' '.join(i for i in r['config'].split() if i not in common) or r['config']}`"
        scale, digits = (100, 1) if _percent(r["metric"]) else (1, 3)
        lines.append(
            "| "
            + " | ".join(
                [
                    config + (f" ({r['metric']})" if len(metrics) > 1 else ""),
                    str(r["runs"]),
                    str(r["failed"])
                    + (f" (+{r['pruned']} pruned)" if r["pruned"] else "")
                    + (f" (+{r['unfinished']} unfinished)" if r["unfinished"] else ""),
                    _pm(r["final_metric_mean"], r["final_metric_std"], scale, digits),
                    _pm(r["best_metric_mean"], r["best_metric_std"], scale, digits),
                    f"{r['reached_target']}/{r['runs']}",
                    _pm(r["rounds_to_target_mean"], None),
                    _pm(r["time_to_target_s_mean"], None),
                    _pm(r["wall_time_s_mean"], r["wall_time_s_std"]),
                    _pm(r["epsilon_mean"], r["epsilon_std"], digits=2)
                    if r["epsilon_mean"] is not None or not r["runs"]
                    else "no DP",
                    _pm(r["rejected_per_run"], None),
                    _pm(r["stale_discarded_per_run"], None),
                    _pm(r["failed_replies_per_run"], None),
                    _pm(r["uplink_mb_mean"], None, digits=2),
                    _pm(r["downlink_mb_mean"], None, digits=2),
                    f"{r['ledger_verified']}/{r['runs']}"
                    + (f" ({r['ledger_broken']} broken)" if r["ledger_broken"] else ""),
                    _pm(r["reported_compute_s_mean"], None),
                ]
            )
            + " |"
        )
    failed = [r for r in per_run if r["status"] == "failed"]
    if failed:
        lines += ["", "Failed runs:", ""]
        for r in failed:
            error = " ".join(str(r["error"] or "see its flwr.log").split())
            lines.append(f"- `{Path(r['path']).name}`: {error[:400]}")
    broken = [r for r in per_run if r["ledger"] == "broken"]
    if broken:
        lines += ["", "Ledgers that do not verify (`python -m app.ledger verify RUN` says why):", ""]
        lines += [f"- `{Path(r['path']).name}`: {r['ledger_problem']}" for r in broken]
    federated = [r for r in table if r["federated_metric_mean"] is not None or r["personal_metric_mean"] is not None]
    if federated:  # the nodes' own validation splits: the global model, and Ditto's personal models
        lines += [
            "",
            f"Federated evaluation, last round, on the nodes' own validation splits ({metric}{unit}):",
            "",
            "| configuration | global model | personal models (Ditto) |",
            "|---|---|---|",
        ]
        for r in federated:
            scale, digits = (100, 1) if _percent(r["metric"]) else (1, 3)
            config = f"`{' '.join(i for i in r['config'].split() if i not in common) or r['config']}`"
            lines.append(
                f"| {config} | {_pm(r['federated_metric_mean'], r['federated_metric_std'], scale, digits)} "
                f"| {_pm(r['personal_metric_mean'], r['personal_metric_std'], scale, digits)} |"
            )
    if plot:
        lines += ["", f"![{metric} per round and over time]({plot})"]
    return "\n".join(lines) + "\n"


def _curves(runs: list[Run]) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """(rounds, times on each run's clock, primary-metric values) of each run's evaluated rows."""
    rounds, times, values = [], [], []
    for run in runs:
        rows = [r for r in run.rows if r.get(run.metric) is not None]
        rounds.append(np.array([r["round"] for r in rows], dtype=float))
        times.append(np.array([clock_s(r) for r in rows], dtype=float))
        values.append(np.array([r[run.metric] for r in rows], dtype=float))
    return rounds, times, values


def _band(xs: list[np.ndarray], ys: list[np.ndarray], grid: np.ndarray, hold: bool) -> tuple[np.ndarray, ...]:
    """Mean, min and max over runs on `grid`.

    Rounds (`hold=False`): the runs that have that round. Time (`hold=True`): each run's
    latest evaluated value at t (a finished run keeps its final one), from the time
    every run has its first evaluation on, so the mean never jumps as runs start or end.
    """
    stack = np.full((len(xs), len(grid)), np.nan)
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if not len(x):
            continue
        if hold:
            at = np.searchsorted(x, grid, side="right") - 1
            stack[i, at >= 0] = y[at[at >= 0]]
        else:
            stack[i, np.isin(grid, x)] = y[np.searchsorted(x, grid[np.isin(grid, x)])]
    keep = ~np.any(np.isnan(stack), axis=0) if hold else ~np.all(np.isnan(stack), axis=0)
    stack = stack[:, keep]
    return grid[keep], np.nanmean(stack, axis=0), np.nanmin(stack, axis=0), np.nanmax(stack, axis=0)


def plot(runs: list[Run], out: Path, target: float | None) -> Path:
    """The primary metric per round and over wall-clock time: one line per configuration (mean
    over seeds), min-max over seeds shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if r.status == "completed" and r.rows]
    metrics = list(dict.fromkeys(r.metric for r in done))
    metric = metrics[0] if len(metrics) == 1 else "primary metric (" + ", ".join(metrics) + ")"
    n_labels = len(dict.fromkeys(r.label for r in done))
    ncol = 2 if n_labels > 4 else 1
    legend_in = 0.22 * (math.ceil(n_labels / ncol) + 1)  # the legend sits under both panels
    fig, (ax_round, ax_time) = plt.subplots(1, 2, figsize=(13, 4.5 + legend_in))
    for label in dict.fromkeys(r.label for r in done):
        group = [r for r in done if r.label == label]
        rounds, times, accs = _curves(group)
        if not any(len(a) for a in accs):
            continue
        round_grid = np.unique(np.concatenate(rounds))
        time_grid = np.unique(np.concatenate(times))  # every evaluation of every seed: steps stay exact
        for ax, xs, grid in ((ax_round, rounds, round_grid), (ax_time, times, time_grid)):
            x, mean, lo, hi = _band(xs, accs, grid, hold=ax is ax_time)
            short = label if len(label) <= 70 else label[:67] + "..."
            step = "post" if ax is ax_time else None
            if step:
                (line,) = ax.step(x, mean, where="post", label=f"{short} (n={len(group)})")
            else:
                (line,) = ax.plot(x, mean, label=f"{short} (n={len(group)})", marker=".")
            if len(group) > 1:
                ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0, step=step)
    ax_round.set(xlabel="round (sync) / version (async)", ylabel=f"test {metric}", title=f"{metric} per round")
    ax_time.set(
        xlabel="time (s from the start; simulated for fleet runs, else wall-clock)",
        ylabel=f"test {metric}",
        title=f"{metric} over time (latest evaluation)",
    )
    for ax in (ax_round, ax_time):
        if target:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.grid(alpha=0.3)
    handles, labels = ax_round.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=ncol, frameon=False)
    fig.suptitle(f"Test {metric}: mean over seeds, min-max shaded")
    fig.tight_layout(rect=(0, legend_in / (4.5 + legend_in), 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_report(root: Path, target: float = DEFAULT_TARGET, out: Path | None = None) -> dict[str, Path]:
    """Write report.csv, runs.csv, report.md and report.png; returns their paths."""
    root = Path(root).expanduser().resolve()
    runs = find_runs(root)
    table, per_run = summarize(runs, target)
    out = Path(out).expanduser().resolve() if out else root
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "report.csv", "runs_csv": out / "runs.csv", "md": out / "report.md"}
    _write_csv(paths["csv"], table)
    _write_csv(paths["runs_csv"], per_run)
    if any(r.status == "completed" and r.rows for r in runs):
        paths["png"] = plot(runs, out / "report.png", target)
    text = markdown(table, per_run, root, target, "report.png" if "png" in paths else "")
    if (root / STUDY_FILE).is_file():  # an Optuna sweep (hydra/sweeper=optuna): the study's section
        from app.tools.study import study_markdown

        text += "\n".join(study_markdown(root, out)) + "\n"
        if (out / "study.png").is_file():
            paths["study_png"] = out / "study.png"
    paths["md"].write_text(text)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path, help="a sweep directory or a run directory")
    parser.add_argument(
        "--target", type=float, default=DEFAULT_TARGET, help="target value of the primary metric (default 0.95)"
    )
    parser.add_argument("-o", "--out", type=Path, default=None, help="where to write (default: the directory)")
    args = parser.parse_args(argv)
    if not 0 < args.target < math.inf:
        parser.error(f"--target {args.target} must be a finite number > 0 (a value of the primary metric)")
    try:
        paths = write_report(args.dir, args.target, args.out)
    except ReportError as err:
        parser.exit(2, f"error: {err}\n")
    print(paths["md"].read_text())
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0
