"""Optuna studies over whole federations: `python -m app.sweep --multirun hydra/sweeper=optuna ...`.

    python -m app.sweep --multirun hydra/sweeper=optuna hydra.sweeper.n_trials=20 sweep.name=tune \
        'train.lr=tag(log, interval(0.003, 0.1))' 'strategy.proximal_mu=interval(0, 0.1)'
    python -m app.report ~/fedgpu-runs/sweeps/tune      # the runs' table and the study

Each trial is one sweep job (app/tools/sweep.py: one federation through `flwr run`, its own
directory, resumable); its objective is the final value of the run's primary metric (every
metric is higher-is-better, so the study maximizes). While the federation runs, the job reports
each round's value to the trial and asks the study's pruner whether to go on: a federation whose
curve is below the median of earlier trials at the same round (or outside Hyperband's bracket) is
stopped and recorded as pruned, with the round. The study lives in an Optuna storage (default
`sqlite:///<sweep dir>/optuna.db`), so the same command again continues it: finished trials count
towards `n_trials`, and trials a killed sweep left running are retried first with the same
parameters (their jobs resume from their checkpoints).

Why not hydra-optuna-sweeper: its last release (1.2.0) pins optuna<3 and runs every job to its
end (no pruner); the search-space syntax here is that plugin's (Hydra's choice/range/interval
sweeps, `tag(log, ...)`, `tag(int, ...)`), so its users' commands carry over.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from app.tools.report import STUDY_FILE  # in the sweep directory: where the study is and how it prunes

log = logging.getLogger(__name__)

INTERRUPTED = "interrupted"  # study user attribute: trials a killed sweep left running (retried, not counted)
TRIAL_KEY = "sweep.trial"  # the job override naming its trial (left out of job directories and the app's overrides)
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "hyperband", "none")
OBJECTIVES = ("final", "best")


@dataclass(frozen=True)
class StudySettings:
    """`hydra.sweeper.*` (conf/hydra/sweeper/optuna.yaml), as written to study.json."""

    study_name: str
    storage: str
    n_trials: int = 20
    n_jobs: int = 1
    sampler: str = "tpe"
    seed: int = 0
    pruner: str = "median"
    warmup_rounds: int = 3
    startup_trials: int = 2
    max_rounds: int = 0  # hyperband's max resource; 0: federation.rounds of the sweep's config
    objective: str = "final"
    search_space: dict[str, str] = field(default_factory=dict)  # key -> the override as given, for the report

    def check(self) -> None:
        """Refuse bad settings before any federation starts."""
        problems = []
        if self.n_trials < 1:
            problems.append(f"n_trials={self.n_trials} must be at least 1")
        if self.n_jobs < 1:
            problems.append(f"n_jobs={self.n_jobs} must be at least 1")
        if self.sampler not in SAMPLERS:
            problems.append(f"sampler={self.sampler!r} must be one of {', '.join(SAMPLERS)}")
        if self.pruner not in PRUNERS:
            problems.append(f"pruner={self.pruner!r} must be one of {', '.join(PRUNERS)}")
        if self.objective not in OBJECTIVES:
            problems.append(f"objective={self.objective!r} must be one of {', '.join(OBJECTIVES)}")
        if self.warmup_rounds < 0 or self.startup_trials < 0 or self.max_rounds < 0:
            problems.append("warmup_rounds, startup_trials and max_rounds must be >= 0")
        if problems:
            raise ValueError("hydra.sweeper (optuna): " + "; ".join(problems))

    def sampler_object(self) -> optuna.samplers.BaseSampler:
        if self.sampler == "random":
            return optuna.samplers.RandomSampler(seed=self.seed)
        return optuna.samplers.TPESampler(seed=self.seed)

    def pruner_object(self) -> optuna.pruners.BasePruner:
        """The study's pruner; the jobs build the same one from study.json (Optuna keeps no pruner in storage)."""
        if self.pruner == "median":
            return optuna.pruners.MedianPruner(n_startup_trials=self.startup_trials, n_warmup_steps=self.warmup_rounds)
        if self.pruner == "hyperband":
            return optuna.pruners.HyperbandPruner(
                min_resource=max(1, self.warmup_rounds), max_resource=self.max_rounds or "auto"
            )
        return optuna.pruners.NopPruner()

    def open(self) -> optuna.Study:
        return optuna.create_study(
            study_name=self.study_name,
            storage=self.storage,
            sampler=self.sampler_object(),
            pruner=self.pruner_object(),
            direction="maximize",  # every metric of the app is higher-is-better (app/task/metrics.py)
            load_if_exists=True,
        )

    def save(self, sweep_dir: Path) -> None:
        (sweep_dir / STUDY_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")


def read_settings(sweep_dir: Path) -> StudySettings | None:
    try:
        return StudySettings(**json.loads((Path(sweep_dir) / STUDY_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


# ----------------------------------------------------------------------------- the search space


def _distribution(override: Override) -> BaseDistribution:
    """An Optuna distribution from a Hydra sweep override (hydra-optuna-sweeper's rules): choice ->
    categorical; range -> int (or categorical for floats), its stop excluded as in Hydra; interval
    -> float, `tag(int, ...)` int, `tag(log, ...)` log-uniform."""
    value = override.value()
    if isinstance(value, ChoiceSweep):
        return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
    if isinstance(value, RangeSweep):
        if all(isinstance(v, int) for v in (value.start, value.stop, value.step)) and not value.shuffle:
            return IntDistribution(int(value.start), int(value.stop) - int(value.step), step=int(value.step))
        return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if "int" in value.tags:
            return IntDistribution(int(value.start), int(value.end), log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    raise ValueError(f"{override.input_line}: not a sweep Optuna can search (choice, range or interval)")


def search_space(
    params: Mapping[str, str], arguments: Sequence[str]
) -> tuple[dict[str, BaseDistribution], list[str], dict[str, str]]:
    """(distributions, fixed overrides, the space as written) from `hydra.sweeper.params` and the
    command line's overrides; a key on the command line wins over the same key in params."""
    parser = OverridesParser.create()
    lines = [f"{key}={value}" for key, value in (params or {}).items()]
    distributions: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    written: dict[str, str] = {}
    for override in parser.parse_overrides([*lines, *arguments]):
        key = override.get_key_element()
        if override.key_or_group == TRIAL_KEY:
            raise ValueError(f"{TRIAL_KEY} is set by the Optuna sweeper for each trial; drop it from the overrides")
        distributions.pop(key, None)
        fixed.pop(key, None)
        written.pop(key, None)
        if override.is_sweep_override():
            try:
                distributions[key] = _distribution(override)
            except ValueError as err:
                raise ValueError(f"hydra.sweeper (optuna): {err}") from err
            written[key] = override.input_line.partition("=")[2]
        else:
            fixed[key] = override.input_line
    if not distributions:
        raise ValueError(
            "hydra.sweeper (optuna): nothing to search; give at least one key a choice, range or interval, "
            "e.g. 'train.lr=tag(log, interval(0.001, 0.1))' or hydra.sweeper.params"
        )
    return distributions, list(fixed.values()), written


def trial_overrides(params: Mapping[str, Any], fixed: Sequence[str], number: int) -> list[str]:
    """A trial's job overrides: the fixed ones, the trial's values, its number (for pruning)."""
    return [*fixed, *(f"{key}={value}" for key, value in params.items()), f"{TRIAL_KEY}={number}"]


# ----------------------------------------------------------------------------- the sweep


def run_study(
    settings: StudySettings,
    sweep_dir: Path,
    arguments: Sequence[str],
    params: Mapping[str, str],
    launch: Callable[[list[list[str]]], Sequence[Any]],
) -> optuna.Study:
    """Ask, launch and tell until the study has `n_trials` finished trials; returns the study.
    `launch` runs a batch of jobs' overrides and returns Hydra's JobReturns (`.return_value`)."""
    distributions, fixed, written = search_space(params, arguments)
    settings = StudySettings(**{**asdict(settings), "search_space": written})
    settings.check()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    settings.save(sweep_dir)
    study = settings.open()
    interrupted = set(study.user_attrs.get(INTERRUPTED, []))
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        # A sweep killed mid-trial: the trial fails without counting, its values are tried first
        # again, and their job resumes from its checkpoint.
        study.tell(trial.number, state=TrialState.FAIL)
        study.enqueue_trial(trial.params, skip_if_exists=False)
        interrupted.add(trial.number)
        log.info("trial %d was left running by an earlier sweep: retried with the same parameters", trial.number)
    study.set_user_attr(INTERRUPTED, sorted(interrupted))
    finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)

    def done() -> int:
        return sum(t.number not in interrupted for t in study.get_trials(deepcopy=False, states=finished))

    log.info("study %s in %s: %d of %d trials done", settings.study_name, settings.storage, done(), settings.n_trials)
    while (left := settings.n_trials - done()) > 0:
        trials = [study.ask(distributions) for _ in range(min(settings.n_jobs, left))]
        batch = [trial_overrides(t.params, fixed, t.number) for t in trials]
        try:
            results = launch(batch)
        except Exception:  # the launcher itself failed (not a job: jobs record their failures)
            for trial in trials:
                study.tell(trial, state=TrialState.FAIL)
            raise
        for trial, result in zip(trials, results, strict=True):
            tell(study, trial, result.return_value, settings.objective)
    if any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        best = study.best_trial
        log.info("best trial %d: %s %.4f with %s", best.number, settings.objective, best.value, best.params)
    return study


def tell(study: optuna.Study, trial: optuna.trial.Trial, record: Mapping[str, Any], objective: str) -> None:
    """Tell the study how a trial's job ended (app/tools/sweep.py's job record)."""
    status = record.get("status")
    value = record.get("final_metric" if objective == "final" else "best_metric")
    if status == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
    elif status == "completed" and value is not None:
        study.tell(trial, float(value))
    else:
        log.warning("trial %d failed: %s", trial.number, record.get("error"))
        study.tell(trial, state=TrialState.FAIL)


# ----------------------------------------------------------------------------- inside a job


class TrialReporter:
    """A sweep job's side of its trial: reports each new round's value of the primary metric and
    says when the study's pruner would stop the federation."""

    def __init__(self, sweep_dir: Path, number: int, metric: str) -> None:
        settings = read_settings(sweep_dir)
        if settings is None:
            raise ValueError(
                f"{TRIAL_KEY}={number} but {Path(sweep_dir) / STUDY_FILE} is missing: run trials through hydra/sweeper=optuna"
            )
        study = optuna.load_study(
            study_name=settings.study_name, storage=settings.storage, pruner=settings.pruner_object()
        )
        frozen = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
        if frozen is None:
            raise ValueError(f"study {settings.study_name} has no trial {number}")
        self.trial = optuna.trial.Trial(study, frozen._trial_id)  # Optuna's own handle of a running trial
        self.metric = metric
        self.reported: set[int] = set(frozen.intermediate_values)

    def check(self, rows: Sequence[Mapping[str, Any]]) -> str | None:
        """Report the rows not reported yet; why to stop, if the pruner says so."""
        for row in rows:
            rnd, value = row.get("round"), row.get(self.metric)
            if value is None or rnd is None or rnd in self.reported:
                continue
            self.trial.report(float(value), int(rnd))
            self.reported.add(int(rnd))
            if self.trial.should_prune():
                return f"pruned at round {rnd}: {self.metric} {float(value):.4f} (the study's pruner stops this curve)"
        return None


# ----------------------------------------------------------------------------- the report


def study_markdown(sweep_dir: Path, out: Path) -> list[str]:
    """The report's study section (and `study.png`, the trials' curves) when `sweep_dir` holds a study."""
    settings = read_settings(sweep_dir)
    if settings is None:
        return []
    try:
        study = optuna.load_study(study_name=settings.study_name, storage=settings.storage)
    except KeyError:
        return ["", f"## Study `{settings.study_name}`", "", f"Not found in {settings.storage}."]
    trials = study.get_trials(deepcopy=False)
    counts = {
        s.name.lower(): sum(t.state == s for t in trials)
        for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING)
    }
    lines = [
        "",
        f"## Study `{settings.study_name}` (Optuna)",
        "",
        f"{len(trials)} trials ({', '.join(f'{n} {s}' for s, n in counts.items() if n)}); objective: the {settings.objective} "
        f"value of the primary metric, maximized; sampler {settings.sampler} (seed {settings.seed}), pruner {settings.pruner}"
        + (
            f" (no pruning before round {settings.warmup_rounds}, nor in the first {settings.startup_trials} trials)"
            if settings.pruner == "median"
            else ""
        )
        + f"; storage `{settings.storage}`.",
        "",
        "Search space: " + ", ".join(f"`{k}={v}`" for k, v in settings.search_space.items()) + ".",
    ]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        lines += [
            "",
            f"**Best trial {best.number}**: {best.value:.4f} with "
            + ", ".join(f"`{k}={v}`" for k, v in best.params.items())
            + ".",
        ]
        lines += ["", *importance_lines(study, len(complete))]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    if pruned:
        lines += [
            "",
            "Pruned: "
            + "; ".join(
                f"trial {t.number} at round {t.last_step} ({t.intermediate_values[t.last_step]:.4f})"
                for t in pruned
                if t.last_step is not None
            )
            + ".",
        ]
    lines += [
        "",
        "| trial | state | value | rounds reported | " + " | ".join(f"`{k}`" for k in settings.search_space) + " |",
        "|---|---|---|---|" + "---|" * len(settings.search_space),
    ]
    for t in trials:
        value = f"{t.value:.4f}" if t.value is not None else "–"
        lines.append(
            f"| {t.number} | {t.state.name.lower()} | {value} | {len(t.intermediate_values)} | "
            + " | ".join(str(t.params.get(k, "–")) for k in settings.search_space)
            + " |"
        )
    if any(t.intermediate_values for t in trials):
        plot_trials(trials, study.best_trial if complete else None, out / "study.png")
        lines += ["", "![the trials' curves, the best in bold](study.png)"]
    return lines


def importance_lines(study: optuna.Study, complete: int) -> list[str]:
    """Each parameter's importance over the completed trials (Optuna's default evaluator, normalised to sum to 1)."""
    if complete < 2:
        return ["Parameter importance needs at least 2 completed trials."]
    try:
        importances = optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError) as err:  # e.g. every trial with the same value
        return [f"Parameter importance: not computed ({err})."]
    return [
        "Parameter importance (Optuna's `get_param_importances`, summing to 1): "
        + ", ".join(f"`{k}` {v:.2f}" for k, v in importances.items())
        + "."
    ]


def plot_trials(trials: Sequence[optuna.trial.FrozenTrial], best: optuna.trial.FrozenTrial | None, out: Path) -> Path:
    """Every trial's reported curve (pruned ones end in a cross), the best trial's in bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for t in trials:
        if not t.intermediate_values:
            continue
        steps = sorted(t.intermediate_values)
        values = [t.intermediate_values[s] for s in steps]
        is_best = best is not None and t.number == best.number
        ax.plot(
            steps,
            values,
            color="C3" if is_best else "0.6",
            lw=2.5 if is_best else 1,
            zorder=3 if is_best else 1,
            label=f"best: trial {t.number}" if is_best else None,
        )
        if t.state == TrialState.PRUNED:
            ax.plot(
                steps[-1],
                values[-1],
                "x",
                color="0.3",
                label="pruned" if "pruned" not in ax.get_legend_handles_labels()[1] else None,
            )
    ax.set_xlabel("round")
    ax.set_ylabel("primary metric")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[1]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
