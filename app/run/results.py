"""A run's results directory: config.yaml, metrics.jsonl, summary.json, curves.png,
checkpoint.pt and model_final.pt under <output-dir>/<run name>/."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from app.config.schema import ConfigError
from app.config.validate import check_dir_name
from app.run.tracking import Trackers
from app.status.schema import finite  # JSON has no NaN: non-finite floats become null

DEFAULT_OUTPUT_ROOT = Path.home() / "fedgpu-runs"


def output_root(configured: str) -> Path:
    """The results root: the run config's `output-dir`, or ~/fedgpu-runs.

    The ServerApp runs from a copy of the app under $FLWR_HOME/apps, so a relative
    path would land inside that copy; it is refused.
    """
    if not configured:
        return DEFAULT_OUTPUT_ROOT
    path = Path(os.path.expanduser(configured))
    if not path.is_absolute():
        raise ConfigError(
            f"output-dir={configured!r} must be an absolute path (the ServerApp runs from a copy of the app)"
        )
    return path


def new_run_dir(root: Path, name: str | None, strategy: str, dataset: str, reuse: bool = False) -> Path:
    """Create a fresh results directory; never reuse one (that would mix two runs).

    An explicit `name` that exists is an error, unless `reuse` (resume=auto found no
    checkpoint there: the run died before its first round); a generated one gets a
    -2, -3 ... suffix when two runs start in the same second (sweeps). The name is checked
    here too, not only by `validate`: this is where a '../x' would leave the root.
    """
    if name is not None:
        check_dir_name("name", name)
        path = root / name
        try:
            path.mkdir(parents=True, exist_ok=reuse)
        except FileExistsError:
            raise ConfigError(
                f"name={name!r}: {path} already holds a run; pick another name, or resume=auto to continue it"
            ) from None
        return path
    root.mkdir(parents=True, exist_ok=True)
    base = f"{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}-{strategy}-{dataset}"
    for n in range(1, 1000):
        path = root / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a new run directory under {root}")


def clock_s(row: dict[str, Any]) -> float:
    """When a row's step ended on the run's clock: simulated seconds for a fleet on a virtual
    clock (app/simulation/virtual_clock.py), else wall-clock seconds."""
    return float(row["sim_time_s"] if row.get("sim_time_s") is not None else row["wall_time_s"])


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl ([] if it has none yet)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """A run's summary.json; None while it has none (the run is going, or it crashed) or the
    file cannot be read as JSON."""
    try:
        return json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None


class RunRecorder:
    """Appends one JSON line per round and writes the summary and plot at the end.

    Rows carry `loss` and each of the task's metrics as a top-level column by its name
    (`accuracy`, `auroc`, ...); `primary` names the one the summary's best round and the
    plot follow (every metric is higher-is-better: app/task/metrics.py).
    """

    def __init__(self, run_dir: Path, resumed_after: int = 0, primary: str = "accuracy") -> None:
        self.primary = primary
        self.run_dir = run_dir.resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.checkpoint_path = self.run_dir / "checkpoint.pt"
        self.final_model_path = self.run_dir / "model_final.pt"
        self.rows: list[dict[str, Any]] = []
        self.resumed_after = resumed_after
        self.trackers: Trackers | None = None  # started by save_config, which knows the `tracking` settings
        if resumed_after:
            # Rounds after the checkpoint were lost with the crash; they are re-run.
            self.rows = [r for r in read_rows(self.run_dir) if r["round"] <= resumed_after]
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))

    def save_config(self, cfg: DictConfig) -> None:
        OmegaConf.save(cfg, self.run_dir / "config.yaml", resolve=True)
        self.trackers = Trackers(self.run_dir, OmegaConf.to_container(cfg, resolve=True), self.resumed_after)

    def log_round(self, row: dict[str, Any]) -> None:
        row = finite(row)
        self.rows.append(row)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.trackers is not None:
            self.trackers.log_row(row)

    def _final_and_best(self, column: str) -> tuple[Any, dict[str, Any] | None]:
        """(last value, row with the highest value) of `column`; rows without it are skipped."""
        rows = [r for r in self.rows if r.get(column) is not None]
        if not rows:
            return None, None
        return rows[-1][column], max(rows, key=lambda r: r[column])  # max: the first of equals

    def finish(self, status: str, wall_time_s: float, extra: dict[str, Any]) -> dict[str, Any]:
        """Write summary.json: the primary metric's final and best values (`final_metric`,
        `best_metric`, `best_round`) and, when the rows have an accuracy column, the
        `final_accuracy` / `best_accuracy` earlier summaries had. `extra` may override the
        final values (the final model evaluated after the last row)."""
        final, best = self._final_and_best(self.primary)
        summary: dict[str, Any] = {
            "status": status,
            "primary_metric": self.primary,
            "final_metric": final,
            "best_metric": best[self.primary] if best is not None else None,
            "best_round": best["round"] if best is not None else None,
        }
        if any("accuracy" in r for r in self.rows) or self.primary == "accuracy":
            final_acc, best_acc = self._final_and_best("accuracy")
            summary["final_accuracy"] = final_acc
            summary["best_accuracy"] = best_acc["accuracy"] if best_acc is not None else None
        if self.rows and all("bytes_up_total" in r for r in self.rows):  # central DP leaves them out
            summary["bytes_up_total"] = sum(r["bytes_up_total"] for r in self.rows)
            summary["bytes_down_total"] = sum(r["bytes_down_total"] for r in self.rows)
        summary |= {
            "rounds_completed": self.rows[-1]["round"] if self.rows else 0,
            "wall_time_s": wall_time_s,
            "run_dir": str(self.run_dir),
            **extra,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(finite(summary), indent=2) + "\n")
        if self.rows:
            self.plot()
        if self.trackers is not None:
            self.trackers.close(summary)
        return summary

    def plot(self) -> Path:
        """The primary metric per round and per second of wall time, and loss per round (curves.png).

        Rows without an evaluation (federation.eval_every > 1) are skipped.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        metric = self.primary
        rows = [r for r in self.rows if r.get(metric) is not None]
        unit = "version" if rows and "version" in rows[0] else "round"
        rounds = [r["round"] for r in rows]
        fig, (ax_acc, ax_time, ax_loss) = plt.subplots(1, 3, figsize=(15, 4))
        ax_acc.plot(rounds, [r[metric] for r in rows], marker="o")
        ax_acc.set(xlabel=unit, ylabel=f"test {metric}", title=f"Global model {metric}")
        ax_time.plot([r["wall_time_s"] for r in rows], [r[metric] for r in rows], marker=".")
        ax_time.set(xlabel="wall-clock time (s)", ylabel=f"test {metric}", title=f"{metric} over time")
        ax_loss.plot(rounds, [r["loss"] for r in rows], marker="o", color="tab:red")
        ax_loss.set(xlabel=unit, ylabel="test loss", title="Global model loss")
        for ax in (ax_acc, ax_time, ax_loss):
            ax.grid(alpha=0.3)
        fig.suptitle(self.run_dir.name)
        fig.tight_layout()
        path = self.run_dir / "curves.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
