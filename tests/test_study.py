"""Optuna sweeps (app/tools/study.py, hydra/sweeper=optuna): the search space from Hydra's sweep
syntax, trials told how their jobs ended, the median pruner stopping a hopeless curve from the
job's side, a study that resumes (and retries a trial a killed sweep left running), the report's
study section; a real sweep of two federations through `flwr run` among the slow tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from app.tools.report import write_report
from app.tools.study import StudySettings, TrialReporter, run_study, search_space, study_markdown, trial_overrides
from app.tools.sweep import APP_DIR

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_the_search_space_reads_hydras_sweep_syntax_and_the_command_line_wins() -> None:
    params = {"train.epochs": "range(1, 4)", "train.lr": "interval(0.5, 0.9)"}
    args = ["train.lr=tag(log, interval(0.001, 0.1))", "strategy.proximal_mu=interval(0, 0.1)", "seed=3",
            "strategy=choice(fedavg, krum)", "train.batch_size=tag(int, interval(8, 64))"]  # fmt: skip
    distributions, fixed, written = search_space(params, args)
    assert distributions == {
        "train.epochs": IntDistribution(1, 3),  # Hydra's range excludes its stop
        "train.lr": FloatDistribution(0.001, 0.1, log=True),
        "strategy.proximal_mu": FloatDistribution(0.0, 0.1),
        "strategy": CategoricalDistribution(["fedavg", "krum"]),
        "train.batch_size": IntDistribution(8, 64),
    }
    assert fixed == ["seed=3"]
    assert written["train.lr"] == "tag(log, interval(0.001, 0.1))"
    assert trial_overrides({"train.lr": 0.01, "strategy": "krum"}, fixed, 4) == [
        "seed=3", "train.lr=0.01", "strategy=krum", "sweep.trial=4"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("params", "args", "reason"),
    [
        ({}, ["seed=1"], "nothing to search"),
        ({}, ["train.lr=interval(0.1, 0.2)", "sweep.trial=3"], "sweep.trial is set by the Optuna sweeper"),
        ({}, ["train.lr=glob(*)"], "not a sweep Optuna can search"),
    ],
)
def test_a_bad_search_space_is_refused(params: dict, args: list[str], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        search_space(params, args)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"n_trials": 0}, "n_trials=0"),
        ({"sampler": "grid"}, "sampler='grid'"),
        ({"pruner": "asha"}, "pruner='asha'"),
        ({"objective": "mean"}, "objective='mean'"),
        ({"warmup_rounds": -1}, "must be >= 0"),
    ],
)
def test_bad_settings_are_refused_before_any_trial(tmp_path: Path, change: dict, reason: str) -> None:
    settings = StudySettings(study_name="s", storage=f"sqlite:///{tmp_path / 'o.db'}", **change)
    launched: list[Any] = []
    with pytest.raises(ValueError, match=reason):
        run_study(settings, tmp_path, ["train.lr=interval(0.1, 0.2)"], {}, launched.append)
    assert not launched and not (tmp_path / "o.db").exists()


@dataclass
class _Return:
    return_value: dict[str, Any]


def _curve(lr: float, rnd: int) -> float:
    """A federation's accuracy: higher lr learns faster (lr 0.1: 0.2 in round 1, 0.6 in round 5)."""
    return 0.1 + lr * rnd


def _fake_launch(sweep_dir: Path, rounds: int, seen: list[list[str]]):  # noqa: ANN202
    """Jobs as app/tools/sweep.py runs them, without Flower: each reports its rows to its trial
    through TrialReporter after every round and stops when the pruner says so."""

    def launch(batch: list[list[str]]) -> list[_Return]:
        out = []
        for overrides in batch:
            seen.append(overrides)
            values = dict(o.split("=", 1) for o in overrides)
            reporter = TrialReporter(sweep_dir, int(values["sweep.trial"]), "accuracy")
            rows: list[dict[str, Any]] = []
            record: dict[str, Any] = {"status": "completed"}
            for rnd in range(1, rounds + 1):
                rows.append({"round": rnd, "accuracy": _curve(float(values["train.lr"]), rnd)})
                if reason := reporter.check(rows):
                    record = {"status": "pruned", "pruned": reason}
                    break
            if record["status"] == "completed":
                record |= {"final_metric": rows[-1]["accuracy"], "best_metric": max(r["accuracy"] for r in rows)}
            out.append(_Return(record))
        return out

    return launch


def test_a_study_prunes_a_hopeless_curve_resumes_and_reports(tmp_path: Path) -> None:
    """Trial 0 (lr 0.1) completes; trial 1 (lr 0.001) is below trial 0's curve at round 2 and is
    pruned there; the study's best is trial 0 with its final value; running the study again with
    more trials launches only the missing ones; the report shows the study."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    settings = StudySettings(study_name="t", storage=storage, n_trials=2, startup_trials=1, warmup_rounds=2)
    # the first two draws of the sampler: lr 0.1, then lr 0.001 (a categorical, seeded)
    space = ["train.lr=choice(0.1, 0.001)", "seed=0"]
    seen: list[list[str]] = []
    for seed in range(50):  # the seed whose first two draws are 0.1 then 0.001
        probe = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))
        draws = [probe.ask({"train.lr": CategoricalDistribution([0.1, 0.001])}).params["train.lr"] for _ in range(2)]
        if draws == [0.1, 0.001]:
            break
    settings = StudySettings(**{**settings.__dict__, "seed": seed})
    study = run_study(settings, tmp_path, space, {}, _fake_launch(tmp_path, 5, seen))
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert trials[0].value == pytest.approx(_curve(0.1, 5)) and sorted(trials[0].intermediate_values) == [1, 2, 3, 4, 5]
    # the median pruner: round 1 is warm-up; at round 2 trial 1's 0.102 < trial 0's 0.3
    assert trials[1].last_step == 2 and trials[1].intermediate_values[2] == pytest.approx(_curve(0.001, 2))
    assert [o[-1] for o in seen] == ["sweep.trial=0", "sweep.trial=1"] and all(o[0] == "seed=0" for o in seen)
    assert json.loads((tmp_path / "study.json").read_text())["search_space"] == {"train.lr": "choice(0.1, 0.001)"}

    # a sweep killed mid-trial leaves it running: the next sweep fails it and retries its parameters first
    left = study.ask({"train.lr": CategoricalDistribution([0.1, 0.001])})
    more = StudySettings(**{**settings.__dict__, "n_trials": 4})
    seen.clear()
    study = run_study(more, tmp_path, space, {}, _fake_launch(tmp_path, 5, seen))
    states = [t.state for t in study.get_trials()]
    assert states[left.number] == TrialState.FAIL and len(states) == 5
    # the interrupted trial does not count: its values first, then one more, for 4 finished
    assert len(seen) == 2 and f"train.lr={left.params['train.lr']}" in seen[0]
    assert study.best_trial.number == 0

    lines = "\n".join(study_markdown(tmp_path, tmp_path))
    assert "**Best trial 0**: 0.6000 with `train.lr=0.1`" in lines
    assert "Pruned: trial 1 at round 2 (0.1020)" in lines
    assert "Parameter importance" in lines and (tmp_path / "study.png").stat().st_size > 1000


def test_the_sweep_command_finds_the_sweeper_and_refuses_an_empty_space_before_any_job(tmp_path: Path) -> None:
    """Hydra loads hydra/sweeper=optuna from hydra_plugins/ and the refusal reaches the user."""
    proc = subprocess.run(
        [sys.executable, "-m", "app.sweep", "--multirun", "hydra/sweeper=optuna", "seed=1", f"sweep.root={tmp_path}"],
        cwd=APP_DIR, env={**os.environ, "HYDRA_FULL_ERROR": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and "nothing to search" in proc.stderr, proc.stderr[-3000:]
    assert not list(tmp_path.rglob("job.json")) and not list(tmp_path.rglob("optuna.db"))


def test_a_launcher_that_fails_fails_its_trials_and_stops_the_sweep(tmp_path: Path) -> None:
    """Not a job's failure (recorded, the study goes on) but the launcher's: the trial is failed,
    not left running, and the error reaches the user."""
    settings = StudySettings(study_name="s", storage=f"sqlite:///{tmp_path / 'o.db'}", n_trials=3)

    def broken(batch: list[list[str]]) -> list[_Return]:
        raise OSError(36, "File name too long")

    with pytest.raises(OSError, match="File name too long"):
        run_study(settings, tmp_path, ["train.lr=interval(0.1, 0.2)"], {}, broken)
    study = optuna.load_study(study_name="s", storage=settings.storage)
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL]


def test_a_job_of_a_missing_study_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="study.json is missing"):
        TrialReporter(tmp_path, 0, "accuracy")


# ----------------------------------------------------------------------------- slow: real federations


@pytest.mark.slow
def test_an_optuna_sweep_of_two_federations_prunes_one_and_reports_the_study(tmp_path: Path) -> None:
    """Two trials through `flwr run` (3 nodes, up to 3 rounds): the first (lr 0.05) completes, the
    second (lr 1e-5, a curve that stays at chance) is pruned by the median pruner before its last
    round; job.json, the study and `python -m app.report` agree."""
    seed = next(
        s
        for s in range(50)
        if [
            p.params["train.lr"]
            for p in (lambda st: [st.ask({"train.lr": CategoricalDistribution([0.05, 1e-05])}) for _ in range(2)])(
                optuna.create_study(sampler=optuna.samplers.TPESampler(seed=s))
            )
        ]
        == [0.05, 1e-05]
    )
    args = [
        "--multirun", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", f"hydra.sweeper.seed={seed}",
        "hydra.sweeper.warmup_rounds=0", "hydra.sweeper.startup_trials=1", "train.lr=choice(0.05, 1e-05)",
        "federation.rounds=3", "train.epochs=1", "simulation.num_supernodes=3", "sweep.name=tune", f"sweep.root={tmp_path}",
    ]  # fmt: skip
    env = {**os.environ, "FEDGPU_FLWR_HOME_ROOT": str(tmp_path / "homes"), "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "app.sweep", *args], cwd=APP_DIR, env=env, capture_output=True, text=True, timeout=1200
    )
    print(proc.stdout[-4000:], proc.stderr[-6000:])
    assert proc.returncode == 0
    sweep = tmp_path / "tune"
    jobs = {json.loads(p.read_text())["overrides"][-2]: json.loads(p.read_text()) for p in sweep.glob("*/job.json")}
    assert jobs["train.lr=0.05"]["status"] == "completed"
    pruned = jobs["train.lr=1e-05"]
    assert pruned["status"] == "pruned" and pruned["error"] is None and "pruned at round" in pruned["pruned"]
    # Whether the federation was still running when the pruner's verdict came is not asserted: the
    # job polls its rows every 2 s, and a loaded CI machine has finished three short rounds by then.
    settings = json.loads((sweep / "study.json").read_text())
    study = optuna.load_study(study_name=settings["study_name"], storage=settings["storage"])
    complete, cut = study.get_trials()
    assert complete.state == TrialState.COMPLETE and sorted(complete.intermediate_values) == [1, 2, 3]
    assert complete.value == pytest.approx(jobs["train.lr=0.05"]["final_metric"])
    assert cut.state == TrialState.PRUNED and cut.last_step < 3
    report = write_report(sweep)
    text = report["md"].read_text()
    assert "## Study `tune` (Optuna)" in text and "**Best trial 0**" in text and "(+1 pruned)" in text
    assert report["study_png"].is_file()
