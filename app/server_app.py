"""The ServerApp: compose and validate the Hydra config, then run the federation.

Run config keys (pyproject.toml): `overrides` (Hydra overrides for conf/) and
`output-dir` (absolute results root; empty = ~/fedgpu-runs).

Its first log line names the Python environment it runs in (app/run/environment.py): the
local SuperLink runs every `flwr run` in the environment that started it, whichever venv
`flwr run` was called from.
"""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from app.config.compose import load_config
from app.config.schema import ConfigError
from app.run.environment import log_environment
from app.run.federation import run_federation
from app.run.results import output_root
from app.task.data import DatasetUnavailableError
from strategies.liveness import Stalled
from strategies.node_wait import TooFewNodes

log = logging.getLogger("flwr.fedgpu." + __name__)

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    log_environment()
    overrides = str(context.run_config.get("overrides", ""))
    try:
        root = output_root(str(context.run_config.get("output-dir", "")))
        cfg, raw = load_config(overrides)
    except ConfigError as err:
        log.error("invalid configuration, nothing was run: %s", err)
        raise
    log.info("overrides: %r", overrides)
    try:
        run_federation(grid, cfg, raw, root)
    except (ConfigError, DatasetUnavailableError, TooFewNodes, Stalled) as err:
        log.error("%s", err)
        raise
