"""`hydra/sweeper=optuna` (conf/hydra/sweeper/optuna.yaml): Hydra's side of app/tools/study.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


class OptunaSweeper(Sweeper):
    """Asks Optuna for trials, launches each as a sweep job through the configured launcher
    (several at once with `n_jobs` and hydra/launcher=joblib) and tells it how each ended."""

    def __init__(self, params: dict[str, str] | None = None, **settings: Any) -> None:  # noqa: ANN401
        self.params = dict(params or {})
        self.settings = settings
        self.config: DictConfig | None = None
        self.launcher = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:  # noqa: ANN401
        from app.tools.study import StudySettings, run_study

        assert self.config is not None and self.launcher is not None
        sweep_dir = Path(self.config.hydra.sweep.dir)
        settings = dict(self.settings)
        settings["storage"] = settings.get("storage") or f"sqlite:///{sweep_dir / 'optuna.db'}"
        settings["study_name"] = settings.get("study_name") or str(self.config.sweep.name)
        settings["max_rounds"] = int(settings.get("max_rounds") or self.config.federation.rounds)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        job_index = 0

        def launch(batch: list[list[str]]) -> Any:  # noqa: ANN401
            nonlocal job_index
            self.validate_batch_is_legal(batch)
            results = self.launcher.launch(batch, initial_job_idx=job_index)
            job_index += len(batch)
            return results

        return run_study(StudySettings(**settings), sweep_dir, arguments, self.params, launch)
