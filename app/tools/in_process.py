"""A whole federation in this process: the config composed from Hydra overrides, the
ServerApp's loop, and the real ClientApp on an in-process grid (no SuperLink, no Ray).

The one way tests and bench/ scripts run a federation. It lives in app.tools, not next to
the grid in app.simulation, because it joins the server's run code and the ClientApp,
which only tools may import together (docs/architecture.md, tests/test_layout.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Message

from app.client_app import app as client_app
from app.config.compose import load_config
from app.run.federation import run_federation
from app.simulation.local_grid import InProcessGrid


def run_in_process(
    overrides: str,
    root: Path | str,
    *,
    nodes: int = 3,
    workers: int = 0,
    tamper: Callable[[int, Message], Message | None] | None = None,
    grid: InProcessGrid | None = None,
) -> tuple[dict[str, Any], InProcessGrid]:
    """Compose the config from the Hydra `overrides`, run the federation as the ServerApp
    does (results under `root`) on an in-process grid of `nodes` nodes running the real
    ClientApp, and return the run's summary and the grid (its counters, node Contexts).

    `workers` > 0: nodes train concurrently in that many threads (see InProcessGrid).
    `grid`: one the caller built (e.g. because its `tamper` refers to it); `nodes`,
    `workers` and `tamper` are then ignored. The grid's worker threads are stopped before
    this returns, also when the run raises.
    """
    cfg, raw = load_config(overrides)
    if grid is None:
        grid = InProcessGrid(client_app, nodes, tamper=tamper, workers=workers)
    try:
        return run_federation(grid, cfg, raw, Path(root)), grid
    finally:
        grid.close()
