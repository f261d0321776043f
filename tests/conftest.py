"""Shared fixtures, and the one list of slow tests.

`python -m pytest` runs the fast suite: pyproject.toml's addopts deselect `slow`. CI
(.ci/run) and `python -m pytest -m ""` run everything; `-m slow` only the slow part.
Helpers the tests import live in tests/helpers.py and in the app (see there).

Slow means one of:
  * end to end through real Flower processes (SuperLink, SuperNodes, `flwr run`):
    each costs from ~20 s to minutes of start-up, polling and teardown;
  * a federation long enough to show an effect (an attack's damage, a privacy budget
    running out, an asynchronous speedup) rather than that the path works.
The fast suite still runs one short in-process federation per strategy family (FedAvg,
robust, FedBuff, central DP, local DP), so every module is exercised by default.

The marks are set here, by module or by test / fixture name, never in the test files,
so the split is in one place; collection fails if a listed module, test or fixture is
gone (a renamed test must not silently become fast or stay slow by accident).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from app.simulation.local_grid import act_as_server

act_as_server()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch thread per xdist worker, in this process and in the Flower processes it starts:
    # two workers with a thread per core each on a 2-core machine spin against each other in
    # OpenMP (tests/test_attacks.py's inflated-count federation: 964 s in such a CI run, 72 s alone).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

HERE = Path(__file__).resolve().parent

# Whole modules: every test in them starts real Flower processes or subprocesses.
SLOW_MODULES: dict[str, str] = {
    "test_flwr_cli": "`flwr run` through the local simulation SuperLink",
    "test_superlink_loopback": "a SuperLink, SuperNodes and the flwr CLI on loopback (deployment path)",
    "test_gpu_smoke": "scripts/gpu_smoke.py --quick --device cpu in a subprocess (~30 s)",
    "test_gpu_check": "bench/gpu_check.py --quick --device cpu, and a ClientApp process it starts (~25 s)",
    "test_scale": "two federations of 100 and 1000 nodes, each in its own process",
    "test_soak": "the shortened soak: a supervised secure stack through node, ServerApp and SuperLink kills (~5 min)",
}

# Modules that mix fast and slow tests: the slow ones, by test function name (every
# parametrization of it) or by the name of a fixture defined in that module (every test
# that uses it).
SLOW_TESTS: dict[str, set[str]] = {
    # real Flower processes
    "test_register_nodes": {"superlink"},  # the fixture starts a SuperLink with node authentication
    "test_sweep": {  # real Hydra multiruns through `flwr run`
        "test_two_by_two_sweep_records_a_failure_goes_on_and_skips_completed_jobs_when_rerun",
        "test_a_failing_serverapp_is_recorded_with_flowers_verdict",
        "test_a_sweep_over_a_custom_task_reports_its_primary_metric",
    },
    # long federations
    "test_attacks": {"test_inflated_counts_leave_capped_fedavg_and_multikrum_near_the_clean_run"},
    "test_examples": {  # each example's whole federation in process (tens of seconds to minutes)
        "test_breast_cancer_example_ranks_tumours_well",
        "test_finetune_example_sends_only_the_head_and_keeps_the_body",
        "test_torchvision_example_learns_the_digits",
    },
    "test_own_task": {"test_a_custom_task_composes_with_the_rest"},  # seven federations
    "test_recovery": {"test_a_killed_serverapp_is_stopped_and_resubmitted_until_the_run_completes"},  # flwr run
    "test_fleet": {"test_the_same_seed_gives_the_same_run_whatever_the_number_of_workers"},  # four federations
    "test_monitoring": {"prometheus"},  # the fixture starts a real Prometheus server
    "test_distributed": {"test_two_gloo_ranks_equal_one_process_and_a_rank_that_dies_fails_only_its_task"},
}


def _module_name(item: pytest.Item) -> str | None:
    """The module name ("test_x") of a test in tests/test_x.py; None for anything else."""
    module = getattr(item, "module", None)
    path = Path(getattr(module, "__file__", None) or "")
    return path.stem if path.parent == HERE else None


def _check_listed(items: list[pytest.Item]) -> None:
    """Fail collection when a listed module is not in tests/, or a listed name is not defined
    in its module (checked for the modules collected in this session)."""
    missing = [f"tests/{m}.py" for m in sorted({*SLOW_MODULES, *SLOW_TESTS}) if not (HERE / f"{m}.py").is_file()]
    modules = {name: item.module for item in items if (name := _module_name(item)) is not None}
    for name, module in sorted(modules.items()):
        missing += [f"tests/{name}.py::{t}" for t in sorted(SLOW_TESTS.get(name, ())) if not hasattr(module, t)]
    if missing:
        raise pytest.UsageError(
            f"tests/conftest.py marks as slow what does not exist: {', '.join(missing)}; update SLOW_MODULES / SLOW_TESTS"
        )


# CI runs the suite on two pytest-xdist workers (.ci/run: `-n 2 --dist loadgroup`). These
# modules mostly wait (heartbeats, back-off, process start-up) and their timeouts assume one
# federation at a time: they run in order on one worker, first, while the other worker takes
# everything else.
SERIAL_FIRST = ("test_superlink_loopback",)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _check_listed(items)
    for item in items:
        name = _module_name(item)
        listed = SLOW_TESTS.get(name, set())
        by_name = getattr(item, "originalname", item.name) in listed  # every parametrization
        if name in SLOW_MODULES or by_name or listed & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if name in SERIAL_FIRST:
            item.add_marker(pytest.mark.xdist_group("serial-first"))
    items.sort(key=lambda item: _module_name(item) not in SERIAL_FIRST)  # stable: otherwise in file order


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture
def model_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "conv.weight": rng.normal(size=(4, 3, 3, 3)).astype(np.float32),
        "conv.bias": rng.normal(size=(4,)).astype(np.float32),
        "fc.weight": rng.normal(size=(10, 4)).astype(np.float32),
    }
