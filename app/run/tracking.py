"""Experiment trackers fed with every metrics.jsonl row: TensorBoard, and MLflow when enabled.

Users watch runs live in the tools they already use (`tensorboard --logdir ~/fedgpu-runs`,
`mlflow ui --backend-store-uri sqlite:///$HOME/fedgpu-runs/mlflow.db`). metrics.jsonl stays
the record; a tracker that fails logs a warning and never stops a run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.config.schema import check_columns, metric_name

log = logging.getLogger("flwr.fedgpu." + __name__)

# Scalars taken from a metrics row besides the task's metrics (absent or non-numeric ones are skipped).
ROW_SCALARS = (
    "loss",
    "wall_time_s",
    "round_time_s",
    "num_clients",
    "num_rejected",
    "num_missing",
    "num_failed",
    "num_discarded_stale",
    "epsilon",
    "clip_norm",
    "clipped_fraction",  # exact: in rows only with privacy.report_exact=true
    "noised_unclipped_fraction",  # adaptive clipping's released (DP) estimate
    "client_epsilon_max",
    "client_epsilon_mean",
)
NESTED = ("train", "federated_eval")  # the clients' weighted metrics, logged as train/<key>
# Both name metrics.jsonl columns, declared in app/config/schema.py ROW_COLUMNS: a column renamed
# there must not silently drop out of the trackers.
check_columns((*ROW_SCALARS, *NESTED))


def scalars(row: dict[str, Any], metrics: Sequence[str] = ("accuracy",)) -> dict[str, float]:
    """The numeric metrics of one row under tracker-friendly names: the task's `metrics`
    (top-level columns named after them), the run's own columns, the clients' sections."""
    out = {k: float(row[k]) for k in (*metrics, *ROW_SCALARS) if _number(row.get(k))}
    for section in NESTED:
        for key, value in (row.get(section) or {}).items():
            if _number(value):
                out[f"{section}/{key}"] = float(value)
    return out


def _number(value: Any) -> bool:  # noqa: ANN401
    return isinstance(value, int | float) and not isinstance(value, bool)


def metric_names(config: dict[str, Any]) -> tuple[str, ...]:
    """The metric columns a run's rows have: its `task.metrics` names (accuracy when unset)."""
    entries = (config.get("task") or {}).get("metrics") or ["accuracy"]
    return tuple(metric_name(entry) for entry in entries)


def flat_params(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as flat `section.key` parameters (MLflow takes no nesting)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, name + "."))
        else:
            out[name] = value
    return out


class TensorBoardTracker:
    """Event files in <run dir>/tensorboard, one scalar per metric and round (or version)."""

    def __init__(self, run_dir: Path, resumed_after: int, metrics: Sequence[str] = ("accuracy",)) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.metrics = metrics
        # purge_step drops events after the checkpoint's round: a resumed run re-logs them.
        self.writer = SummaryWriter(
            str(run_dir / "tensorboard"), purge_step=resumed_after + 1 if resumed_after else None
        )

    def log_row(self, row: dict[str, Any]) -> None:
        for tag, value in scalars(row, self.metrics).items():
            self.writer.add_scalar(tag, value, global_step=int(row["round"]))
        self.writer.flush()  # live: TensorBoard shows the round as soon as it is logged

    def close(self, summary: dict[str, Any]) -> None:
        self.writer.close()


class MlflowTracker:
    """One MLflow run per federated run: the config as parameters, every row as metrics."""

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        uri: str | None,
        experiment: str,
        metrics: Sequence[str] = ("accuracy",),
    ) -> None:
        import mlflow

        self.mlflow, self.metrics = mlflow, metrics
        uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.parent / 'mlflow.db'}"
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=run_dir.name, tags={"run_dir": str(run_dir)})
        params = {k: v for k, v in flat_params(config).items() if v is not None}
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})  # MLflow caps values at 6000 chars
        log.info("MLflow: run %s in experiment %r at %s", self.run.info.run_id, experiment, uri)

    def log_row(self, row: dict[str, Any]) -> None:
        metrics = {k.replace("/", "."): v for k, v in scalars(row, self.metrics).items()}
        self.mlflow.log_metrics(metrics, step=int(row["round"]), run_id=self.run.info.run_id)

    def close(self, summary: dict[str, Any]) -> None:
        final = {k: float(v) for k, v in summary.items() if _number(v)}
        self.mlflow.log_metrics({f"summary.{k}": v for k, v in final.items()}, run_id=self.run.info.run_id)
        status = "FINISHED" if summary.get("status") == "completed" else "FAILED"
        self.mlflow.end_run(status=status)


class Trackers:
    """The trackers a run's `tracking` settings ask for; each failure is a warning, never an error."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resumed_after: int = 0) -> None:
        settings = config.get("tracking") or {}
        metrics = metric_names(config)
        self.active: list[TensorBoardTracker | MlflowTracker] = []
        if settings.get("tensorboard", False):
            self._start("TensorBoard", lambda: TensorBoardTracker(run_dir, resumed_after, metrics))
        if settings.get("mlflow", False):
            self._start(
                "MLflow",
                lambda: MlflowTracker(
                    run_dir, config, settings.get("mlflow_uri"), settings.get("mlflow_experiment") or "fedgpu", metrics
                ),
            )

    def _start(self, name: str, make: Any) -> None:  # noqa: ANN401
        try:
            self.active.append(make())
        except ImportError as err:
            log.warning("tracking.%s=true, but %s is not installed (%s); going on without it", name.lower(), name, err)
        except Exception as err:  # noqa: BLE001 - a tracker never stops a run
            log.warning("%s tracking disabled: %s", name, err)

    def log_row(self, row: dict[str, Any]) -> None:
        for tracker in list(self.active):
            try:
                tracker.log_row(row)
            except Exception as err:  # noqa: BLE001
                log.warning("%s failed (%s); disabled for the rest of the run", type(tracker).__name__, err)
                self.active.remove(tracker)

    def close(self, summary: dict[str, Any]) -> None:
        for tracker in self.active:
            try:
                tracker.close(summary)
            except Exception as err:  # noqa: BLE001
                log.warning("%s did not close cleanly: %s", type(tracker).__name__, err)
        self.active = []
