"""Hydra multirun sweeps (app/tools/sweep.py): job directories, failure records, skipping, and
(slow) whole sweeps through `flwr run` with a private FLWR_HOME per job."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.config.compose import compose_config
from app.config.schema import ConfigError
from app.tools.processes import processes_under
from app.tools.report import write_report
from app.tools.sweep import APP_DIR, app_overrides, federation_config, job_subdir, read_job, run_job, sweep_dir

# Tiny federations: 3 nodes, 2 rounds of 1 epoch (~20 s each under `flwr run` on 2 cores).
TINY = ["federation.rounds=2", "train.epochs=1", "simulation.num_supernodes=3"]


def _sweep(args: list[str], root: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FEDGPU_FLWR_HOME_ROOT": str(root / "homes"), "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "app.sweep", *args, f"sweep.root={root}"],
        cwd=APP_DIR, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    print(proc.stdout[-6000:], proc.stderr[-6000:])
    return proc


def _jobs(sweep: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/job.json")}


# ----------------------------------------------------------------------------- fast


def test_sweep_dir_must_be_absolute_and_outside_the_app(tmp_path: Path) -> None:
    assert sweep_dir(str(tmp_path), "s") == str(tmp_path.resolve() / "s")
    assert sweep_dir("~/x", "s") == str(Path.home().resolve() / "x" / "s")
    with pytest.raises(ValueError, match="must be an absolute path"):
        sweep_dir("runs", "s")
    with pytest.raises(ValueError, match="inside the app directory"):
        sweep_dir(str(APP_DIR / "outputs"), "s")
    assert job_subdir("") == "defaults" and job_subdir("seed=0,strategy=krum") == "seed=0,strategy=krum"
    assert job_subdir("dataset.path=/data/x.npz,seed=0") == "dataset.path=_data_x.npz,seed=0"
    long = ",".join(f"strategy.key{i}=0.012520653814999465" for i in range(12))  # 400 bytes
    short = job_subdir(long)
    assert len(short.encode()) == 200 and short.startswith(long[:150]) and short == job_subdir(long)
    assert job_subdir(long.replace("key11", "key12")) != short


def test_cli_refuses_a_sweep_root_inside_the_app_dir_before_running_anything(tmp_path: Path) -> None:
    proc = _sweep(["--multirun", "seed=0,1"], APP_DIR / "sweeps-here")
    assert proc.returncode != 0
    assert "inside the app directory" in proc.stderr + proc.stdout
    assert not (APP_DIR / "sweeps-here").exists()


def test_overrides_for_the_app_and_the_federation() -> None:
    task = ["strategy=krum", "sweep.name=x", "sweep.timeout_s=5", "seed=1", "simulation.num_supernodes=7"]
    assert app_overrides(task) == ["strategy=krum", "seed=1", "simulation.num_supernodes=7"]
    with pytest.raises(ConfigError, match="name= is set by the sweep"):
        app_overrides(["name=mine"])
    cfg = compose_config("simulation.num_supernodes=7 simulation.client_cpus=2 simulation.client_gpus=0.25")
    assert federation_config(cfg) == "num-supernodes=7 client-resources-num-cpus=2 client-resources-num-gpus=0.25"


def test_a_bad_value_is_recorded_as_failed_without_starting_flower(tmp_path: Path) -> None:
    job = tmp_path / "sweep" / "train.lr=-1"
    job.mkdir(parents=True)
    cfg = compose_config(f"train.lr=-1 sweep.root={tmp_path}")
    cfg.sweep.name = "sweep"
    record = run_job(cfg, job, ["train.lr=-1"])
    assert record["status"] == "failed" and "train.lr=-1.0 is invalid" in record["error"]
    assert read_job(job) == record and not (job / "flwr.log").exists()
    again = run_job(cfg, job, ["train.lr=-1"])
    assert again["status"] == "failed" and again["attempt"] == 2  # failed jobs are tried again


def test_a_completed_job_is_skipped(tmp_path: Path) -> None:
    job = tmp_path / "sweep" / "seed=0"
    job.mkdir(parents=True)
    (job / "summary.json").write_text(json.dumps({"status": "completed", "final_accuracy": 0.9}))
    cfg = compose_config(f"seed=0 sweep.root={tmp_path}")
    record = run_job(cfg, job, ["seed=0"])  # the run completed, the sweep died before job.json said so
    assert record["skipped"] and read_job(job)["status"] == "completed"


def test_slurm_launcher_config_composes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "app.sweep", "hydra/launcher=slurm", "--cfg", "hydra"],
        cwd=APP_DIR, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "SlurmLauncher" in proc.stdout and "array_parallelism: 16" in proc.stdout


# ----------------------------------------------------------------------------- slow: real `flwr run`


def test_two_by_two_sweep_records_a_failure_goes_on_and_skips_completed_jobs_when_rerun(tmp_path: Path) -> None:
    """strategy x privacy: median with central DP is refused (first job), the other three run;
    the report has a row per configuration; the same command again only retries the failure."""
    args = ["--multirun", "strategy=median,fedavg", "privacy=central,none", "seed=0", *TINY, "sweep.name=s"]
    proc = _sweep(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sweep = tmp_path / "s"
    jobs = _jobs(sweep)
    assert len(jobs) == 4
    failed = {name: job for name, job in jobs.items() if job["status"] == "failed"}
    # job directories are the overrides sorted by key (Hydra's override_dirname)
    assert list(failed) == [
        "federation.rounds=2,privacy=central,seed=0,simulation.num_supernodes=3,strategy=median,train.epochs=1"
    ]
    assert "central DP has no standard sensitivity bound" in next(iter(failed.values()))["error"]
    for name, job in jobs.items():
        if name not in failed:
            assert job["status"] == "completed" and job["flwr_status"] == "finished:completed", job
            summary = json.loads((sweep / name / "summary.json").read_text())
            assert summary["rounds_completed"] == 2 and summary["num_nodes"] == 3
            assert (sweep / name / ".hydra" / "config.yaml").is_file() and (sweep / name / "tensorboard").is_dir()
    central_job = (
        "federation.rounds=2,privacy=central,seed=0,simulation.num_supernodes=3,strategy=fedavg,train.epochs=1"
    )
    central = json.loads((sweep / central_job / "summary.json").read_text())
    assert central["privacy"]["epsilon"] > 0

    report = (sweep / "report.md").read_text()  # written by the sweep's end-of-run callback
    assert "All configurations: `federation.rounds=2 simulation.num_supernodes=3 train.epochs=1`" in report
    assert report.count("| `privacy=") == 4  # one row per configuration
    with (sweep / "report.csv").open() as f:
        rows = {r["config"]: r for r in csv.DictReader(f)}
    assert sorted(int(r["failed"]) for r in rows.values()) == [0, 0, 0, 1]

    # every job's SuperLink, SuperExec and Ray processes are gone, and so are their FLWR_HOMEs
    assert not processes_under(str(tmp_path / "homes"))
    assert not any((tmp_path / "homes").iterdir())

    before = {name: (sweep / name / "job.json").stat().st_mtime_ns for name in jobs}
    again = _sweep(args, tmp_path, timeout=120)
    assert again.returncode == 0
    assert again.stdout.count("completed earlier") + again.stderr.count("completed earlier") == 3
    after = _jobs(sweep)
    for name in jobs:
        changed = (sweep / name / "job.json").stat().st_mtime_ns != before[name]
        assert changed == (name in failed), name
    assert after[next(iter(failed))]["attempt"] == 2
    assert write_report(sweep)["csv"].is_file()


def test_a_failing_serverapp_is_recorded_with_flowers_verdict(tmp_path: Path) -> None:
    """The ServerApp raises (too few nodes): `flwr run --stream` exits 0, the job reads the
    run's finished:failed state and records its details."""
    args = [*TINY, "federation.min_available_nodes=4", "federation.node_wait_timeout_s=2", "sweep.name=f"]
    proc = _sweep(args, tmp_path)  # without --multirun: one job, same layout
    assert proc.returncode == 0, proc.stderr[-4000:]
    (job,) = _jobs(tmp_path / "f").values()
    assert job["status"] == "failed" and job["run_id"], job
    assert job["flwr_status"] == "finished:failed"
    assert "federation.min_available_nodes=4" in job["error"], job["error"]
    assert not processes_under(str(tmp_path / "homes"))


def test_a_sweep_over_a_custom_task_reports_its_primary_metric(tmp_path: Path) -> None:
    """A user's model, loader and metrics (tests/own_task.py, shipped with the app directory)
    through a sweep job: the job completes and the report speaks AUROC."""
    custom = [
        "model=custom", "model._target_=tests.own_task.MLP", "++model.hidden=8", "dataset=python",
        "dataset._target_=tests.own_task.tabular", "task.metrics=[auroc,accuracy]",
    ]  # fmt: skip
    proc = _sweep(["--multirun", *custom, *TINY, "sweep.name=own"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ((name, job),) = _jobs(tmp_path / "own").items()
    assert job["status"] == "completed" and job["primary_metric"] == "auroc", job
    summary = json.loads((tmp_path / "own" / name / "summary.json").read_text())
    assert summary["final_metric"] > 0.9 and summary["model"] == "custom", summary
    assert "auroc" in (tmp_path / "own" / "report.md").read_text()
