"""Hydra multirun sweeps: every job runs one whole federation in simulation through `flwr run`.

    python -m app.sweep --multirun strategy=fedavg,krum privacy=none,central seed=0,1,2
    python -m app.sweep --multirun hydra/launcher=joblib hydra.launcher.n_jobs=2 seed=0,1
    python -m app.report ~/fedgpu-runs/sweeps/default

A job's directory is <sweep.root>/<sweep.name>/<its overrides> (deterministic, so the same
command again skips the jobs that completed); it holds Hydra's .hydra/, the run's results
(the ServerApp writes there: output-dir is the sweep directory and the run is named after
the job), job.json (status, error, Flower run id) and flwr.log. A job never raises: a bad
config, a failed ServerApp or a timeout is recorded and the sweep goes on. A job that did
not complete resumes from its own checkpoint when the sweep runs again (resume=auto).

Each job gets a private FLWR_HOME and private ports, so its local SuperLink is its own
(a developer's SuperLink on the default ports is never used, parallel jobs never share
one), and stops that SuperLink and everything it spawned when it ends.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from app.config.compose import CONF_DIR, to_typed
from app.config.schema import ConfigError
from app.config.validate import validate
from app.run.results import read_rows, read_summary
from app.run.tracking import metric_names
from app.tools.processes import RUN_ID, flwr_cli, free_ports, parse_flwr_json, stop_processes, strip_colours

log = logging.getLogger(__name__)

APP_DIR = CONF_DIR.parent  # what `flwr run` packs
JOB_FILE = "job.json"
RESERVED_KEYS = ("name", "resume")  # the sweep sets them: each job is its own named, resumable run
# Where the per-job FLWR_HOMEs go (default: the temp dir, which is node-local on clusters:
# the SuperLink's sqlite state does not belong on NFS).
HOME_ROOT_ENV = "FEDGPU_FLWR_HOME_ROOT"
MAX_NAME = 200  # bytes of a job directory's name (file systems take 255; the run adds files, not to the name)
WATCH_S = 2.0  # how often a running job looks at its rows (an Optuna trial reports them)
STATUS_WAIT_S = 60.0  # after `flwr run --stream` returns, how long the run may take to show as finished


# ----------------------------------------------------------------------------- job directories


def sweep_dir(root: str, name: str) -> str:
    """The sweep's directory; refuses a relative root and one inside the app directory.

    Hydra resolves this (as `fedgpu_sweep_dir`) before it creates any directory, so a bad
    root stops the sweep before anything runs.
    """
    path = Path(os.path.expanduser(str(root)))
    if not path.is_absolute():
        raise ValueError(f"sweep.root={root!r} must be an absolute path (or start with ~)")
    path = path.resolve() / str(name)
    if path == APP_DIR or APP_DIR in path.parents:
        raise ValueError(
            f"sweep.root={root!r} is inside the app directory {APP_DIR}, which `flwr run` packs and "
            "ships with every run; put sweeps elsewhere (default ~/fedgpu-runs/sweeps)"
        )
    return str(path)


def job_subdir(override_dirname: str) -> str:
    """A job's directory below the sweep's: its overrides (sorted by Hydra), `defaults` if none.

    Path separators in override values (`dataset.path=/data/x.npz`) become `_`: the job's
    directory is also its run `name`, which must be one directory name. A name longer than a
    file system takes (255 bytes; many overrides, an Optuna trial's long floats) keeps its first
    MAX_NAME bytes and a digest of the whole: still one directory per job, the same on a rerun.
    """
    name = override_dirname.replace("/", "_").replace("\\", "_") or "defaults"
    if len(name.encode()) <= MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return name.encode()[: MAX_NAME - 17].decode(errors="ignore") + "-" + digest


OmegaConf.register_new_resolver("fedgpu_sweep_dir", sweep_dir, replace=True)
OmegaConf.register_new_resolver("fedgpu_subdir", job_subdir, replace=True)


def read_job(job_dir: Path) -> dict[str, Any]:
    path = job_dir / JOB_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_job(job_dir: Path, record: dict[str, Any]) -> None:
    tmp = job_dir / (JOB_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(job_dir / JOB_FILE)  # atomic: a killed sweep never leaves half a job.json


def completed_summary(job_dir: Path) -> dict[str, Any] | None:
    """The run's summary.json if the run completed (the ServerApp writes it last)."""
    summary = read_summary(job_dir)
    return summary if summary is not None and summary.get("status") == "completed" else None


def app_overrides(task: list[str]) -> list[str]:
    """The job's Hydra task overrides as the ServerApp's `overrides`, minus the sweep's own keys."""
    kept = []
    for item in task:
        key = item.lstrip("+~").partition("=")[0]
        if key in RESERVED_KEYS:
            raise ConfigError(
                f"{key}= is set by the sweep: each job is a run named after its directory that resumes "
                "its own checkpoint; drop it from the sweep's overrides"
            )
        if key != "sweep" and not key.startswith("sweep."):
            kept.append(item)
    return kept


def federation_config(cfg: DictConfig) -> str:
    """`flwr run --federation-config` for the job's `simulation` settings."""
    s = cfg.simulation
    return (
        f"num-supernodes={int(s.num_supernodes)} client-resources-num-cpus={int(s.client_cpus)} "
        f"client-resources-num-gpus={float(s.client_gpus)}"
    )


# ----------------------------------------------------------------------------- Flower processes


def flower_env(home: Path) -> dict[str, str]:
    """Environment for `flwr`: a private FLWR_HOME and ports, the installed environment
    (no `uv sync` per run: offline and fast), no update check, no Ray usage stats."""
    http_port, control_port = free_ports(2)
    bin_dir = str(Path(sys.executable).parent)  # flower-superlink & co. of this environment
    return {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def run_status(env: dict[str, str], run_id: str, deadline: float) -> dict[str, Any]:
    """`flwr list --run-id ID --format json` once the run has finished (or at `deadline`)."""
    row: dict[str, Any] = {}
    while True:
        proc = subprocess.run(
            [flwr_cli(), "list", "--run-id", run_id, "--format", "json"],
            env=env,
            cwd=APP_DIR,
            capture_output=True,
            text=True,
            timeout=60,
        )
        text = proc.stdout
        if proc.returncode == 0 and "{" in text:
            runs = parse_flwr_json(text).get("runs") or [{}]
            row = runs[0]
            if str(row.get("status", "")).startswith("finished"):
                return row
        if time.monotonic() >= deadline:
            return row
        time.sleep(1.0)


def run_in_simulation(
    job_dir: Path,
    sweep_root: Path,
    overrides: list[str],
    fed_config: str,
    timeout_s: float,
    app_dir: Path = APP_DIR,
    watch: Callable[[], str | None] | None = None,
) -> dict:
    """Submit the run of the app in `app_dir` with `flwr run --stream`, follow it to its end and read
    Flower's verdict. `watch`, called every few seconds while the run goes on, may stop it early
    by returning why (an Optuna trial's pruner); the result then carries `pruned`.

    `flwr run --stream` exits 0 even when the ServerApp fails, so the verdict comes from the
    run's state (`finished:completed` / `finished:failed` and its details).
    """
    run_config = job_dir / "run_config.toml"  # a file: no quoting trouble, and a record of what ran
    run_config.write_text(
        f"overrides = {json.dumps(' '.join(overrides))}\noutput-dir = {json.dumps(str(sweep_root))}\n"
    )
    home_root = os.environ.get(HOME_ROOT_ENV) or None  # default: the system's temp dir (node-local)
    if home_root:
        Path(home_root).mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="fedgpu-flwr-home-", dir=home_root))
    env = flower_env(home)
    cmd = [flwr_cli(), "run", str(app_dir), "--stream", "--run-config", str(run_config)]
    cmd += ["--federation-config", fed_config]
    deadline = time.monotonic() + timeout_s if timeout_s else float("inf")
    result: dict[str, Any] = {"run_id": None, "flwr_status": None, "error": None}
    log_path = job_dir / "flwr.log"
    try:
        with log_path.open("a") as out:
            out.write(f"\n=== {datetime.now(UTC).isoformat(timespec='seconds')} {' '.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(cmd, env=env, cwd=app_dir, stdout=out, stderr=subprocess.STDOUT)
            while proc.poll() is None:
                try:
                    proc.wait(timeout=max(0.1, min(WATCH_S, deadline - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() >= deadline:
                    result["error"] = f"timeout: the run did not finish within sweep.timeout_s={timeout_s:g} s"
                elif watch is not None and (reason := watch()):
                    result["pruned"] = reason
                else:
                    continue
                proc.kill()  # the CLI; the SuperLink and the run stop with the job's FLWR_HOME below
                proc.wait()
        text = strip_colours(log_path.read_text(errors="replace").rsplit("\n=== ", 1)[-1])
        match = RUN_ID.search(text)
        if match is None:
            result["error"] = result["error"] or "flwr run did not start a run: " + text.strip()[-2000:]
            return result
        result["run_id"] = int(match.group(1))
        if result["error"] is None and "pruned" not in result:
            status = run_status(env, match.group(1), min(deadline, time.monotonic() + STATUS_WAIT_S))
            result["flwr_status"] = status.get("status")
            if status.get("status") != "finished:completed":
                details = status.get("status-details") or "see flwr.log"
                result["error"] = f"Flower run {result['run_id']} {status.get('status', 'unknown')}: {details}"
        return result
    finally:
        try:
            stop_processes(str(home), grace_s=10.0)
        except RuntimeError as err:
            log.warning("%s", err)
        shutil.rmtree(home, ignore_errors=True)


# ----------------------------------------------------------------------------- the Hydra job


def run_job(cfg: DictConfig, job_dir: Path, task: list[str]) -> dict[str, Any]:
    """One sweep job; never raises (a failure is recorded in job.json and the sweep goes on)."""
    previous = read_job(job_dir)
    if previous.get("status") == "completed" or completed_summary(job_dir):
        if previous.get("status") != "completed":  # finished, but the sweep died before recording it
            previous = {**previous, "status": "completed", "error": None}
            write_job(job_dir, previous)
        log.info("skipping %s: completed earlier", job_dir.name)
        return {**previous, "skipped": True}
    record: dict[str, Any] = {
        "status": "running",
        "overrides": task,
        "job_dir": str(job_dir),
        "attempt": int(previous.get("attempt", 0)) + 1,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "error": None,
        "run_id": None,
    }
    write_job(job_dir, record)
    t0 = time.monotonic()
    try:
        validate(to_typed(cfg))  # a bad value fails here, in a second, not after Flower's start-up
        sweep_root = Path(sweep_dir(cfg.sweep.root, cfg.sweep.name))
        name = job_dir.resolve().relative_to(sweep_root).as_posix()
        overrides = [*app_overrides(task), f'name="{name}"', "resume=auto"]
        fed = federation_config(cfg)
        record.update(app_overrides=overrides, federation_config=fed)
        watch = trial_watch(cfg, sweep_root, job_dir)
        write_job(job_dir, record)
        record.update(run_in_simulation(job_dir, sweep_root, overrides, fed, float(cfg.sweep.timeout_s), watch=watch))
        summary = completed_summary(job_dir)
        if record["error"] is None and summary is None and not record.get("pruned"):
            record["error"] = "Flower reports the run completed, but it left no completed summary.json"
        if summary:
            # The run's primary metric; summaries from before configurable metrics have accuracy only.
            record["primary_metric"] = summary.get("primary_metric") or "accuracy"
            record["final_metric"] = summary.get("final_metric", summary.get("final_accuracy"))
            record["best_metric"] = summary.get("best_metric", summary.get("best_accuracy"))
    except Exception as err:  # noqa: BLE001 - a sweep job records every failure and returns
        record["error"] = f"{type(err).__name__}: {err}"
    record["status"] = "failed" if record["error"] else "pruned" if record.get("pruned") else "completed"
    record["duration_s"] = round(time.monotonic() - t0, 1)
    record["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    write_job(job_dir, record)
    if record["error"]:
        log.error("job %s failed: %s", job_dir.name, record["error"])
    elif record.get("pruned"):
        log.info("job %s %s, after %.0f s", job_dir.name, record["pruned"], record["duration_s"])
    else:
        log.info(
            "job %s completed in %.0f s: final %s %s",
            job_dir.name,
            record["duration_s"],
            record.get("primary_metric", "metric"),
            record.get("final_metric"),
        )
    return record


def trial_watch(cfg: DictConfig, sweep_root: Path, job_dir: Path) -> Callable[[], str | None] | None:
    """For a job that is an Optuna trial (`sweep.trial`, set by hydra/sweeper=optuna): report the
    run's rows to the trial as they come, and say when its pruner stops the federation."""
    if cfg.sweep.get("trial") is None:
        return None
    from app.tools.study import TrialReporter

    metric = metric_names({"task": {"metrics": OmegaConf.to_container(cfg.task.metrics)}})[0]
    reporter = TrialReporter(sweep_root, int(cfg.sweep.trial), metric)
    return lambda: reporter.check(read_rows(job_dir))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> dict[str, Any]:
    hc = HydraConfig.get()
    return run_job(cfg, Path(hc.runtime.output_dir), list(hc.overrides.task))


class SweepSummary(Callback):
    """At the end of a multirun: count the jobs' outcomes and write the report."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:  # noqa: ANN401
        root = Path(config.hydra.sweep.dir)
        jobs = [read_job(p.parent) for p in root.rglob(JOB_FILE)]
        counts = {s: sum(j.get("status") == s for j in jobs) for s in ("completed", "pruned", "failed", "running")}
        log.info("sweep %s: %s", root, ", ".join(f"{n} {s}" for s, n in counts.items() if n))
        for job in jobs:
            if job.get("status") == "failed":
                log.info("  failed: %s: %s", Path(job.get("job_dir", "?")).name, str(job.get("error"))[:300])
        try:
            from app.tools.report import write_report

            paths = write_report(root)
            log.info("report: %s", paths["md"])
        except Exception as err:  # noqa: BLE001 - the sweep's results stay valid without a report
            log.warning("no report: %s", err)


def cli() -> None:
    """Console script `fedgpu-sweep`."""
    main()
