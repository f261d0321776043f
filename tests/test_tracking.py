"""Per-round metrics reach TensorBoard (and MLflow when installed), equal to metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.run.results import read_rows
from app.run.tracking import Trackers, metric_names, scalars
from app.tools.in_process import run_in_process


def _run(root: Path, overrides: str) -> tuple[dict, list[dict]]:
    """A run's summary and metrics.jsonl rows."""
    summary, _ = run_in_process(overrides, root)
    return summary, read_rows(summary["run_dir"])


def test_tensorboard_has_every_rounds_metrics(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary, rows = _run(tmp_path, "federation.rounds=3 train.epochs=1 seed=3 name=tb")
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"accuracy", "loss", "round_time_s", "num_rejected", "train/train-loss", "train/samples-per-s"} <= tags
    for tag in ("accuracy", "loss"):
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in logged] == [1, 2, 3]
        assert [v for _, v in logged] == pytest.approx([r[tag] for r in rows], rel=1e-6)  # float32 in the file
    assert summary["final_accuracy"] == pytest.approx(events.Scalars("accuracy")[-1].value, rel=1e-6)


def test_tracking_off_writes_no_event_files(tmp_path: Path) -> None:
    _run(tmp_path, "federation.rounds=1 train.epochs=1 name=off tracking.tensorboard=false")
    assert not (tmp_path / "off" / "tensorboard").exists()


def test_scalars_skip_missing_and_nested_values() -> None:
    row = {"round": 4, "accuracy": None, "loss": 0.5, "model_updated": True, "train": {"train-loss": 1.0, "x": "a"}}
    assert scalars(row) == {"loss": 0.5, "train/train-loss": 1.0}


def test_scalars_take_the_tasks_metric_columns() -> None:
    row = {"round": 2, "auroc": 0.9, "dice": 0.5, "accuracy": 0.7, "loss": 0.4}
    assert scalars(row, ("auroc", "dice")) == {"auroc": 0.9, "dice": 0.5, "loss": 0.4}
    config = {"task": {"metrics": ["auroc", {"_target_": "my_pkg.m.dice"}, {"_target_": "x.y", "name": "iou"}]}}
    assert metric_names(config) == ("auroc", "dice", "iou")
    assert metric_names({}) == ("accuracy",)  # a config from before task.metrics


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # SQLAlchemy 2.1 on mlflow's store
def test_mlflow_run_gets_params_and_per_round_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    summary, rows = _run(
        tmp_path, "federation.rounds=2 train.epochs=1 seed=3 name=ml tracking.mlflow=true tracking.mlflow_experiment=t"
    )
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # default: next to the run
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.info.run_name == "ml" and run.info.status == "FINISHED"
    assert run.data.params["strategy.name"] == "fedavg" and run.data.params["federation.rounds"] == "2"
    history = client.get_metric_history(run.info.run_id, "accuracy")
    assert [(m.step, m.value) for m in history] == [(r["round"], pytest.approx(r["accuracy"])) for r in rows]
    assert run.data.metrics["summary.final_accuracy"] == pytest.approx(summary["final_accuracy"])


def test_a_missing_tracker_is_a_warning_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_mlflow(name: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if name == "mlflow":
            raise ImportError("No module named 'mlflow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    trackers = Trackers(tmp_path, {"tracking": {"tensorboard": False, "mlflow": True}})
    assert trackers.active == [] and "mlflow is not installed" in caplog.text.lower()
    trackers.log_row({"round": 1, "accuracy": 0.5})
    trackers.close({"status": "completed"})
